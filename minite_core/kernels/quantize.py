"""Fused NVFP4 activation quantize (Triton): fp32/bf16/fp16 rows -> packed E2M1 + E4M3 scales + global scale;
and its inverse, `dequantize_triton`.

One program takes one row. In row mode it first reduces the row's amax (a row-local max, so the result
cannot depend on the batch) and writes the row's global scale amax / 2688; then it walks K in chunks of NB
blocks held as an [NB, 16] tile. That walk is for many rows (a prefill, the learner), where the kernel is
bound by its arithmetic: reading the row once into one tile instead measured no faster there (0.68 of copy
bandwidth vs the walk's 0.69 on an H100, slower on the H200 of 2026-12-04; docs/benchmarks.md). A decode
step's few rows (`one_tile`: at most ONE_TILE_MAX_ROWS) are bound by a program's latency instead, four
dependent passes over L2 for a 2048-wide row: they take the whole row in one tile (`quantize_rows`, which the
RMSNorm and SiLU*up kernels also use for their outputs), read once, with more warps a row.
Per 16-element block, the block scale and the codes are computed exactly as `minite_core.nvfp4.quantize`
does: every division is IEEE round-to-nearest (`tl.div_rn`; a plain `/` may lower to an approximate
division on the GPU), the E4M3 rounding of the block scale is done on the fp32 bits (no reliance on the
target's fp8 conversion), and E2M1 rounding counts thresholds with ties to even. The output is
bit-identical to the torch backend, which tests check on CPU (interpreter) and GPU. `quantize_many_triton`
runs the chunk walk (`quantize_row`) over the rows of many tensors in one launch, each with its own global
scale (the learner's re-quantize of all its weights).

Every quantize (this module's, the RMSNorm's and SiLU * up's in `kernels.rows`) can also write
the decoded form of what it quantized (`store_decoded`, `NVFP4Tensor.decoded`: fp16 code * block scale, in
the wide GEMM tile's layout, with the GEMM's own decode, so exactly the values the GEMM would decode): for
the learner's weights (once per version) and for activations whose rows meet the decoded wide tiles, so
the GEMM reads them instead of launching a decode of each operand at each call. DBK > 1 (the GEMM's K step,
`gemm.fp4_block_k()`) turns it on; 1 off. The learner's re-quantize (`quantize_many_triton`, `dequantized`)
also writes each weight's bf16 values (`NVFP4Tensor.dequantized`, through the dequantize's own last step,
`scaled_values`), which the straight-through backward reads instead of dequantizing every weight at every
step (2 bytes a weight held, 196 launches a step fewer at the 0.6B shape).

Dequantize decodes with the GEMM's own decode (`gemm.load_decode_step`: code * block scale, exact in fp16),
then multiplies by the global scale in fp32 and rounds once to the output dtype: `nvfp4.dequantize`'s
arithmetic, in one pass over the packed bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import nvfp4
from ..nvfp4 import BLOCK, NVFP4Tensor
from . import pdl
from .gemm import (cdiv, check_decode, e2m1_to_fp16, e4m3_to_fp16, fp4_block_k, interpreting, load_decode_step,
                   next_pow2)

_E2M1_MAX = tl.constexpr(nvfp4.E2M1_MAX)
_E4M3_MAX = tl.constexpr(nvfp4.E4M3_MAX)
_E4M3_MIN = tl.constexpr(nvfp4.E4M3_MIN_NORMAL)
_GS_DIV = tl.constexpr(nvfp4.E2M1_MAX * nvfp4.E4M3_MAX)
_GS_MIN = tl.constexpr(nvfp4.GS_MIN)


@triton.jit
def e4m3_round_bits(v):
    """RNE of fp32 v in [2^-6, 448] to E4M3: (uint8 code, the rounded value in fp32)."""
    bits = v.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits, ties to even
    code = (((r >> 23) & 0xFF) - 120) << 3 | ((r >> 20) & 7)
    return code.to(tl.uint8), r.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_round(v):
    """RNE of finite fp32 v to E2M1 codes 0..15 (bit 3 = sign), saturating at 6, as `nvfp4.round_e2m1`
    (which counts thresholds) of v clamped to [-6, 6], on the bits in about half the instructions.
    |v| >= 1: round the fp32 mantissa to one bit, ties to even (the carry may bump the exponent); the
    exponent and that bit are the code, 1.0 -> 2 ... 6.0 -> 7. |v| < 1 (codes 0, 1, 2 = 0, 0.5, 1.0):
    2|v| + 2^23 rounds to an integer, ties to even, held in the low mantissa bits. The clamp is one
    min on |v| (the sign comes from v), not a clamp of v then its absolute value."""
    a = tl.minimum(tl.abs(v), _E2M1_MAX)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252  # (127 << 1) | m: 254 -> code 2
    small = (a * 2.0 + 8388608.0).to(tl.int32, bitcast=True) & 3
    code = tl.where(a < 1.0, small, normal)
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    return (code | (sign << 3)).to(tl.uint8)


@triton.jit
def row_global_scale(amax):
    """The per-row global scale of a row (or rows) whose max |x| is `amax`: amax / (6 * 448), floored."""
    return tl.maximum(tl.div_rn(amax, _GS_DIV), _GS_MIN)


@triton.jit
def quantize_codes(x, gs, inv_gs):
    """x [NB, 16] fp32 (blocks of 16), gs and inv_gs = 1 / gs [NB] fp32 (each block's global scale) ->
    (E2M1 codes of the even elements [NB, 8] uint8, of the odd ones, E4M3 block-scale bytes [NB] uint8),
    `nvfp4.quantize`'s arithmetic: only maxima and elementwise IEEE operations, so the bits cannot depend on
    the tile they sit in."""
    bamax = tl.max(tl.abs(x), axis=1)
    s = tl.div_rn(tl.div_rn(bamax, _E2M1_MAX), gs)
    s = tl.minimum(tl.maximum(s, _E4M3_MIN), _E4M3_MAX)
    s_code, s32 = e4m3_round_bits(s)
    v = x * tl.div_rn(inv_gs, s32)[:, None]  # |v| <= 6 up to the E4M3 rounding of s: e2m1_round saturates
    even, odd = tl.split(tl.reshape(e2m1_round(v), [x.shape[0], 8, 2]))
    return even, odd, s_code


@triton.jit
def decode_blocks(even, odd, s_code):
    """Blocks' E2M1 codes (even / odd elements [B, 8]) and E4M3 scale bytes [B] -> their values, fp16 code *
    block scale (exact), the even elements' and the odd ones', with the GEMM's decode."""
    s16 = e4m3_to_fp16(s_code.to(tl.int16))[:, None]
    return e2m1_to_fp16(even.to(tl.int16)) * s16, e2m1_to_fp16(odd.to(tl.int16)) * s16


@triton.jit
def store_decoded(o_ptr, off, kb, K, even, odd, s_code, DBK: tl.constexpr):
    """The decoded form of B blocks (`NVFP4Tensor.decoded`: fp16 code * block scale, with the GEMM's own decode,
    exact), in the wide tile's layout: each DBK-wide K step as its even elements, then its odd ones. even /
    odd: the blocks' E2M1 codes [B, 8], s_code their E4M3 scale bytes [B]; kb [B] each block's first k (blocks
    at kb >= K are not written), off [B] the offset from o_ptr of its row's decoded start."""
    dec_even, dec_odd = decode_blocks(even, odd, s_code)
    start = tl.multiple_of(off + (kb // DBK) * DBK + (kb % DBK) // 2, 8)  # (so each block's 8 values store as one)
    offs = start[:, None] + tl.arange(0, 8)[None, :]
    ok = (kb < K)[:, None]
    tl.store(o_ptr + offs, dec_even, mask=ok)
    tl.store(o_ptr + offs + DBK // 2, dec_odd, mask=ok)


@triton.jit
def quantize_rows(v, rows64, row_ok, N, Q, QS, QGS, ROWS: tl.constexpr, BLOCK: tl.constexpr, QD, DBK: tl.constexpr):
    """NVFP4 of whole rows held in a tile, v [ROWS, BLOCK] fp32 (zeros past N, N a multiple of 16), with per-row
    global scales: packed bytes to Q [R, N/2], scale bytes to QS [R, N/16], global scales to QGS [R]. Only
    maxima and elementwise operations (`quantize_codes`): the bits of `quantize_triton` of the same rows.
    DBK > 1: the rows' decoded form to QD too (`store_decoded`, rows of cdiv(N, DBK) * DBK)."""
    gs = row_global_scale(tl.max(tl.abs(v), axis=1))
    tl.store(QGS + rows64, gs, mask=row_ok)
    gsb = tl.reshape(tl.broadcast_to(gs[:, None], [ROWS, BLOCK // 16]), [ROWS * (BLOCK // 16)])
    even, odd, s_code = quantize_codes(tl.reshape(v, [ROWS * (BLOCK // 16), 16]), gsb, tl.div_rn(tl.zeros_like(gsb) + 1.0, gsb))
    packed = even | (odd << 4)
    if DBK > 1:
        kb = tl.broadcast_to(tl.arange(0, BLOCK // 16)[None, :] * 16, [ROWS, BLOCK // 16])
        kb = tl.where(row_ok[:, None], kb, N)  # (rows past R: not written)
        off = tl.broadcast_to(rows64[:, None] * ((N + DBK - 1) // DBK * DBK), [ROWS, BLOCK // 16])
        store_decoded(QD, tl.reshape(off, [ROWS * (BLOCK // 16)]), tl.reshape(kb, [ROWS * (BLOCK // 16)]), N,
                      even, odd, s_code, DBK)
    c8 = tl.arange(0, BLOCK // 2)
    c16 = tl.arange(0, BLOCK // 16)
    tl.store(Q + rows64[:, None] * (N // 2) + c8[None, :], tl.reshape(packed, [ROWS, BLOCK // 2]),
             mask=row_ok[:, None] & (c8 < N // 2)[None, :])
    tl.store(QS + rows64[:, None] * (N // 16) + c16[None, :], tl.reshape(s_code, [ROWS, BLOCK // 16]),
             mask=row_ok[:, None] & (c16 < N // 16)[None, :])


@triton.jit
def scaled_values(even, odd, gs, BF16_BITS: tl.constexpr):
    """`nvfp4.dequantize`'s last step on decoded halves (even / odd [R, C], fp16 code * block scale, exact):
    each times the global scale gs ([R, 1] or [R, C]) in fp32, interleaved back into element order ([R, 2C]:
    element 2j, then 2j + 1). BF16_BITS: rounded to bf16 on the fp32 bits, nearest even as torch rounds,
    and returned as the int16 bits (the interpreter's fp32 -> bf16 cast truncates); else fp32, for the caller's
    cast. The dequantize kernel and the weights' bf16 form from the quantize walk both end here."""
    vals = tl.interleave(even.to(tl.float32) * gs, odd.to(tl.float32) * gs)
    if BF16_BITS:  # (values are finite: no NaN to keep)
        bits = vals.to(tl.int32, bitcast=True)
        vals = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
    return vals


@triton.jit
def _quantize_chunk(x_row, d_row, s_row, o_row, q_row, k0, K, gs, inv_gs, NB: tl.constexpr, MASKED: tl.constexpr,
                    DBK: tl.constexpr, DQ: tl.constexpr):
    """The NB blocks of a row from k0 (MASKED: those past K left out); DBK > 1: their decoded form to o_row
    too; DQ: their bf16 dequantized values to q_row (the row's K values in order, as int16 bits) (`quantize_row`)."""
    blk = tl.arange(0, NB)
    offs16 = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    offs8 = blk[:, None] * 8 + tl.arange(0, 8)[None, :]
    if MASKED:
        x = tl.load(x_row + k0 + offs16, mask=(k0 + offs16) < K, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_row + k0 + offs16).to(tl.float32)
    even, odd, s_code = quantize_codes(x, gs, inv_gs)
    packed = even | (odd << 4)
    if MASKED:
        tl.store(d_row + k0 // 2 + offs8, packed, mask=(k0 // 2 + offs8) < K // 2)
        tl.store(s_row + k0 // 16 + blk, s_code, mask=(k0 // 16 + blk) < K // 16)
    else:
        tl.store(d_row + k0 // 2 + offs8, packed)
        tl.store(s_row + k0 // 16 + blk, s_code)
    if DBK > 1:
        store_decoded(o_row, tl.zeros([NB], dtype=tl.int32), k0 + blk * 16, K, even, odd, s_code, DBK)
    if DQ:  # `nvfp4.dequantize(.., bf16)`: code * block scale (exact in fp16), times gs, rounded once
        dec_even, dec_odd = decode_blocks(even, odd, s_code)
        vals = scaled_values(dec_even, dec_odd, gs[:, None], True)
        if MASKED:
            tl.store(q_row + k0 + offs16, vals, mask=(k0 + offs16) < K)
        else:
            tl.store(q_row + k0 + offs16, vals)


@triton.jit
def quantize_row(x_row, d_row, s_row, o_row, q_row, K, gs, inv_gs, NB: tl.constexpr, EVEN_K: tl.constexpr,
                 DBK: tl.constexpr, DQ: tl.constexpr = False):
    """The NVFP4 codes of one row of K values at x_row, walked in chunks of NB blocks held as an [NB, 16]
    tile: packed bytes to d_row, E4M3 scale bytes to s_row; gs and inv_gs = 1 / gs [NB], the row's global
    scale. The whole chunks without masks (so the loads and stores vectorize), then, unless EVEN_K (K a
    multiple of NB * 16), the last part chunk with them. DBK > 1: also the row as `gemm.decode_nvfp4(.., DBK)`
    gives it (fp16 code * block scale in the wide tile's layout) to o_row (cdiv(K, DBK) * DBK values; those
    past K are left as they are). DQ: also its bf16 dequantized values (`nvfp4.dequantize`'s bits) to q_row."""
    if EVEN_K:
        for k0 in range(0, K, NB * 16):
            _quantize_chunk(x_row, d_row, s_row, o_row, q_row, k0, K, gs, inv_gs, NB, False, DBK, DQ)
    else:
        whole = tl.multiple_of(K - K % (NB * 16), NB * 16)
        for k0 in range(0, whole, NB * 16):
            _quantize_chunk(x_row, d_row, s_row, o_row, q_row, k0, K, gs, inv_gs, NB, False, DBK, DQ)
        if whole < K:
            _quantize_chunk(x_row, d_row, s_row, o_row, q_row, whole, K, gs, inv_gs, NB, True, DBK, DQ)


@triton.jit
def _quantize_walk(x_row, data_ptr, scale_ptr, gs_ptr, dec_ptr, row, K, stride_data, stride_scale, stride_gs,
                   ROW_GS: tl.constexpr, NB: tl.constexpr, EVEN_K: tl.constexpr, DBK: tl.constexpr):
    """`_quantize_kernel`'s chunk walk over one row: its amax first (ROW_GS; else its global scale is given),
    then `quantize_row`."""
    if ROW_GS:
        blk = tl.arange(0, NB)
        offs16 = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
        amax = tl.zeros([NB], dtype=tl.float32)
        for k0 in range(0, K, NB * 16):
            if EVEN_K:  # no mask, so loads vectorize
                x = tl.load(x_row + k0 + offs16).to(tl.float32)
            else:
                x = tl.load(x_row + k0 + offs16, mask=(k0 + offs16) < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        gs = row_global_scale(tl.max(amax, axis=0))
        tl.store(gs_ptr + row * stride_gs, gs)
    else:
        gs = tl.load(gs_ptr + row * stride_gs)
    gs = gs + tl.zeros([NB], dtype=tl.float32)
    inv_gs = tl.div_rn(tl.zeros([NB], dtype=tl.float32) + 1.0, gs)
    o_row = dec_ptr + row * ((K + DBK - 1) // DBK * DBK)
    quantize_row(x_row, data_ptr + row * stride_data, scale_ptr + row * stride_scale, o_row, o_row, K, gs, inv_gs, NB,
                 EVEN_K, DBK)  # (no bf16 output for activations: DQ off, its pointer unused)


@triton.jit
def _quantize_kernel(
    x_ptr, data_ptr, scale_ptr, gs_ptr, dec_ptr,
    K, stride_x, stride_data, stride_scale, stride_gs,
    ROW_GS: tl.constexpr, NB: tl.constexpr, EVEN_K: tl.constexpr, DBK: tl.constexpr, ONE_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row; the row is walked in chunks of NB blocks, held as an [NB, 16] tile, or (ONE_TILE > 0,
    with ROW_GS: `one_tile`) read once into one tile of ONE_TILE columns. DBK > 1: the row's decoded form to
    dec_ptr too (rows of cdiv(K, DBK) * DBK)."""
    if PDL:  # first: before any global memory access (kernels/pdl.py)
        pdl.prologue()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if ONE_TILE > 0:  # (the launcher's buffers are fresh: rows of K / 2 bytes, K / 16 scale bytes, one gs)
        cols = tl.arange(0, ONE_TILE)
        x = tl.load(x_row + cols[None, :], mask=(cols < K)[None, :], other=0.0).to(tl.float32)
        rows64 = row + tl.arange(0, 1)
        quantize_rows(x, rows64, rows64 >= 0, K, data_ptr, scale_ptr, gs_ptr, 1, ONE_TILE, dec_ptr, DBK)
    else:
        _quantize_walk(x_row, data_ptr, scale_ptr, gs_ptr, dec_ptr, row, K, stride_data, stride_scale, stride_gs,
                       ROW_GS, NB, EVEN_K, DBK)


@triton.jit
def _quantize_many_kernel(meta_ptr, row_tensor_ptr, gs_ptr, XDT: tl.constexpr, NB: tl.constexpr, DBK: tl.constexpr,
                          DQ: tl.constexpr):
    """One program per row of many tensors, their rows numbered in tensor order: the row's tensor t
    (row_tensor), t's x / packed / scale-byte addresses, K, first row, decoded-output and bf16-output addresses
    (meta [n, 7] int64), and t's global scale gs[t]; then `_quantize_kernel`'s walk over the row (DBK > 1:
    which also writes the row's decoded form; DQ: its bf16 dequantized values)."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(row_tensor_ptr + row)
    m = meta_ptr + t.to(tl.int64) * 7
    k = tl.multiple_of(tl.load(m + 3), 16)  # (K % 16 == 0: the launcher checks)
    r = row - tl.load(m + 4)
    # row starts: x at r * K elements (K a multiple of 16) of a 16-byte aligned tensor, its packed bytes at
    # r * K / 2 (a multiple of 8) of a fresh allocation (the launcher checks): the hints let the loads vectorize
    x_row = tl.multiple_of(tl.load(m).to(tl.pointer_type(XDT)), 16) + tl.multiple_of(r * k, 16)
    d_row = tl.multiple_of(tl.load(m + 1).to(tl.pointer_type(tl.uint8)), 16) + tl.multiple_of(r * (k // 2), 8)
    s_row = tl.load(m + 2).to(tl.pointer_type(tl.uint8)) + r * (k // 16)
    o_row = (tl.multiple_of(tl.load(m + 5).to(tl.pointer_type(tl.float16)), 16)  # (a fresh allocation: aligned)
             + tl.multiple_of(r * ((k + DBK - 1) // DBK * DBK), 16))
    q_row = tl.multiple_of(tl.load(m + 6).to(tl.pointer_type(tl.int16)), 16) + tl.multiple_of(r * k, 16)
    gs = tl.load(gs_ptr + t) + tl.zeros([NB], dtype=tl.float32)
    inv_gs = tl.div_rn(tl.zeros([NB], dtype=tl.float32) + 1.0, gs)
    quantize_row(x_row, d_row, s_row, o_row, q_row, k, gs, inv_gs, NB, False, DBK, DQ)


def nvfp4_buffers(r: int, k: int, device, row_scales: bool = True) -> tuple:
    """Empty packed bytes [r, k/2], E4M3 scale bytes [r, k/16] and per-row global scales [r] (fp32; None
    without `row_scales`) for r rows of k values: what the quantize kernels write (`as_nvfp4` wraps them)."""
    return (torch.empty(r, k // 2, dtype=torch.uint8, device=device),
            torch.empty(r, k // BLOCK, dtype=torch.uint8, device=device),
            torch.empty(r, dtype=torch.float32, device=device) if row_scales else None)


def decode_buffer(r: int, k: int, device) -> torch.Tensor:
    """fp16 [r, cdiv(k, DBK) * DBK], DBK = `gemm.fp4_block_k()`, for the decoded form of r rows of k values
    (the quantize kernels' decoded output, DBK > 1): zeros past k, which the kernel does not write."""
    dbk = fp4_block_k()
    kp = cdiv(k, dbk) * dbk
    return (torch.empty if kp == k else torch.zeros)(r, kp, dtype=torch.float16, device=device)


def as_nvfp4(parts: tuple, shape: tuple, global_scale: torch.Tensor | None = None,
             decoded: torch.Tensor | None = None, dequantized: torch.Tensor | None = None) -> NVFP4Tensor:
    """(packed, scale bytes, per-row global scales) of the rows of a tensor of `shape` -> its NVFP4Tensor;
    `global_scale`: a given one instead of the per-row scales; `decoded`: its decoded form [rows, K padded];
    `dequantized`: its bf16 values (`NVFP4Tensor.dequantized`)."""
    data, scale, gs, *rest = parts  # (a 4th part: the decoded form, as the row kernels return it)
    decoded = rest[0] if rest else decoded
    lead, k = tuple(shape[:-1]), shape[-1]
    return NVFP4Tensor.trusted(data.reshape(lead + (k // 2,)), scale.view(torch.float8_e4m3fn).reshape(lead + (k // BLOCK,)),
                               gs.reshape(lead + (1,)) if global_scale is None else global_scale, shape, decoded,
                               dequantized)


# `_quantize_kernel`'s and `_quantize_many_kernel`'s launch: warps per row program and the most blocks of 16 in
# one chunk of its walk. Neither changes a bit (each block's arithmetic is the same in any tile, and a row's
# amax is a max); bench/gemm.py's quantize sweep times the others.
QUANTIZE_WARPS = 4
QUANTIZE_MAX_NB = 64
# Few rows (a decode step's, where a kernel's time is its latency) take the whole row in one tile: read once,
# its amax and its codes from the same registers, more warps a row; many rows (a prefill, the learner) keep the
# chunk walk, which measured faster for bandwidth (the whole-row kernel at 8192 rows: 0.68 of copy against
# 0.69, slower on the H200; docs/benchmarks.md). The same bits either way (maxima and elementwise operations:
# tests/core/test_ops.py and tests/kernels/test_rows.py run both). Used by this quantize and SiLU*up's. On an H100
# (2026-12-06) they took 3.6% off a 1.7B decode step at batch 16, ~1% (noise) at 0.6B.
ONE_TILE_MAX_ROWS = 256
ONE_TILE_MAX_K = 8192


def one_tile(r: int, k: int) -> int:
    """The columns of the whole-row tile for r rows of k values (a power of two >= k), or 0: the chunk walk."""
    block = next_pow2(k)
    return block if r <= ONE_TILE_MAX_ROWS and block <= ONE_TILE_MAX_K else 0


def one_tile_warps(block: int) -> int:
    """Warps for a whole-row tile of `block` columns: ~16 values a thread (4 to 16 warps)."""
    return max(4, min(16, block // 512))


def quantize_triton(x: torch.Tensor, global_scale: torch.Tensor | None, decoded: bool = False) -> NVFP4Tensor:
    """Quantize x [..., K] with per-row global scales (global_scale None) or a given scalar/[.., 1] one.
    `decoded`: the result carries its decoded form (`NVFP4Tensor.decoded`), written by the same kernel, for
    the wide GEMM tiles."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        raise ValueError("x must have a contiguous last dimension for the Triton quantize kernel")
    r = x2.shape[0]
    data, scale, gs = nvfp4_buffers(r, k, x.device, row_scales=global_scale is None)
    dec, dbk = (decode_buffer(r, k, x.device), fp4_block_k()) if decoded else (None, 1)
    stride_gs = 1
    if global_scale is not None:
        gs = global_scale.reshape(-1).contiguous()
        stride_gs = 0 if gs.numel() == 1 else 1
    nb = min(QUANTIZE_MAX_NB, next_pow2(k // BLOCK))
    tile = one_tile(r, k) if global_scale is None else 0
    if r:
        _quantize_kernel[(r,)](
            x2, data, scale, gs, data if dec is None else dec, k, x2.stride(0), data.stride(0), scale.stride(0), stride_gs,
            ROW_GS=global_scale is None, NB=nb, EVEN_K=k % (nb * BLOCK) == 0, DBK=dbk, ONE_TILE=tile,
            num_warps=one_tile_warps(tile) if tile else QUANTIZE_WARPS, **pdl.launch(x.device),
        )
    return as_nvfp4((data, scale, gs), tuple(x.shape), global_scale, decoded=dec)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_ROW_TENSOR: dict = {}  # (device, rows of each tensor) -> row -> tensor index, int32 (the learner's weights: one entry)


def quantize_many_triton(tensors: list, global_scales: torch.Tensor, decoded: bool = False,
                         dequantized: bool = False) -> list[NVFP4Tensor]:
    """[quantize_triton(t, global_scales[i]) for i, t in enumerate(tensors)] in one launch, the same bits (the
    same row walk over the same blocks): the learner's re-quantize of all its weights, which took a launch
    per weight. Each tensor [..., K] (K a multiple of 16), all of one dtype and device (at least one tensor);
    global_scales [n]. `decoded`: each result carries its `decoded` form too (`gemm.decode_nvfp4`'s bits, from
    the same launch), which the wide GEMM tiles read instead of decoding the weight at every call. `dequantized`:
    each carries its bf16 dequantized form too (`nvfp4.dequantize(.., bf16)`'s bits, `NVFP4Tensor.dequantized`),
    which the straight-through backward reads instead of dequantizing the weight at every step's backward."""
    first = tensors[0]
    ts = [t.reshape(-1, t.shape[-1]) for t in tensors]
    if any(t.stride(-1) != 1 or (t.shape[0] > 1 and t.stride(0) != t.shape[1]) for t in ts):
        raise ValueError("quantize_many_triton needs contiguous tensors")
    if any(t.dtype != first.dtype or t.device != first.device or t.shape[-1] % BLOCK for t in ts):
        raise ValueError(f"quantize_many_triton: tensors of one dtype and device, K a multiple of {BLOCK}")
    ts = [t if t.data_ptr() % 16 == 0 else t.clone() for t in ts]  # (the kernel's alignment hint; views may be off)
    outs = [nvfp4_buffers(t.shape[0], t.shape[1], t.device, row_scales=False)[:2] for t in ts]  # fresh: aligned
    decs = [decode_buffer(t.shape[0], t.shape[1], t.device) if decoded else None for t in ts]
    deqs = [torch.empty(t.shape, dtype=torch.bfloat16, device=t.device) if dequantized else None for t in ts]
    rows = tuple(t.shape[0] for t in ts)
    total, start = sum(rows), 0
    meta = []
    for t, (data, scale), dec, deq, n in zip(ts, outs, decs, deqs, rows):
        meta.append((t.data_ptr(), data.data_ptr(), scale.data_ptr(), t.shape[1], start,
                     dec.data_ptr() if decoded else 0, deq.data_ptr() if dequantized else 0))
        start += n
    if total:
        dev = first.device
        meta_t = torch.tensor(meta, dtype=torch.int64)
        # pinned and asynchronous: the copy does not wait for the work queued before it (the optimizer step)
        meta_t = meta_t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else meta_t
        key = (dev, rows)
        if key not in _ROW_TENSOR:
            _ROW_TENSOR.clear()
            counts = torch.tensor(rows, device=dev)
            _ROW_TENSOR[key] = torch.repeat_interleave(torch.arange(len(ts), device=dev, dtype=torch.int32), counts,
                                                       output_size=total)
        nb = min(QUANTIZE_MAX_NB, next_pow2(max(t.shape[1] for t in ts) // BLOCK))
        _quantize_many_kernel[(total,)](meta_t, _ROW_TENSOR[key], global_scales.reshape(-1).float().contiguous(),
                                        XDT=_TL_DTYPES[first.dtype], NB=nb, DBK=fp4_block_k() if decoded else 1,
                                        DQ=dequantized, num_warps=QUANTIZE_WARPS)
    return [as_nvfp4((data, scale, None), tuple(t.shape), global_scales[i], decoded=dec,
                     dequantized=None if deq is None else deq.view(t.shape))
            for i, (t, (data, scale), dec, deq) in enumerate(zip(tensors, outs, decs, deqs))]


@triton.jit
def _dequantize_kernel(p_ptr, s_ptr, gs_ptr, o_ptr, R, K, stride_p, stride_s, stride_gs, stride_o,
                       BF16_BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """BF16_BITS: o_ptr is the bf16 output viewed as int16, rounded to nearest even on the fp32 bits, as
    torch does (the interpreter's fp32 -> bf16 cast truncates; the GPU's would round as torch)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    ok = rows < R
    even, odd = load_decode_step(p_ptr, s_ptr, rows, ok, k0, K, stride_p, stride_s, BLOCK_R, BLOCK_K)
    gs = tl.load(gs_ptr + rows * stride_gs, mask=ok, other=1.0)[:, None]
    vals = scaled_values(even, odd, gs, BF16_BITS)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(o_ptr + rows[:, None] * stride_o + k[None, :], vals.to(o_ptr.dtype.element_ty), mask=ok[:, None] & (k < K)[None, :])


DEQUANTIZE_TILE = (32, 256)  # `_dequantize_kernel`'s rows x K per program on the GPU (the interpreter: 16 x 64)


def dequantize_triton(t: NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`nvfp4.dequantize(t, dtype)`, the same bits, in one kernel."""
    check_decode(t.data.device, t)
    k = t.shape[-1]
    data = t.data.reshape(-1, k // 2)
    scale = t.scale.view(torch.uint8).reshape(-1, k // BLOCK)
    r = data.shape[0]
    gs = t.global_scale.reshape(-1)
    out = torch.empty(r, k, dtype=dtype, device=data.device)
    if r:
        bf16_bits = dtype == torch.bfloat16  # (the same code on the GPU as under the CPU tests' interpreter)
        block_r, block_k = (16, 64) if interpreting() else DEQUANTIZE_TILE
        _dequantize_kernel[(cdiv(r, block_r), cdiv(k, block_k))](
            data, scale, gs, out.view(torch.int16) if bf16_bits else out, r, k, data.stride(0), scale.stride(0),
            0 if t.global_scale.dim() == 0 else 1, out.stride(0),
            BF16_BITS=bf16_bits, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return out.view(t.shape)
