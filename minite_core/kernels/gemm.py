"""Batch-invariant GEMM (Triton): W4A4 NVFP4 x NVFP4, and plain bf16/fp16/fp32, out = x @ w.T.

W4A4 on Hopper, which has no FP4 tensor cores (and where `tl.dot_scaled` with E4M3 scales does not
compile): each program loads packed FP4 bytes of x and w, decodes nibbles and E4M3 block scales in
registers with bit moves (no lookup, no layout shuffle), and forms code * block_scale, which is exact
in fp16 (at most 6 significant bits, range 2^-10 .. 2688). `tl.dot` then multiplies fp16 tiles with
fp32 accumulation: per BLOCK_K step, first the even elements of the step, then the odd ones (the
order in which the bytes hold them). The global scales enter in the epilogue,
(acc * gs_x[m]) * gs_w[n], as in the torch backend. The decode step is the only
Hopper-specific part: a Blackwell path would hand the same packed bytes and scales (swizzled with
`nvfp4.to_blocked`) to a native block-scaled MMA instead.

Batch invariance is structural: one tile configuration per (N, K) (`gemm_config`), no split-K, no
autotuning; each output tile reduces over K in BLOCK_K steps in one fixed order, so row m's bits
depend only on row m of x and on w, never on M or on the other rows. Out-of-range rows and columns are
masked to zero and never mix into valid rows.

Under TRITON_INTERPRET=1 (CPU tests) tiles are smaller, and the plain (non-FP4) path multiplies tiles
with an elementwise product and `tl.sum` instead of `tl.dot`: the interpreter's bf16 dot is wrong, and
its fp32 dot calls BLAS, whose result for a row depends on the row's position in the tile. (The FP4
path's fp16 dot runs numpy's own loop, which is position-invariant, so it is tested as on the GPU.)
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..nvfp4 import BLOCK, NVFP4Tensor


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def e2m1_to_fp16(nibble):
    """E2M1 codes (int16, 0..15) -> fp16 values, by placing the 3 magnitude bits at the top of the fp16
    exponent/mantissa boundary (which encodes value * 2^-14, subnormals included) and the sign at bit 15."""
    bits = ((nibble & 7) << 9) | ((nibble & 8) << 12)
    return bits.to(tl.float16, bitcast=True) * 16384.0


@triton.jit
def e4m3_to_fp16(byte):
    """Non-negative E4M3 scale bytes (int16) -> fp16: byte << 7 encodes value * 2^-8 (subnormals too)."""
    return (byte << 7).to(tl.float16, bitcast=True) * 256.0


@triton.jit
def decode_nvfp4_pairs(packed, scale):
    """Packed bytes [R, P] and the fp16 block scale of each pair [R, P] -> (even, odd) elements, fp16 code * scale.

    Both products are exact in fp16. Returning the even and the odd elements as two tiles (instead of
    interleaving them back) avoids a register shuffle; the GEMM sums over K in that permuted order.
    """
    p = packed.to(tl.int16)
    return e2m1_to_fp16(p & 0xF) * scale, e2m1_to_fp16(p >> 4) * scale


@triton.jit
def _gemm_kernel(
    a_ptr, as_ptr, ags_ptr, b_ptr, bs_ptr, bgs_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_am, stride_asm, stride_ags, stride_bn, stride_bsn, stride_bgs, stride_cm,
    FP4: tl.constexpr, DOT_FP32: tl.constexpr, DOT_BY_SUM: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
    pid_n = (pid % (GROUP_M * grid_n)) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if FP4:
            kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte (= element pair) index
            ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)  # block-scale index
            if EVEN_K:  # no mask along K, so the byte loads vectorize
                a = tl.load(a_ptr + offs_m[:, None] * stride_am + kp[None, :], mask=mask_m[:, None], other=0)
                b = tl.load(b_ptr + offs_n[:, None] * stride_bn + kp[None, :], mask=mask_n[:, None], other=0)
                sa = tl.load(as_ptr + offs_m[:, None] * stride_asm + ks[None, :], mask=mask_m[:, None], other=0)
                sb = tl.load(bs_ptr + offs_n[:, None] * stride_bsn + ks[None, :], mask=mask_n[:, None], other=0)
            else:
                kp_ok = kp < K // 2
                ks_ok = ks < K // 16
                a = tl.load(a_ptr + offs_m[:, None] * stride_am + kp[None, :], mask=mask_m[:, None] & kp_ok[None, :], other=0)
                b = tl.load(b_ptr + offs_n[:, None] * stride_bn + kp[None, :], mask=mask_n[:, None] & kp_ok[None, :], other=0)
                sa = tl.load(as_ptr + offs_m[:, None] * stride_asm + ks[None, :], mask=mask_m[:, None] & ks_ok[None, :], other=0)
                sb = tl.load(bs_ptr + offs_n[:, None] * stride_bsn + ks[None, :], mask=mask_n[:, None] & ks_ok[None, :], other=0)
            # decode each block scale once, then spread it over its 8 bytes
            sa = e4m3_to_fp16(sa.to(tl.int16))
            sb = e4m3_to_fp16(sb.to(tl.int16))
            sa = tl.reshape(tl.broadcast_to(sa[:, :, None], [BLOCK_M, BLOCK_K // 16, 8]), [BLOCK_M, BLOCK_K // 2])
            sb = tl.reshape(tl.broadcast_to(sb[:, :, None], [BLOCK_N, BLOCK_K // 16, 8]), [BLOCK_N, BLOCK_K // 2])
            a_even, a_odd = decode_nvfp4_pairs(a, sa)
            b_even, b_odd = decode_nvfp4_pairs(b, sb)
            if SWAP_AB:  # small M: the weight tile is the MMA's first operand (kept in registers)
                acc_t = tl.dot(b_even, tl.trans(a_even), acc_t)
                acc_t = tl.dot(b_odd, tl.trans(a_odd), acc_t)
            else:
                acc = tl.dot(a_even, tl.trans(b_even), acc)
                acc = tl.dot(a_odd, tl.trans(b_odd), acc)
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :], mask=mask_m[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr + offs_n[:, None] * stride_bn + kk[None, :], mask=mask_n[:, None] & k_ok[None, :], other=0.0)
            if DOT_BY_SUM:
                # interpreter only: numpy's fp32 matmul (BLAS) is not row-position invariant
                acc += tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)
            elif DOT_FP32:
                acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
    if SWAP_AB:
        acc = tl.trans(acc_t)
    if FP4:
        gsa = tl.load(ags_ptr + offs_m * stride_ags, mask=mask_m, other=1.0)
        gsb = tl.load(bgs_ptr + offs_n * stride_bgs, mask=mask_n, other=1.0)
        acc = (acc * gsa[:, None]) * gsb[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Small M uses narrower M tiles (same BLOCK_K, same K order). On the H200 the narrow and wide tiles gave
# identical bits (bench/gemm.py checks it every run, and tests/test_ops.py's invariance test covers
# M=1 against M=300 on the GPU); set False to fall back to one tile shape for every M.
SMALL_M_TILES = True
CONFIG_OVERRIDE: dict | None = None  # bench/gemm.py only: try other fixed configs


def gemm_config(m: int, n: int, k: int, fp4: bool) -> dict:
    """The one tile configuration for (N, K): BLOCK_K and the reduction order never depend on M."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64 if fp4 else 32, GROUP_M=4, num_warps=4, num_stages=1,
                    SWAP_AB=fp4 and m <= 16)
    if fp4 and CONFIG_OVERRIDE:
        return dict(CONFIG_OVERRIDE)
    if fp4:
        # 128x256 tiles for wide layers; 128x128 when N is small, so more programs fill the GPU
        cfg = dict(BLOCK_M=128, BLOCK_N=256 if n >= 4096 else 128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)
        if SMALL_M_TILES and m <= 16:
            cfg.update(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4, SWAP_AB=True)
        return cfg
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def _flat_gs(t: NVFP4Tensor):
    gs = t.global_scale.reshape(-1)
    return gs, (0 if t.global_scale.dim() == 0 else 1)


def gemm_triton(x, w, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias): both NVFP4Tensor, or both plain tensors of one float dtype."""
    fp4 = isinstance(w, NVFP4Tensor)
    m, k = x.shape
    n = w.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return c
    cfg = gemm_config(m, n, k, fp4)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    if fp4:
        ags, s_ags = _flat_gs(x)
        bgs, s_bgs = _flat_gs(w)
        args = (x.data, x.scale.view(torch.uint8), ags, w.data, w.scale.view(torch.uint8), bgs)
        strides = (x.data.stride(0), x.scale.stride(0), s_ags, w.data.stride(0), w.scale.stride(0), s_bgs)
        dot_fp32 = False
    else:
        args = (x, x, x, w, w, w)
        strides = (x.stride(0), 0, 0, w.stride(0), 0, 0)
        dot_fp32 = x.dtype == torch.float32
    cfg = dict(cfg)
    cfg.setdefault("SWAP_AB", False)
    _gemm_kernel[grid](
        *args, bias if bias is not None else c, c, m, n, k, *strides, c.stride(0),
        FP4=fp4, DOT_FP32=dot_fp32, DOT_BY_SUM=interpreting() and not fp4, EVEN_K=k % cfg["BLOCK_K"] == 0, HAS_BIAS=bias is not None, **cfg,
    )
    return c
