"""Row-local ops (Triton): RMSNorm, SiLU * up (SwiGLU), NeoX RoPE, and their fusions for the decode step;
forward and backward, batch-invariant.

The learner's step was dominated by the torch versions of these ops (each a chain of elementwise kernels
over fp32 copies); here each is one kernel forward and one backward.

RMSNorm, as HF's Qwen3RMSNorm: y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32.
A program owns ROWS whole rows of BLOCK = next_power_of_two(N) columns (the row sits in registers), sums
x^2 with one `tl.sum` per row and divides by N with IEEE division. ROWS and BLOCK depend only on N, so a
row meets the same instructions in the same tile position-independent layout whether it is alone or
among thousands of rows: batch-invariant, decode == prefill. The weight multiply is the reference's:
the normalized row rounded to x's dtype, times the weight, rounded to the promoted dtype (both products
are single roundings of an exact fp32 product, as torch's). It differs from the torch backend only in the
order of the sum of squares (`tl.sum`'s tree vs `tree_sum`'s halves) and in rsqrt's last bits, so the two
backends agree within one rounding of x's dtype, not bit for bit.
Backward, with n = x * rstd and gn = g * weight (fp32): dx = rstd * (gn - n * mean(gn * n)) (the cast to
x's dtype is passed straight through), dweight = sum over rows of g * n.to(x.dtype). The forward saves
rstd per row (4 bytes a row). The weight gradient is summed per program in the kernel (a program walks
TILES consecutive row tiles), then over programs by torch: not batch-invariant, and need not be.

SiLU * up: gate / (1 + exp(-gate)) * up in fp32, rounded once to gate's dtype (the reference's formula
and roundings; exp's last bits are Triton's). Backward, with s = sigmoid(gate):
dgate = g * up * s * (1 + gate * (1 - s)), dup = g * gate * s. Elementwise over the flattened tensors in
fixed blocks: nothing mixes elements, so it is batch-invariant whatever the blocking.

RoPE, NeoX rotate-half, on x [B, H, T, D] with cos/sin [B or 1, 1, T, D]: with x = (x1, x2) the two
halves of the head dimension, out = (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2), in fp32, rounded once (the
torch backend's `x * cos + rotate_half(x) * sin` rounds each product and the sum in x's dtype: the two
backends differ by a rounding or so in bf16). The backward is the transpose, (g1 cos1 + g2 sin2,
g2 cos2 - g1 sin1); cos and sin get no gradient (they are functions of the positions). A program owns
one (batch, position) and BLOCK_H heads; elementwise, so batch-invariant. x may be any strided view with
a unit last stride (the model's q/k are [B, T, H, D] buffers seen as [B, H, T, D]); the output keeps x's
layout.

Fused for the decode step (one launch instead of a chain; the same arithmetic, through the same helpers):
RMSNorm with the residual add in front (`delta`: s = x + delta rounded to x's dtype, as torch adds, written
out as the new residual stream) and/or the NVFP4 quantize of its output behind (`quantize_rows`, the
quantize kernel's `quantize_codes`: maxima and elementwise operations only, so the bits of
`quantize_triton(y)`); SiLU * up with the quantize of its output (a row per program; few rows, a decode
step's: the whole row in one tile, as the norm; many rows: two walks over the row, amax, then values and
codes, which measured faster there than one tile; `quantize.one_tile` chooses, the bits are the same). The q/k norm +
RoPE fusion is `kernels/qk_norm_rope.py`, built from this module's helpers (`rms_rstd`, `rms_scale`,
`rope_rotate`) and backward kernels.

Every rounding to the output dtype goes through `round_to`: the interpreter's fp32 -> bf16 cast truncates
where the GPU's rounds to nearest even, so bf16 is rounded by hand first (then the cast is exact, and the
GPU gets the same bits as before). Under TRITON_INTERPRET=1 the block sizes are small (the interpreter
runs each program in numpy).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..nvfp4 import BLOCK as QBLOCK
from . import pdl
from .gemm import cdiv, fp4_block_k, interpreting, next_pow2
from .quantize import (decode_buffer, nvfp4_buffers, one_tile, one_tile_warps, quantize_codes, quantize_rows,
                       row_global_scale, store_decoded)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x -> dtype, round to nearest even (bf16 by hand: the interpreter's cast truncates)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


# ------------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def rms_rstd(xf, nf, eps):
    """1 / sqrt(mean(x^2) + eps) of each row of an fp32 tile (zeros past the row's nf values): one `tl.sum`.
    Kernels that call it launch with `enable_fp_fusion=False`: with FMA contraction on, ptxas fuses a square
    into the first add of the sum, and which of the two squares it fuses depends on the code around it, so
    the fused-quantize and plain variants of the same norm differed in a row's rstd by an ulp (fp32 on an
    H100, 2026-12-06: the sum began fma(x0, x0, x1 * x1) in one and fma(x1, x1, x0 * x0) in the other)."""
    ss = tl.sum(xf * xf, axis=1)
    return tl.math.rsqrt(tl.div_rn(ss, nf + tl.zeros_like(ss)) + eps)


@triton.jit
def rms_scale(xf, rstd, w, XDT: tl.constexpr, YDT: tl.constexpr):
    """weight * (x * rstd).to(x's dtype XDT), rounded to the output dtype YDT: the reference's two roundings."""
    y = round_to(xf * rstd[:, None], XDT)
    return round_to(y.to(tl.float32) * w.to(tl.float32)[None, :], YDT)


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, Q, QS, QGS, QD, DELTA, XS, R, N, sx, sy, sd, nf, eps,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr, RESIDUAL: tl.constexpr,
                         DBK: tl.constexpr, PDL: tl.constexpr):
    """RESIDUAL: the rows normalized are x + delta (rounded once to x's dtype, as torch adds), also written
    to XS [R, N]; QUANT: y's NVFP4 (`quantize_rows`; DBK > 1: with its decoded form to QD)."""
    if PDL:  # first: before any global memory access (kernels/pdl.py)
        pdl.prologue()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    xf = tl.load(X + rows64[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        d = tl.load(DELTA + rows64[:, None] * sd + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xs = round_to(xf + d, X.dtype.element_ty)
        tl.store(XS + rows64[:, None] * N + cols[None, :], xs, mask=mask)
        xf = xs.to(tl.float32)
    rstd = rms_rstd(xf, nf, eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0)
    out = rms_scale(xf, rstd, w, X.dtype.element_ty, Y.dtype.element_ty)
    tl.store(Y + rows64[:, None] * sy + cols[None, :], out, mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    if QUANT:
        quantize_rows(out.to(tl.float32), rows64, row_ok, N, Q, QS, QGS, ROWS, BLOCK, QD, DBK)


@triton.jit
def _rms_norm_bwd_kernel(X, W, G, RSTD, DX, DW, R, N, sx, sg, sdx, nf, TILES,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    for i in range(TILES):
        rows = (pid * TILES + i) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < R
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * sx + cols[None, :], mask=mask, other=0.0)
        g = tl.load(G + rows64[:, None] * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        n = x.to(tl.float32) * rstd[:, None]
        dw += tl.sum(g * round_to(n, X.dtype.element_ty).to(tl.float32), axis=0)
        gn = g * w[None, :]
        c = tl.sum(gn * n, axis=1) / nf
        dx = rstd[:, None] * (gn - n * c[:, None])
        tl.store(DX + rows64[:, None] * sdx + cols[None, :], round_to(dx, DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid.to(tl.int64) * N + cols, dw, mask=col_ok)


def rms_norm_config(n: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps) for feature size n: a function of n only (never of the row count)."""
    block = next_pow2(n)
    if interpreting():
        return 4, block, 4
    rows = max(1, min(16, 2048 // block))
    tile = rows * block
    return rows, block, 4 if tile <= 2048 else 8 if tile <= 8192 else 16


def _quantize_buffers(r: int, n: int, device, decoded: bool) -> tuple:
    """The NVFP4 output of r rows of n: (packed, scale bytes, global scales[, the decoded form])."""
    return nvfp4_buffers(r, n, device) + ((decode_buffer(r, n, device),) if decoded else ())


def _quantize_args(q: tuple | None, dummy: torch.Tensor) -> tuple:
    """A row kernel's Q, QS, QGS, QD pointers (`dummy` where there is nothing to write)."""
    q = q or ()
    return tuple(q) + (dummy,) * (4 - len(q))


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool = False,
                     delta: torch.Tensor | None = None, decoded: bool = False):
    """x [..., N], weight [N] -> (y [..., N] in promote(x, weight) dtype, rstd [rows] fp32, the NVFP4 of y with
    per-row global scales as (packed, scale bytes, global scales[, its decoded form with `decoded`]) with
    `quantize` else None, x + delta (rounded to x's dtype) with `delta` else None): y normalizes x + delta
    when given."""
    x2 = _rows2d(x)
    r, n = x2.shape
    w = weight.contiguous()
    y = torch.empty(r, n, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    rstd = torch.empty(r, device=x.device, dtype=torch.float32)
    q = _quantize_buffers(r, n, x.device, decoded) if quantize else None
    d2 = _rows2d(delta) if delta is not None else None
    xs = torch.empty(r, n, device=x.device, dtype=x.dtype) if delta is not None else None
    if r and n:
        rows, block, warps = rms_norm_config(n)
        _rms_norm_fwd_kernel[(cdiv(r, rows),)](
            x2, w, y, rstd, *_quantize_args(q, y), d2 if d2 is not None else x2, xs if xs is not None else y, r, n,
            x2.stride(0), y.stride(0), d2.stride(0) if d2 is not None else 0, float(n), float(eps),
            ROWS=rows, BLOCK=block, QUANT=quantize, RESIDUAL=delta is not None, DBK=fp4_block_k() if decoded else 1,
            num_warps=warps,
            enable_fp_fusion=False, **pdl.launch(x.device))
    return y.reshape(*x.shape[:-1], n), rstd, q, (xs.reshape(x.shape) if xs is not None else None)


@functools.lru_cache(maxsize=None)
def _programs_cap(device: torch.device) -> int:
    """Programs of the RMSNorm backward (each sums its rows' weight gradient): a few per SM."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def rms_norm_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      need_dw: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    x2, g2 = _rows2d(x), _rows2d(g)
    r, n = x2.shape
    dx = torch.empty(r, n, device=x.device, dtype=x.dtype)
    rows, block, warps = rms_norm_config(n)
    tiles = cdiv(r, rows)
    per = cdiv(tiles, _programs_cap(x.device)) if tiles else 1
    programs = cdiv(tiles, per)
    dw_part = torch.zeros(max(programs, 1), n, device=x.device, dtype=torch.float32)
    if r and n:
        _rms_norm_bwd_kernel[(programs,)](x2, weight.contiguous(), g2, rstd, dx, dw_part, r, n, x2.stride(0),
                                          g2.stride(0), dx.stride(0), float(n), per, ROWS=rows, BLOCK=block,
                                          num_warps=warps)
    dw = dw_part.sum(0).to(weight.dtype) if need_dw else None
    return dx.reshape(x.shape), dw


class RMSNormFunction(torch.autograd.Function):
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype): the Triton forward and backward above. With `delta`,
    of s = x + delta (the residual add fused in). Returns y, then s (with delta), then y's NVFP4 as (packed,
    scale bytes, global scales) (with quantize; no gradient)."""

    @staticmethod
    def forward(ctx, x, weight, eps, quantize=False, delta=None, decoded=False):
        y, rstd, q, xs = rms_norm_forward(x, weight, eps, quantize, delta, decoded)
        ctx.save_for_backward(x if xs is None else xs, weight, rstd)
        ctx.residual = xs is not None
        out = (y,) + ((xs,) if xs is not None else ())
        if q is None:
            return out if len(out) > 1 else y
        ctx.mark_non_differentiable(*q)
        return (*out, *q)

    @staticmethod
    def backward(ctx, g, *rest):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(g, x, weight, rstd, ctx.needs_input_grad[1])
        dd = None
        if ctx.residual:  # s = x + delta feeds the norm and the residual stream: both gradients reach x and delta
            dx = dx + rest[0]
            dd = dx if ctx.needs_input_grad[4] else None
        return (dx if ctx.needs_input_grad[0] else None), dw, None, None, dd, None


# ------------------------------------------------------------------------------------------ SiLU * up
@triton.jit
def silu_mul_value(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in fp32 from the operands' values, rounded once to `dtype`."""
    g = gate.to(tl.float32)
    return round_to(tl.div_rn(g, 1.0 + tl.exp(-g)) * up.to(tl.float32), dtype)


@triton.jit
def _silu_mul_fwd_kernel(GATE, UP, OUT, numel, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # first: before any global memory access (kernels/pdl.py)
        pdl.prologue()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(GATE + offs, mask=mask, other=0.0)
    u = tl.load(UP + offs, mask=mask, other=0.0)
    tl.store(OUT + offs, silu_mul_value(g, u, OUT.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_chunk(GATE, UP, base, offs, N, EVEN: tl.constexpr, dtype: tl.constexpr):
    """silu_mul_value of the elements at base + offs of a row of N (EVEN: no mask, so the loads vectorize)."""
    if EVEN:
        g = tl.load(GATE + base + offs)
        u = tl.load(UP + base + offs)
    else:
        g = tl.load(GATE + base + offs, mask=offs < N, other=0.0)
        u = tl.load(UP + base + offs, mask=offs < N, other=0.0)
    return silu_mul_value(g, u, dtype)


@triton.jit
def _silu_mul_quantize_walk(GATE, UP, OUT, Q, QS, QGS, QD, N, row, NB: tl.constexpr, EVEN: tl.constexpr,
                            DBK: tl.constexpr):
    """`_silu_mul_quantize_kernel`'s two walks over one row."""
    blk = tl.arange(0, NB)
    offs16 = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    offs8 = blk[:, None] * 8 + tl.arange(0, 8)[None, :]
    amax = tl.zeros([NB], dtype=tl.float32)
    for k0 in range(0, N, NB * 16):
        out = _silu_mul_chunk(GATE, UP, row * N, k0 + offs16, N, EVEN, OUT.dtype.element_ty)
        amax = tl.maximum(amax, tl.max(tl.abs(out.to(tl.float32)), axis=1))
    gs = row_global_scale(tl.max(amax, axis=0))
    tl.store(QGS + row, gs)
    gs = gs + tl.zeros([NB], dtype=tl.float32)
    inv_gs = tl.div_rn(tl.zeros([NB], dtype=tl.float32) + 1.0, gs)
    dec_row = tl.zeros([NB], dtype=tl.int64) + row * ((N + DBK - 1) // DBK * DBK)  # (its decoded row's offset)
    for k0 in range(0, N, NB * 16):
        out = _silu_mul_chunk(GATE, UP, row * N, k0 + offs16, N, EVEN, OUT.dtype.element_ty)
        even, odd, s_code = quantize_codes(out.to(tl.float32), gs, inv_gs)
        packed = even | (odd << 4)
        if DBK > 1:  # the decoded form of the row (`store_decoded`)
            store_decoded(QD, dec_row, k0 + blk * 16, N, even, odd, s_code, DBK)
        if EVEN:
            tl.store(OUT + row * N + k0 + offs16, out)
            tl.store(Q + row * (N // 2) + k0 // 2 + offs8, packed)
            tl.store(QS + row * (N // 16) + k0 // 16 + blk, s_code)
        else:
            tl.store(OUT + row * N + k0 + offs16, out, mask=(k0 + offs16) < N)
            tl.store(Q + row * (N // 2) + k0 // 2 + offs8, packed, mask=(k0 // 2 + offs8) < N // 2)
            tl.store(QS + row * (N // 16) + k0 // 16 + blk, s_code, mask=(k0 // 16 + blk) < N // 16)


@triton.jit
def _silu_mul_quantize_kernel(GATE, UP, OUT, Q, QS, QGS, QD, N, NB: tl.constexpr, EVEN: tl.constexpr, DBK: tl.constexpr,
                              ONE_TILE: tl.constexpr, PDL: tl.constexpr):
    """One row per program (contiguous rows of N, a multiple of 16): out = silu(gate) * up as the elementwise
    kernel, and out's NVFP4 with a per-row global scale. ONE_TILE > 0 (few rows: `quantize.one_tile`): the row
    in one tile of ONE_TILE columns, out computed once, then `quantize_rows`. Else a first walk over the row's
    chunks of NB blocks for the row's max |out|, a second that writes out and quantizes it (`quantize_codes`),
    computing out again (the same elementwise operations, so the same values) instead of reading it back."""
    if PDL:  # first: before any global memory access (kernels/pdl.py)
        pdl.prologue()
    row = tl.program_id(0).to(tl.int64)
    if ONE_TILE > 0:
        cols = tl.arange(0, ONE_TILE)[None, :]
        out = _silu_mul_chunk(GATE, UP, row * N, cols, N, False, OUT.dtype.element_ty)
        tl.store(OUT + row * N + cols, out, mask=cols < N)
        rows64 = row + tl.arange(0, 1)
        quantize_rows(out.to(tl.float32), rows64, rows64 >= 0, N, Q, QS, QGS, 1, ONE_TILE, QD, DBK)
    else:
        _silu_mul_quantize_walk(GATE, UP, OUT, Q, QS, QGS, QD, N, row, NB, EVEN, DBK)


@triton.jit
def _silu_mul_bwd_kernel(GATE, UP, G, DGATE, DUP, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-x))
    tl.store(DGATE + offs, round_to(g * u * s * (1.0 + x * (1.0 - s)), DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offs, round_to(g * x * s, DUP.dtype.element_ty), mask=mask)


def _elementwise_block() -> int:
    return 256 if interpreting() else 1024


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor, quantize: bool = False, decoded: bool = False):
    """silu(gate) * up in fp32, rounded once to gate's dtype; with `quantize` -> (out, its NVFP4 with per-row
    global scales as (packed, scale bytes, global scales[, its decoded form with `decoded`])), the last
    dimension a multiple of 16."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    if not quantize:
        if gate.numel():
            block = _elementwise_block()
            _silu_mul_fwd_kernel[(cdiv(gate.numel(), block),)](gate, up, out, gate.numel(), BLOCK=block, num_warps=4,
                                                                 **pdl.launch(gate.device))
        return out
    n = gate.shape[-1]
    r = gate.numel() // n if n else 0
    q = _quantize_buffers(r, n, gate.device, decoded)
    if r and n:
        nb = min(16 if interpreting() else 64, next_pow2(n // QBLOCK))
        tile = one_tile(r, n)
        _silu_mul_quantize_kernel[(r,)](gate, up, out, *_quantize_args(q, out), n, NB=nb, EVEN=n % (nb * QBLOCK) == 0,
                                        DBK=fp4_block_k() if decoded else 1, ONE_TILE=tile,
                                        num_warps=one_tile_warps(tile) if tile else 4, **pdl.launch(gate.device))
    return out, q


class SiluMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, quantize=False, decoded=False):
        """-> out, or with `quantize` (out, packed, scale bytes, global scales[, decoded form]): out's NVFP4 (no
        gradient)."""
        ctx.save_for_backward(gate, up)
        if not quantize:
            return silu_mul_forward(gate, up)
        out, q = silu_mul_forward(gate, up, True, decoded=decoded)
        ctx.mark_non_differentiable(*q)
        return (out, *q)

    @staticmethod
    def backward(ctx, g, *_):
        gate, up = (t.contiguous() for t in ctx.saved_tensors)
        g = g.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        if gate.numel():
            block = _elementwise_block()
            _silu_mul_bwd_kernel[(cdiv(gate.numel(), block),)](gate, up, g, dgate, dup, gate.numel(),
                                                                BLOCK=block, num_warps=4)
        return dgate, dup, None, None


# ---------------------------------------------------------------------------------------------- RoPE
@triton.jit
def rope_rotate(x1, x2, c1, c2, s1, s2, BACKWARD: tl.constexpr):
    """The two halves of the head dimension (fp32), rotated: (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2); BACKWARD:
    the transpose (the gradient)."""
    if BACKWARD:
        return x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _rope_kernel(X, C, S, O, H, T, HALF, sxb, sxh, sxt, scb, sct, ssb, sst, sob, soh, sot,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr):
    bt = tl.program_id(0)
    b = (bt // T).to(tl.int64)
    t = (bt % T).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    c1 = tl.load(C + b * scb + t * sct + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(C + b * scb + t * sct + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(S + b * ssb + t * sst + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(S + b * ssb + t * sst + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    mask = (heads < H)[:, None] & d_ok[None, :]
    h64 = heads.to(tl.int64)[:, None]
    px = X + b * sxb + h64 * sxh + t * sxt + d[None, :]
    x1 = tl.load(px, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(px + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rope_rotate(x1, x2, c1, c2, s1, s2, BACKWARD)
    po = O + b * sob + h64 * soh + t * sot + d[None, :]
    tl.store(po, round_to(o1, O.dtype.element_ty), mask=mask)
    tl.store(po + HALF, round_to(o2, O.dtype.element_ty), mask=mask)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """x [B, H, T, D], cos/sin [B or 1, 1, T, D] -> the rotated x (its dtype and layout); `backward`:
    the transposed rotation (the gradient of the forward)."""
    b, h, t, d = x.shape
    x = _unit_last(x)
    cos, sin = (_unit_last(c).expand(b, 1, t, d) for c in (cos, sin))
    out = torch.empty_like(x)  # keeps x's layout (dense strides)
    if x.numel():
        half = d // 2
        block_h = min(next_pow2(h), 4 if interpreting() else 16)
        grid = (b * t, cdiv(h, block_h))
        _rope_kernel[grid](x, cos, sin, out, h, t, half, x.stride(0), x.stride(1), x.stride(2),
                           cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2),
                           out.stride(0), out.stride(1), out.stride(2),
                           BLOCK_H=block_h, BLOCK_D=next_pow2(half), BACKWARD=backward, num_warps=4)
    return out


class RopeFunction(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin in fp32, rounded once; gradient for x only."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_apply(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return rope_apply(g, cos, sin, backward=True), None, None

