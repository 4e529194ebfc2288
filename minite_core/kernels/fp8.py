"""Per-row E4M3 operands for the FP8 backward (`backward="fp8"`, minite_core/backward.py), in one kernel.

The recipe (`backward.e4m3_rows`, torch): each row of an operand, zero-padded to multiples of 16 in both
dimensions (the FP8 GEMM's alignment), is divided by its scale s = amax / 448 (1 for a zero row) and
rounded to E4M3 with ties to even, so row ~= q * s. In torch that is pad, abs, amax, divide, cast, and for
the operands the backward reads transposed (g.T, W.T, Q(x).T) a transposed copy first: about eight passes
over each operand, which cost more than the e4m3 GEMM saves over bf16 (docs/benchmarks.md, issue 18).

`e4m3_rows_triton(a)` reads a [R, C] through its strides (a transposed view costs no copy), one program
per BLOCK_R rows: a first walk along the row takes the amax, a second multiplies by the row's reciprocal
scale (IEEE `div_rn` once a row, as torch's `1 / scale`) and encodes, writing the padded [RP, CP] bytes and
the [RP, 1] scales. On the GPU the encoding is the hardware's fp32 -> e4m3 conversion (`cvt.rn.satfinite`,
round to nearest even, sm_89+: one instruction for two values); under the interpreter, whose fp8 cast does
not round to nearest, it is done on the fp32 bits (`e4m3_code`: `quantize.e4m3_round_bits` for the normal
range, an exact round-to-integer of v * 2^9 for the subnormals, the sign kept for zeros). Both give torch's
bytes (tests/kernels/test_fp8.py, on the CPU and in the GPU session).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import nvfp4
from .gemm import cdiv, interpreting
from .quantize import e4m3_round_bits

_MAX = tl.constexpr(nvfp4.E4M3_MAX)
_MIN_NORMAL = tl.constexpr(nvfp4.E4M3_MIN_NORMAL)  # 2^-6
_ROUND = tl.constexpr(8388608.0)  # 2^23: x + 2^23 - 2^23 rounds 0 <= x < 2^22 to an integer, ties to even


@triton.jit
def e4m3_code(v):
    """fp32 v, |v| < 464, -> its E4M3 byte, round to nearest even: subnormals (multiples of 2^-9 below
    2^-6) included, and the sign kept when v rounds to zero (0x80), as torch's cast to float8_e4m3fn."""
    a = tl.abs(v)
    normal, _ = e4m3_round_bits(tl.maximum(a, _MIN_NORMAL))
    sub = ((a * 512.0 + _ROUND) - _ROUND).to(tl.int32)  # 0..8; 8 is 2^-6, whose byte is 0x08 too
    code = tl.where(a < _MIN_NORMAL, sub.to(tl.uint8), normal)
    sign = ((v.to(tl.int32, bitcast=True) >> 31) & 1).to(tl.uint8)
    return code | (sign << 7)


@triton.jit
def _e4m3_rows_kernel(a_ptr, q_ptr, s_ptr, R, C, RP, CP, stride_r, stride_c, stride_q,
                      HW_CVT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_r = rows < R
    src = a_ptr + rows.to(tl.int64)[:, None] * stride_r
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(src + cols[None, :] * stride_c, mask=in_r[:, None] & (cols < C)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    scale = tl.where(amax > 0, tl.div_rn(amax, _MAX), 1.0)
    tl.store(s_ptr + rows, scale, mask=rows < RP)
    inv = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), scale)[:, None]
    dst = q_ptr + rows.to(tl.int64)[:, None] * stride_q
    for c0 in range(0, CP, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(src + cols[None, :] * stride_c, mask=in_r[:, None] & (cols < C)[None, :], other=0.0)
        v = x.to(tl.float32) * inv  # |v| <= 448 up to the roundings of scale and 1 / scale: rounds to 448
        if HW_CVT:
            code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code = e4m3_code(v)
        tl.store(dst + cols[None, :], code, mask=(rows < RP)[:, None] & (cols < CP)[None, :])


def e4m3_rows_triton(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [R, C] (any strides, float) -> (float8_e4m3fn [RP, CP], fp32 scales [RP, 1]) with RP, CP the next
    multiples of 16: `backward.e4m3_rows`'s bytes and scales, in one launch."""
    if a.dim() != 2 or not a.is_floating_point():
        raise ValueError(f"e4m3_rows needs a 2-D float tensor, got {tuple(a.shape)} {a.dtype}")
    r, c = a.shape
    rp, cp = -(-r // 16) * 16, -(-c // 16) * 16
    q = torch.empty(rp, cp, dtype=torch.uint8, device=a.device)
    s = torch.empty(rp, 1, dtype=torch.float32, device=a.device)
    if rp:
        block_r, block_c = (16, 32) if interpreting() else (16, 256)
        _e4m3_rows_kernel[(cdiv(rp, block_r),)](a, q, s, r, c, rp, cp, a.stride(0), a.stride(1), q.stride(0),
                                                HW_CVT=not interpreting(), BLOCK_R=block_r, BLOCK_C=block_c,
                                                num_warps=4)
    return q.view(torch.float8_e4m3fn), s
