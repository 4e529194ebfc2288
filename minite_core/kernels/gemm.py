"""Batch-invariant GEMM (Triton): W4A4 NVFP4 x NVFP4, and plain bf16/fp16/fp32, out = x @ w.T.

W4A4 on Hopper, which has no FP4 tensor cores (and where `tl.dot_scaled` with E4M3 scales does not
compile): each program loads packed FP4 bytes of x and w, decodes nibbles and E4M3 block scales in
registers (on the GPU a word of 8 nibbles at a time in inline PTX, through the hardware's E4M3 -> f16x2
conversion; under the interpreter with element-wise bit moves: `decode_nvfp4_pairs`), and forms
code * block_scale, which is exact in fp16 (at most 6 significant bits, range 2^-10 .. 2688). `tl.dot` then multiplies fp16 tiles with
fp32 accumulation: per BLOCK_K step, first the even elements of the step, then the odd ones (the
order in which the bytes hold them). The global scales enter in the epilogue,
(acc * gs_x[m]) * gs_w[n], as in the torch backend. The decode step is the only
Hopper-specific part: a Blackwell path would hand the same packed bytes and scales (swizzled with
`nvfp4.to_blocked`) to a native block-scaled MMA instead. `grouped_gemm.py` runs the same tile
(`w4a4_tile`) over the experts of a MoE layer.

Tiles by M (`gemm_config`): M <= SWAP_MAX_M (256) takes swapped narrow tiles, the weight tile as the MMA's
first operand (wgmma M = 64 rows of w per warpgroup, from registers) and the activations as its N, BLOCK_M =
16, 32, 64 or 128 (the narrowest power of two >= M; above 128 rows, several 128-row tiles); larger M takes
128x256 / 128x128 tiles with x as the first operand. BLOCK_K (128 on the GPU) is one constant for every M,
and there is no autotuning.
The plain GEMM has the same two families (BLOCK_K = 64, one chain over K, no chunks): swapped narrow
tiles for M <= SWAP_MAX_M (a decode step's bf16 linears and lm_head), 128x128 above.

K chunks (`k_chunks(N, K)`, a function of (N, K) only): the K loop is cut into S chunks of equal step
count (S a power of two dividing cdiv(K, BLOCK_K), at most 4; S > 1 where N alone gives too few programs
to fill the GPU, e.g. S = 4 for N = K = 1024). The reduction order for (N, K) is then: per chunk, the MMA chain
from zero over the chunk's steps (c_i); across chunks total = ((0 + c0) + c1) + ... in fp32, left to
right; then the epilogue. M <= SWAP_MAX_M (SPLIT): grid (tiles, S), program (t, i) writes c_i of its tile to
an fp32 scratch [S, M, N] (torch.empty in the launcher: no sync, graph-capturable); the tile's last
program to finish (a per-tile arrival counter: a CTA barrier, then an acq_rel atomic at GPU scope, the
partials read back past L1) adds the S partials in chunk order and applies the epilogue, so no second
launch (COMBINE_IN_KERNEL; False: `_combine_kernel` does the same additions). M > SWAP_MAX_M and the grouped
kernel: one program walks the chunks in order, a second accumulator `total` in registers (`w4a4_tile` with
CHUNKED; chunks of one step start each step's chain from no accumulator and add it into `total`, without
selects), no scratch; with S > 1 the wide tile is 128x128 (a 128x256 tile with two accumulators would spill).

Why a row's bits cannot depend on the tile (so M, the other rows, and the config chosen for M do not
matter):
1. The operands are exact. code * block_scale is exact in fp16, so every product x[m, k] * w[n, k] is
   exact in fp32 (and in the tensor core, which forms fp16 products exactly); swapping the operands
   (w as A, x as B) gives the same products. (The 8 products of one half-block share one scale
   product and sum exactly: <= 8 * 144 quarter-units times an 8-bit scale product.)
2. The K order is a function of BLOCK_K and S = k_chunks(N, K) alone: steps of BLOCK_K from k = 0,
   each step first its even elements then its odd ones (BLOCK_K/2 columns each), and `tl.dot` splits
   each into k16 MMA chunks issued low to high into the chunk's fp32 accumulator, which starts from zero
   at every chunk boundary. BLOCK_M, BLOCK_N, SWAP_AB, SPLIT, warps and stages change which output
   elements a program holds, and where a chunk sum waits (registers or the fp32 scratch, which stores it
   exactly), never the chain of k16 chunks that builds one chunk sum of one element.
3. An MMA computes each output element as a function of that element's accumulator and its own 16
   products only: rows of A never mix, nor columns of B, and the per-element datapath does not depend
   on the instruction's N (n16 .. n256) or on whether the element sits in A's rows or B's columns. All
   configs here lower to the same instruction family (wgmma m64nNk16, fp16 in, fp32 accumulate: the
   swapped tile's MMA-M is BLOCK_N = 64 rows of w per warpgroup; bench/gemm_probe.py prints the MMA
   version from the TTGIR). This is the hardware property the GPU run of the invariance tests checks;
   under the interpreter the fp16 dot is numpy's own loop, per element as well.
4. The chunk combine is the same sequence of fp32 additions in every place: total = 0, then
   total = total + c_i for i = 0 .. S-1 (the walk does it at each chunk's last step, the split tile's last
   program or the combine kernel over the scratch), each a correctly rounded fp32 add. S = 1 skips it in every config (acc = c_0).
5. The epilogue is per element, (total * gs_x[m]) * gs_w[n] (+ bias), two fp32 roundings in a fixed
   order, one helper (`w4a4_epilogue`, `_store_out`) for the one-program, combine and grouped kernels.
   Out-of-range rows and columns load zeros, are never stored, and cannot reach a valid row.
So a config may vary with M in everything but BLOCK_K, S, the even/odd split and the combine order; the
tests compare gemm(x[:1]) with gemm(x)[:1] and each row alone with the row in a batch, for M across
every bucket (1 .. 300) and shapes with S = 1, 2, 4 (split and walk), and the grouped kernel with this one.

Several weights, one launch (`gemm_many_triton`): the q/k/v (gate/up) projections of a layer read the
same activation; up to three weights with the same tile config (so the same K chunks) run in one launch,
their column tiles side by side, each tile aligned to its weight, so a program computes a tile of one
weight with that weight's pointers, exactly as a launch for it alone would (`_pick` selects them by tile
column). A decode step saves the launches (and the combines) of the other weights; the bits do not change.

Under TRITON_INTERPRET=1 (CPU tests) tiles are smaller (BLOCK_K = 64, the same bucket structure), and
the plain (non-FP4) path multiplies tiles with an elementwise product and `tl.sum` instead of `tl.dot`:
the interpreter's bf16 dot is wrong, and its fp32 dot calls BLAS, whose result for a row depends on the
row's position in the tile. (The FP4 path's fp16 dot runs numpy's own loop, which is
position-invariant, so it is tested as on the GPU.)
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from ..nvfp4 import NVFP4Tensor
from . import pdl


# Whether Triton runs the kernels in its interpreter (the CPU tests): read once, at import, as Triton's `jit`
# decides it for each kernel where it is defined; tests that need the other answer patch `_INTERPRET`.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    return _INTERPRET


# The launchers' integer arithmetic: `triton.cdiv` and `triton.next_power_of_2` are `constexpr_function`s,
# ~2 µs a call from Python (argument unwrapping), and a learner step's launches made ~1,600 such calls.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """`triton.next_power_of_2(n)`: the smallest power of two >= n (0 for n = 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# How the FP4 operands are decoded (`decode_nvfp4_pairs`): "ptx" (the GPU default: a word of 8 nibbles at a
# time, in inline PTX) or "bits" (an element at a time, in Triton ops: what the interpreter runs, and on
# a GPU `MINITE_FP4_DECODE=bits`, for comparison). Both give the same fp16 values (exact, see
# `decode_nvfp4_pairs`); fixed at import, as Triton fixes interpretation, because a jitted function
# reads it as a constant.
_DECODE = os.environ.get("MINITE_FP4_DECODE", "bits" if interpreting() else "ptx")
if _DECODE not in ("ptx", "bits") or (_DECODE == "ptx" and interpreting()):
    raise ValueError(f"MINITE_FP4_DECODE={_DECODE!r}: set it to ptx (GPU, sm_89 or later) or bits"
                     + (" (the Triton interpreter cannot run PTX)" if _DECODE == "ptx" else ""))
PTX_DECODE = tl.constexpr(_DECODE == "ptx")


@functools.lru_cache(maxsize=None)
def decode_supported(index: int) -> tuple[bool, str]:
    cap = torch.cuda.get_device_capability(index)
    return cap >= (8, 9), f"sm_{cap[0]}{cap[1]}"


def check_decode(device: torch.device, *packed: NVFP4Tensor) -> None:
    """A clear error, before a compile fails in ptxas or a load faults, where the PTX decode cannot run:
    its E4M3 -> f16x2 conversion needs sm_89 or later, and it reads the packed bytes two at a time (rows
    that start at even addresses, which every tensor `nvfp4` makes has)."""
    if _DECODE == "ptx" and device.type == "cuda":
        ok, arch = decode_supported(device.index if device.index is not None else torch.cuda.current_device())
        if not ok:
            raise RuntimeError(f"the NVFP4 kernels' PTX decode needs sm_89 or later, {device} is {arch}: "
                               "set MINITE_FP4_DECODE=bits")
        for t in packed:
            if t.data.data_ptr() % 2 or (t.data.dim() > 1 and t.data.stride(-2) % 2):
                raise ValueError("packed NVFP4 data whose rows start at odd byte addresses (a view into the bytes?): "
                                 "the GPU decode reads them two bytes at a time; pass a copy (.clone())")


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


# 4 packed bytes (8 E2M1 codes; two int16 elements of the tile, which Triton packs into one 32-bit register, element
# 0 in the low half) -> for each int16, an f16x2 of its 2 even codes ($0, $1) and one of its 2 odd codes ($2, $3),
# as fp16 code * 2^-6. Each code becomes an E4M3 byte: its 3 magnitude bits go to bits 4..2 (exponent 00ee,
# mantissa m00: (1 + m/2) 2^(e-7), or m/2 2^-6 for e = 0, so the E2M1 value times 2^-6, subnormals included),
# its sign to bit 7, four bytes at once; the hardware's E4M3 -> f16x2 conversion (low byte -> low half) does the
# rest. tests/kernels/test_decode_ptx.py executes this text on the CPU.
_E2M1X8_PTX = tl.constexpr("""{
.reg .b32 m, s, lo, hi;
.reg .b16 l0, l1, h0, h1;
shl.b32 m, $4, 2;
and.b32 m, m, 0x1C1C1C1C;
shl.b32 s, $4, 4;
and.b32 s, s, 0x80808080;
or.b32 lo, m, s;
shr.b32 m, $4, 2;
and.b32 m, m, 0x1C1C1C1C;
and.b32 s, $4, 0x80808080;
or.b32 hi, m, s;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, l1;
cvt.rn.f16x2.e4m3x2 $2, h0;
cvt.rn.f16x2.e4m3x2 $3, h1;
}""")


@triton.jit
def decode_nvfp4_pairs(packed, scale, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed bytes (`load_packed`) and the fp16 block scale of each pair [ROWS, BLOCK_K/2] (`decode_scales`)
    -> (even, odd) elements [ROWS, BLOCK_K/2], fp16 code * scale.

    Both products are exact in fp16: code * scale has at most 6 significant bits and lies in 2^-10 .. 2688.
    PTX_DECODE: `packed` holds the bytes two to an int16 [ROWS, BLOCK_K/4], and the codes come as
    code * 2^-6 (`_E2M1X8_PTX`, on 4 bytes at once; with the scale multiply ~3 SASS instructions a code in the
    M <= 16 tile, against ~7.7 when Triton works on one element per register) with the scale as scale * 2^6, so the product is the same exact
    value (code * 2^-6 >= 2^-7 and scale * 2^6 >= 2^-3: nothing underflows). Each int16 gives one f16x2 of
    even codes and one of odd codes (an int32 each); they are split into halves and joined back into
    [ROWS, BLOCK_K/2], which moves no data: the pairs are the MMA operand's pairs of neighbouring k.
    Else `packed` is the uint8 bytes [ROWS, BLOCK_K/2], decoded an element at a time.
    Returning the even and the odd elements as two tiles (instead of interleaving them back) avoids a
    register shuffle; the GEMM sums over K in that permuted order.
    """
    if PTX_DECODE:
        e2, o2 = tl.inline_asm_elementwise(_E2M1X8_PTX, "=r,=r,=r,=r,r", [packed], dtype=(tl.int32, tl.int32),
                                           is_pure=True, pack=2)
        return _f16x2_tile(e2, ROWS, BLOCK_K) * scale, _f16x2_tile(o2, ROWS, BLOCK_K) * scale
    else:
        p = packed.to(tl.int16)
        return e2m1_to_fp16(p & 0xF) * scale, e2m1_to_fp16(p >> 4) * scale


_SPLIT_F16X2_PTX = tl.constexpr("mov.b32 {$0, $1}, $2;")  # a 32-bit register -> its low half, its high half


@triton.jit
def _f16x2_tile(pairs, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 [ROWS, BLOCK_K/4] holding f16x2 pairs of neighbouring elements -> fp16 [ROWS, BLOCK_K/2], the low
    half first: a register split and a join, no data movement."""
    lo, hi = tl.inline_asm_elementwise(_SPLIT_F16X2_PTX, "=h,=h,r", [pairs], dtype=(tl.float16, tl.float16),
                                       is_pure=True, pack=1)
    return tl.reshape(tl.join(lo, hi), [ROWS, BLOCK_K // 2])


@triton.jit
def load_packed(ptr, rows, mask_r, stride, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The packed bytes of the K step at k0 for `rows` (zeros past K and for masked rows), in the form
    `decode_nvfp4_pairs` takes: two bytes an int16 [R, BLOCK_K/4] for the PTX decode (a row's bytes start
    at an even address: K is a multiple of 16), else uint8 [R, BLOCK_K/2]. `stride` is in bytes."""
    if PTX_DECODE:
        kq = k0 // 4 + tl.arange(0, BLOCK_K // 4)
        mask = mask_r[:, None] if EVEN_K else mask_r[:, None] & (kq < K // 4)[None, :]
        return tl.load(ptr.to(tl.pointer_type(tl.int16)) + rows[:, None] * (stride // 2) + kq[None, :], mask=mask, other=0)
    else:
        kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = mask_r[:, None] if EVEN_K else mask_r[:, None] & (kp < K // 2)[None, :]
        return tl.load(ptr + rows[:, None] * stride + kp[None, :], mask=mask, other=0)


@triton.jit
def decode_scales(scale_bytes, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """E4M3 block-scale bytes [ROWS, BLOCK_K/16] -> fp16 [ROWS, BLOCK_K/2], each scale decoded once, then
    spread over its 8 bytes, in the unit `decode_nvfp4_pairs` takes."""
    if PTX_DECODE:  # the hardware's E4M3 -> f16x2 conversion (exact), two scales an instruction
        s = scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 64.0
    else:
        s = e4m3_to_fp16(scale_bytes.to(tl.int16))
    return tl.reshape(tl.broadcast_to(s[:, :, None], [ROWS, BLOCK_K // 16, 8]), [ROWS, BLOCK_K // 2])


@triton.jit
def decode_step(packed, scale_bytes, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK_K step of packed bytes (as `load_packed` gives them) and E4M3 scale bytes [ROWS, BLOCK_K/16] -> (even,
    odd) fp16 tiles [ROWS, BLOCK_K/2] of code * block scale: each block scale decoded once, then spread
    over its 8 bytes."""
    return decode_nvfp4_pairs(packed, decode_scales(scale_bytes, ROWS, BLOCK_K), ROWS, BLOCK_K)


@triton.jit
def _step_operands(a_ptr, as_ptr, b_ptr, bs_ptr, offs_m, mask_m, offs_n, mask_n, K, k0,
                   stride_am, stride_asm, stride_bn, stride_bsn,
                   EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DECODED: tl.constexpr, A_DECODED: tl.constexpr):
    """The K step at k0 of both operands as fp16 code * block scale: (a_even, a_odd, b_even, b_odd), each
    step's even elements then its odd ones (loaded decoded, or loaded packed and decoded here)."""
    k0 = tl.multiple_of(k0, BLOCK_K)  # steps start at multiples of BLOCK_K: keeps the loads vectorized
    ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)  # block-scale index
    kh = k0 + tl.arange(0, BLOCK_K // 2)  # decoded operands: the step's evens, then its odds (zero-padded)
    if EVEN_K:  # no mask along K, so the byte loads vectorize
        mask_as, mask_bs = mask_m[:, None], mask_n[:, None]
    else:
        mask_as, mask_bs = mask_m[:, None] & (ks < K // 16)[None, :], mask_n[:, None] & (ks < K // 16)[None, :]
    if DECODED or A_DECODED:  # fp16 code * scale
        a_even = tl.load(a_ptr + offs_m[:, None] * stride_am + kh[None, :], mask=mask_m[:, None], other=0.0)
        a_odd = tl.load(a_ptr + offs_m[:, None] * stride_am + (kh + BLOCK_K // 2)[None, :], mask=mask_m[:, None], other=0.0)
    else:
        a = load_packed(a_ptr, offs_m, mask_m, stride_am, k0, K, EVEN_K, BLOCK_K)
    if DECODED:
        b_even = tl.load(b_ptr + offs_n[:, None] * stride_bn + kh[None, :], mask=mask_n[:, None], other=0.0)
        b_odd = tl.load(b_ptr + offs_n[:, None] * stride_bn + (kh + BLOCK_K // 2)[None, :], mask=mask_n[:, None], other=0.0)
    else:
        b = load_packed(b_ptr, offs_n, mask_n, stride_bn, k0, K, EVEN_K, BLOCK_K)
    if not (DECODED or A_DECODED):
        sa = tl.load(as_ptr + offs_m[:, None] * stride_asm + ks[None, :], mask=mask_as, other=0)
    if not DECODED:
        sb = tl.load(bs_ptr + offs_n[:, None] * stride_bsn + ks[None, :], mask=mask_bs, other=0)
    if not (DECODED or A_DECODED):
        a_even, a_odd = decode_step(a, sa, BLOCK_M, BLOCK_K)
    if not DECODED:
        b_even, b_odd = decode_step(b, sb, BLOCK_N, BLOCK_K)
    return a_even, a_odd, b_even, b_odd


@triton.jit
def _mma_step(acc, a_even, a_odd, b_even, b_odd, SWAP_AB: tl.constexpr):
    """acc + the step's products, evens then odds, k16 chunks low to high (acc None: wgmma's zero-input
    form). SWAP_AB (M <= SWAP_MAX_M): the weight tile is the MMA's first operand, kept in registers, and acc is the
    transposed tile [BLOCK_N, BLOCK_M]."""
    if SWAP_AB:
        acc = tl.dot(b_even, tl.trans(a_even), acc)
        return tl.dot(b_odd, tl.trans(a_odd), acc)
    else:
        acc = tl.dot(a_even, tl.trans(b_even), acc)
        return tl.dot(a_odd, tl.trans(b_odd), acc)


@triton.jit
def w4a4_tile(
    a_ptr, as_ptr, b_ptr, bs_ptr, offs_m, mask_m, offs_n, mask_n, K, k_lo, k_hi, chunk_k,
    stride_am, stride_asm, stride_bn, stride_bsn,
    EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, CHUNKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODED: tl.constexpr = False,
    A_DECODED: tl.constexpr = False,
):
    """sum_k (code * block scale)_x[m, k] * (code * block scale)_w[n, k] over k in [k_lo, k_hi) for one
    [BLOCK_M, BLOCK_N] tile, fp32.

    The K order is fixed by BLOCK_K and the K chunks (`k_chunks`, a function of (N, K)) alone: steps of
    BLOCK_K, and inside a step first the BLOCK_K/2 even elements, then the odd ones, each fed to the MMA
    in k16 chunks from low to high k, into one accumulator per chunk of `chunk_k` elements (started from
    zero). CHUNKED (more than one chunk for this (N, K), `walk_mode`): the chunk sums are added into `total`
    in chunk order, total = ((0 + c0) + c1) + ..., and `total` is returned; else the one accumulator is.
    Three forms of that walk, the same fp32 additions in the same order:
    - 1, chunks of a few steps: one loop over the steps; at a chunk's last step two selects add the
      accumulator into `total` and reset it (selects, not a branch: ptxas serializes every MMA of a
      kernel when a branch writes the accumulator);
    - 2, one-step chunks (the 0.6B widths: S = the step count): each step's chain starts from no accumulator
      (wgmma's zero-input form) and is added into `total`, with no selects. (The step stays two dots: Triton
      rewrites `total + dot(a, b)` of a single dot from zero into `dot(a, b, total)`, the MMA chained onto
      the total, which is another order; tests/kernels/test_gemm_sm90.py checks the compiled flush);
    - 3, long chunks (>= LONG_CHUNK_STEPS steps): a loop over the chunks around a loop over their steps, so
      inside a chunk the MMA chain is asynchronous and no select runs; each chunk refills its load
      pipeline, which long chunks amortize.
    (A chain started from no accumulator differs from one started from zero only in the sign of a zero
    sum, which the addition into `total`, itself started from +0, cannot carry.)
    [k_lo, k_hi) is either all of K or one chunk (the split programs, with CHUNKED = 0: they return the
    chunk's chain c_i and `_combine_kernel` does the same additions). The dense and the grouped kernel
    both call this, so a row gets the same bits from either.

    DECODED: a and b are fp16 [rows, cdiv(K, BLOCK_K) * BLOCK_K] already decoded by `decode_nvfp4`
    (code * block scale, each BLOCK_K step laid out as its even elements then its odd ones, zeros past K):
    the tile loads the two halves instead of decoding bytes, and feeds the same values to the same dots.
    A_DECODED: only a (the activations) comes decoded; b is decoded from its packed bytes in the tile.
    """
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    total = acc
    if CHUNKED == 3:
        for c0 in range(k_lo, k_hi, chunk_k):
            part = tl.zeros_like(acc)
            for k0 in range(c0, tl.minimum(c0 + chunk_k, k_hi), BLOCK_K):
                a_even, a_odd, b_even, b_odd = _step_operands(
                    a_ptr, as_ptr, b_ptr, bs_ptr, offs_m, mask_m, offs_n, mask_n, K, k0,
                    stride_am, stride_asm, stride_bn, stride_bsn, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, DECODED, A_DECODED)
                part = _mma_step(part, a_even, a_odd, b_even, b_odd, SWAP_AB)
            total += part
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a_even, a_odd, b_even, b_odd = _step_operands(
                a_ptr, as_ptr, b_ptr, bs_ptr, offs_m, mask_m, offs_n, mask_n, K, k0,
                stride_am, stride_asm, stride_bn, stride_bsn, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, DECODED, A_DECODED)
            if CHUNKED == 2:  # one-step chunks: the step's chain from no accumulator, added into the total
                total += _mma_step(None, a_even, a_odd, b_even, b_odd, SWAP_AB)
            else:
                acc = _mma_step(acc, a_even, a_odd, b_even, b_odd, SWAP_AB)
            if CHUNKED == 1:  # a chunk's last step (chunks start at multiples of chunk_k, the last ends at K)
                end = ((k0 + BLOCK_K) % chunk_k == 0) | (k0 + BLOCK_K >= k_hi)
                total = tl.where(end, total + acc, total)
                acc = tl.where(end, 0.0, acc)
    if CHUNKED:
        acc = total
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def w4a4_epilogue(acc, ags_ptr, stride_ags, bgs_ptr, stride_bgs, offs_m, mask_m, offs_n, mask_n):
    """(acc * gs_x[m]) * gs_w[n]: two fp32 roundings in a fixed order, per element."""
    gsa = tl.load(ags_ptr + offs_m * stride_ags, mask=mask_m, other=1.0)
    gsb = tl.load(bgs_ptr + offs_n * stride_bgs, mask=mask_n, other=1.0)
    return (acc * gsa[:, None]) * gsb[None, :]


@triton.jit
def _store_out(acc, bias_ptr, c_ptr, stride_cm, offs_m, mask_m, offs_n, mask_n, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _pick(seg, v0, v1, v2, NSEG: tl.constexpr):
    """Segment `seg`'s value (a scalar or a pointer) of a launch over NSEG weights."""
    if NSEG == 1:
        return v0
    if NSEG == 2:
        return tl.where(seg == 0, v0, v1)
    return tl.where(seg == 0, v0, tl.where(seg == 1, v1, v2))


@triton.jit
def last_to_arrive(cnt_ptr, i, arrivals):
    """True in the last of `arrivals` programs to count themselves in counter i: a CTA barrier first (every
    thread's stores are issued before the release), then an acq_rel atomic at GPU scope, so the last program
    sees every other program's stores (read them past L1: `.cg`). The caller resets the counter to 0 when it
    is done, so the counters are all zero between launches (a CUDA graph replays them)."""
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr + i, 1, sem="acq_rel", scope="gpu") == arrivals - 1


@triton.jit
def _combine_kernel(
    p_ptr, ags_ptr, M, S, chunk_stride, n_total, stride_ags,
    bgs0, sg0, bias0, c0, n0, bgs1, sg1, bias1, c1, n1, bgs2, sg2, bias2, c2, n2, t1, t2,
    HAS_BIAS: tl.constexpr, NSEG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The split programs' chunk sums [S, M, n_total] (fp32; the weights' columns side by side) -> each
    weight's out: total = ((0 + c0) + c1) + ... in chunk order, then the dense kernel's epilogue: the same
    fp32 operations, in the same order, as the chunk walk in `w4a4_tile` followed by the one-program
    epilogue. Column tiles are aligned to the weights (t1, t2: the first tile of weights 1 and 2)."""
    pid_n = tl.program_id(1)
    seg = (pid_n >= t1).to(tl.int32) + (pid_n >= t2).to(tl.int32)
    N = _pick(seg, n0, n1, n2, NSEG)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid_n - _pick(seg, 0, t1, t2, NSEG)) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask = mask_m[:, None] & mask_n[None, :]
    ptrs = p_ptr + offs_m[:, None] * n_total + (_pick(seg, 0, n0, n0 + n1, NSEG) + offs_n)[None, :]
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(0, S):
        total = total + tl.load(ptrs + s * chunk_stride, mask=mask, other=0.0)
    acc = w4a4_epilogue(total, ags_ptr, stride_ags, _pick(seg, bgs0, bgs1, bgs2, NSEG), _pick(seg, sg0, sg1, sg2, NSEG),
                        offs_m, mask_m, offs_n, mask_n)
    _store_out(acc, _pick(seg, bias0, bias1, bias2, NSEG), _pick(seg, c0, c1, c2, NSEG), N,
               offs_m, mask_m, offs_n, mask_n, HAS_BIAS)


@triton.jit
def _gemm_kernel(
    a_ptr, as_ptr, ags_ptr,
    b0, bs0, bgs0, sg0, bias0, c0, n0, b1, bs1, bgs1, sg1, bias1, c1, n1, b2, bs2, bgs2, sg2, bias2, c2, n2,
    p_ptr, cnt_ptr, M, K, chunk_k, n_total, t1, t2, grid_n,
    stride_am, stride_asm, stride_ags, stride_bn, stride_bsn,
    FP4: tl.constexpr, DOT_FP32: tl.constexpr, DOT_BY_SUM: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, HAS_BIAS: tl.constexpr,
    CHUNKED: tl.constexpr, SPLIT: tl.constexpr, DECODED: tl.constexpr, NSEG: tl.constexpr, FIXUP: tl.constexpr,
    A_DECODED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):
    """x @ w_i.T for NSEG (1-3) weights w_i [n_i, K] of one launch, each into its own contiguous out c_i:
    the column tiles are aligned to the weights (t1, t2: the first tile column of weights 1 and 2), so a
    program computes a tile of one weight, exactly as a launch for that weight alone would.
    FP4: SPLIT, program (tile, c) writes chunk c's partial of its tile to p_ptr [S, M, n_total] (fp32, the
    weights' columns side by side); FIXUP: the tile's last program to count itself in `cnt_ptr` [tiles]
    finishes (sums the partials in chunk order, the epilogue), else `_combine_kernel` does, the same
    operations; not SPLIT: the program walks every chunk in order and finishes itself, on packed operands
    or (DECODED) on `decode_nvfp4`'s fp16 ones; A_DECODED: the activations come decoded, the weights packed.
    grid_n: the tile columns of all the weights."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
    pid_n = (pid % (GROUP_M * grid_n)) // size_m
    seg = (pid_n >= t1).to(tl.int32) + (pid_n >= t2).to(tl.int32)
    N = _pick(seg, n0, n1, n2, NSEG)
    b_ptr = _pick(seg, b0, b1, b2, NSEG)
    c_ptr = _pick(seg, c0, c1, c2, NSEG)
    bias_ptr = _pick(seg, bias0, bias1, bias2, NSEG)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid_n - _pick(seg, 0, t1, t2, NSEG)) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if PDL:  # before any global memory access but L2 prefetches (kernels/pdl.py)
        if SWAP_AB:  # decode: the weight rows stream into L2 while the previous kernel finishes
            if FP4:
                k_lo = tl.program_id(1) * chunk_k if SPLIT else 0
                k_hi = tl.minimum(k_lo + chunk_k, K) if SPLIT else K
                pdl.prefetch_rows(b_ptr, offs_n, N, stride_bn, k_lo // 2, k_hi // 2)
                pdl.prefetch_rows(_pick(seg, bs0, bs1, bs2, NSEG), offs_n, N, stride_bsn, k_lo // 16, k_hi // 16)
            else:
                pdl.prefetch_rows(b_ptr, offs_n, N, stride_bn, 0, K)
        pdl.prologue()
    if FP4:
        bs_ptr = _pick(seg, bs0, bs1, bs2, NSEG)
        if SPLIT:
            pid_k = tl.program_id(1)
            k_lo = tl.multiple_of(pid_k * chunk_k, BLOCK_K)  # so the scale loads keep their vector width
            acc = w4a4_tile(a_ptr, as_ptr, b_ptr, bs_ptr, offs_m, mask_m, offs_n, mask_n, K, k_lo, tl.minimum(k_lo + chunk_k, K),
                            chunk_k, stride_am, stride_asm, stride_bn, stride_bsn, EVEN_K, SWAP_AB, False,
                            BLOCK_M, BLOCK_N, BLOCK_K, False, A_DECODED)  # one chunk: its raw chain c_i
            col = _pick(seg, 0, n0, n0 + n1, NSEG) + offs_n
            p = p_ptr + offs_m[:, None] * n_total + col[None, :]
            mask = mask_m[:, None] & mask_n[None, :]
            tl.store(p + pid_k.to(tl.int64) * M * n_total, acc, mask=mask)
            if FIXUP:  # the tile's last program to finish adds the S partials in chunk order (no combine launch)
                if last_to_arrive(cnt_ptr, pid, tl.num_programs(1)):
                    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                    for c in range(0, tl.num_programs(1)):  # the combine kernel's additions, in the same order
                        total = total + tl.load(p + c * M * n_total, mask=mask, other=0.0, cache_modifier=".cg")
                    tl.store(cnt_ptr + pid, 0)  # the counters are all zero between launches
                    acc = w4a4_epilogue(total, ags_ptr, stride_ags, _pick(seg, bgs0, bgs1, bgs2, NSEG),
                                        _pick(seg, sg0, sg1, sg2, NSEG), offs_m, mask_m, offs_n, mask_n)
                    _store_out(acc, bias_ptr, c_ptr, N, offs_m, mask_m, offs_n, mask_n, HAS_BIAS)
        else:
            acc = w4a4_tile(a_ptr, as_ptr, b_ptr, bs_ptr, offs_m, mask_m, offs_n, mask_n, K, 0, K, chunk_k,
                            stride_am, stride_asm, stride_bn, stride_bsn, EVEN_K, SWAP_AB, CHUNKED, BLOCK_M, BLOCK_N, BLOCK_K,
                            DECODED, A_DECODED)
            acc = w4a4_epilogue(acc, ags_ptr, stride_ags, _pick(seg, bgs0, bgs1, bgs2, NSEG), _pick(seg, sg0, sg1, sg2, NSEG),
                                offs_m, mask_m, offs_n, mask_n)
            _store_out(acc, bias_ptr, c_ptr, N, offs_m, mask_m, offs_n, mask_n, HAS_BIAS)
    else:  # plain: one chain over K in BLOCK_K steps; SWAP_AB (M <= SWAP_MAX_M): w is the MMA's first operand
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :], mask=mask_m[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr + offs_n[:, None] * stride_bn + kk[None, :], mask=mask_n[:, None] & k_ok[None, :], other=0.0)
            if DOT_BY_SUM:
                # interpreter only: numpy's fp32 matmul (BLAS) is not row-position invariant
                if SWAP_AB:
                    acc_t += tl.sum(b.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :], axis=2)
                else:
                    acc += tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)
            elif DOT_FP32:
                if SWAP_AB:
                    acc_t = tl.dot(b.to(tl.float32), tl.trans(a.to(tl.float32)), acc_t, input_precision="ieee")
                else:
                    acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
            elif SWAP_AB:
                acc_t = tl.dot(b, tl.trans(a), acc_t)
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        if SWAP_AB:
            acc = tl.trans(acc_t)
        _store_out(acc, bias_ptr, c_ptr, N, offs_m, mask_m, offs_n, mask_n, HAS_BIAS)


@triton.jit
def load_decode_step(p_ptr, s_ptr, rows, mask_r, k0, K, stride_p, stride_s, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K step at k0 of rows `rows` of a packed NVFP4 tensor (bytes, E4M3 scale bytes; zeros past K or R),
    decoded by `decode_step` -> (even, odd) fp16 [BLOCK_R, BLOCK_K/2]."""
    ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    packed = load_packed(p_ptr, rows, mask_r, stride_p, k0, K, False, BLOCK_K)
    scale = tl.load(s_ptr + rows[:, None] * stride_s + ks[None, :], mask=mask_r[:, None] & (ks < K // 16)[None, :], other=0)
    return decode_step(packed, scale, BLOCK_R, BLOCK_K)


@triton.jit
def _decode_kernel(p_ptr, s_ptr, o_ptr, R, K, stride_p, stride_s, stride_o,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed NVFP4 rows -> fp16 code * block scale, each BLOCK_K step as its even elements then its odd
    ones (`w4a4_tile`'s order), zeros past K: the operand layout of the DECODED tile."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    mask_r = offs_r < R
    even, odd = load_decode_step(p_ptr, s_ptr, offs_r, mask_r, k0, K, stride_p, stride_s, BLOCK_R, BLOCK_K)
    kh = k0 + tl.arange(0, BLOCK_K // 2)
    out = o_ptr + offs_r[:, None] * stride_o
    tl.store(out + kh[None, :], even, mask=mask_r[:, None])
    tl.store(out + (kh + BLOCK_K // 2)[None, :], odd, mask=mask_r[:, None])


def decode_nvfp4(t: NVFP4Tensor, block_k: int) -> torch.Tensor:
    """fp16 [R, cdiv(K, block_k) * block_k]: code * block scale (exact in fp16) of the R rows of an NVFP4 tensor
    [..., K] (2-D, or with contiguous parts), in the DECODED tile's layout; the global scales are not applied
    (the GEMM's epilogue does that)."""
    t = _evenly_strided_rows(t)
    check_decode(t.data.device, t)
    r, k = math.prod(t.shape[:-1]), t.shape[-1]
    steps = cdiv(k, block_k)
    out = torch.empty(r, steps * block_k, dtype=torch.float16, device=t.data.device)
    if r:
        block_r = 16 if interpreting() else 64
        _decode_kernel[(cdiv(r, block_r), steps)](
            t.data, t.scale.view(torch.uint8), out, r, k, t.data.stride(-2), t.scale.stride(-2), out.stride(0),
            BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return out


# M <= SWAP_MAX_M uses the swapped narrow tiles: the weights are the MMA's first operand (wgmma's M = 64 per
# warpgroup, from registers), the activations its N (16/32/64/128 by M: the narrowest power of two >= M).
# M > SWAP_MAX_M uses the wide 128-row tiles. Every config has BLOCK_K = 128 and the same K order, so a
# row's bits do not depend on which one ran (see the module docstring; tests/core/test_ops.py and
# bench/gemm.py check it). SMALL_M_TILES = False falls back to the wide tiles for every M.
SMALL_M_TILES = True
# The plain (bf16/fp16/fp32) GEMM likewise: swapped narrow tiles for M <= SWAP_MAX_M (BLOCK_K = 64 and one
# chain over K for every M, so the same bits), where 128x128 tiles did 8x the MMA work at M = 16 and gave
# N = 1024 eight programs. False: 128x128 for every M.
SMALL_M_PLAIN = True
# SWAP_MAX_M (set below) above 128: more rows take several 128-row swapped tiles (same bits). On an H100
# (2026-12-07, fourth session, docs/benchmarks.md) a b256 decode step took 1-9% less at 512 than at 128 (NVFP4 0.6B
# 9.09 -> 8.97 ms, 1.7B 12.30 -> 11.18; BF16 6.75 -> 6.55, 8.60 -> 8.33); the GPU tests passed at 256 (2026-12-08),
# the default since.
# MINITE_SWAP_MAX_M (read at import; the bits do not depend on it) sets another bound. Under the CPU interpreter
# (the tests) the bound is 128: the same two tile families meet there, for half the rows a wide-tile test interprets.
DEFAULT_SWAP_MAX_M = 256
INTERPRETER_SWAP_MAX_M = 128
SWAP_CONFIGS = {  # BLOCK_M (the swapped MMA's N) -> the rest of the tile; BLOCK_K is fixed below
    16: dict(BLOCK_N=64, num_warps=4, num_stages=4),
    32: dict(BLOCK_N=64, num_warps=4, num_stages=4),
    64: dict(BLOCK_N=64, num_warps=4, num_stages=4),
    128: dict(BLOCK_N=64, num_warps=4, num_stages=3),  # 255 registers, no spill; 8 warps: 35 barriers per K step
    256: dict(BLOCK_N=64, num_warps=8, num_stages=3),  # (SWAP_TILE_MAX = 256 only; untimed, never compiled yet)
}
# The widest swapped tile (its BLOCK_M, the swapped MMA's N): 128, so 129..SWAP_MAX_M rows take several 128-row
# tiles, each decoding the weight tile again (at b256 NVFP4's GEMMs took 1.5x BF16's, 2026-12-08). 256 (an A/B for
# the device, `bench/gpu_session.sh swap-tile`): one tile of up to 256 rows, 8 warps, each weight tile decoded once.
# The same K order, so the same bits (tests/kernels/test_gemm.py); not the default until timed and GPU-tested.
SWAP_TILE_MAX = 128
FP4_BLOCK_K = 128  # the K order of every W4A4 config on the GPU (never per M)
# M > SWAP_MAX_M (compute-bound: prefill, the learner): both operands decoded once into fp16 (`decode_nvfp4`,
# ~2.5 bytes per element read and written, or written by the kernel that quantized them: `NVFP4Tensor.decoded`)
# and the walk run on them (`w4a4_tile` with DECODED): the same values in the same dots, so the same bits,
# without the per-tile decode that holds the packed kernel to ~0.3x of a bf16 GEMM. The small-M tiles keep the
# packed operands (bandwidth-bound: 0.56 bytes a weight).
DECODE_WIDE = True
# M <= SWAP_MAX_M: from this M up, the activation is decoded once (`decode_nvfp4`, one more launch) instead of
# in every program (each of a row tile's N-tile programs decodes the same x step: at M = 64 half of the
# tile's decode work); the weights stay packed. The same values in the same dots, so the same bits. None:
# off, until bench/gemm.py's `x decoded` columns show a gain on the GPU.
DECODE_X_MIN_M: int | None = None
# M > SWAP_MAX_M on a weight that carries no decoded form (the rollout's: its weights stay 0.56 bytes each, no fp16
# copy), up to this M: the wide tile decodes the packed weight itself and reads the activation decoded (A_DECODED,
# as the op that quantized it wrote it), instead of a `decode_nvfp4` launch per weight per call (196 launches a
# 0.6B prefill, on a host-bound prefill). The same values in the same dots, so the same bits. None: off (every
# weight decoded per call); the learner's weights carry their decoded form and never take this path. 2048: on an
# H100 (2026-12-06, docs/benchmarks.md) it saved 5.5-8 ms of a prefill at M = 2048 (0.6B and 1.7B) and at 0.6B up
# to M = 8192, but cost 5-20 ms at 1.7B from M = 4096 (the tile's decode repeats per row tile: GPU time that a
# host-bound prefill hides and a GPU-bound one pays).
# MINITE_WIDE_PACKED_MAX_M (read at import; the bits do not depend on it) sets another bound, 0 off.
DEFAULT_WIDE_PACKED_MAX_M: int | None = 2048


def _env_count(name: str, default, valid, want: str):
    """The non-negative integer setting `name` from the environment (`default` when unset); a value that is not
    one, or that `valid` refuses, raises a ValueError naming the variable and what it wants."""
    value = os.environ.get(name)
    if value is None:
        return default
    n = int(value) if value.isdigit() else -1
    if n < 0 or not valid(n):
        raise ValueError(f"{name}={value!r}: set it to {want}")
    return n


def _wide_packed_from_env() -> int | None:
    bound = _env_count("MINITE_WIDE_PACKED_MAX_M", DEFAULT_WIDE_PACKED_MAX_M, lambda n: True, "a row count (0: off)")
    return bound or None


WIDE_PACKED_MAX_M = _wide_packed_from_env()


def _swap_bound_from_env() -> int:
    default = INTERPRETER_SWAP_MAX_M if interpreting() else DEFAULT_SWAP_MAX_M
    return _env_count("MINITE_SWAP_MAX_M", default, lambda n: n >= 1, "a row count >= 1")


SWAP_MAX_M = _swap_bound_from_env()
DECODED_TILE = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)
CONFIG_OVERRIDE: dict | None = None  # bench/gemm.py only: try other fixed configs
# The wide tiles' fp16 operands written by the kernels that quantized them (`NVFP4Tensor.decoded`); bench only:
# False decodes them in the GEMM at every call again (the same bits), for bench/learner.py's comparison
OPERANDS_DECODED_ONCE = True


def decodes_activation(m: int) -> bool:
    """Whether a GEMM of m activation rows reads the activation decoded (the wide tiles on decoded operands,
    or the swapped ones with DECODE_X_MIN_M): a function of M only, so the op that quantizes an activation
    can write its decoded form with the codes (`NVFP4Tensor.decoded`) and spare the GEMM a decode launch."""
    cfg = gemm_config(m, FP4_BLOCK_K, FP4_BLOCK_K, True)
    return OPERANDS_DECODED_ONCE and m > 0 and bool(cfg["DECODED"] or cfg["A_DECODED"])


def fp4_block_k() -> int:
    """The BLOCK_K of every W4A4 config here: FP4_BLOCK_K on the GPU, 64 under the interpreter (the CPU tests'
    smaller tiles, `_tile_config`); also the step of a weight's `decoded` form that the GEMM reads."""
    return 64 if interpreting() else FP4_BLOCK_K


def swap_block_m(m: int) -> int:
    """The swapped tile's BLOCK_M for M rows: 16, 32, 64 or 128, the narrowest power of two >= M (more rows, up to
    SWAP_MAX_M: tiles of SWAP_TILE_MAX rows)."""
    return min(SWAP_TILE_MAX, max(16, next_pow2(max(m, 1))))


# K chunks: the K loop is cut into S chunks of equal step count, S from (N, K) alone (`k_chunks`). Within a
# chunk the MMA chain accumulates from zero; chunk sums are added in chunk order. S > 1 only where the
# swapped tiles of N would leave the GPU short of programs: S is the smallest power of two with
# cdiv(N, CHUNK_TILE_N) * S >= CHUNK_TARGET_PROGRAMS, at most MAX_CHUNKS (below), and dividing the step count
# cdiv(K, BLOCK_K).
CHUNK_TARGET_PROGRAMS = 2 * 132  # two programs per H200 SM (a constant: the bits must not depend on the GPU)
CHUNK_TILE_N = 64  # the swapped tiles' BLOCK_N
SPLIT_K = True  # bench/gemm.py only: False runs the chunk walk in one program for every M (same bits)
# Split chunks are added by the tile's last program to finish (an arrival counter per tile: no second launch);
# False: by `_combine_kernel` (the same additions; bench/gemm.py compares the two)
COMBINE_IN_KERNEL = True
CHUNKS_OVERRIDE: int | None = None  # bench/gemm.py only: time another S (other bits, the same for every M)
# S is capped at MAX_CHUNKS for every (N, K), M and engine. DEFAULT_MAX_CHUNKS = 4: on an H100 the 0.6B decode
# layer at M = 64 took 45 us at S <= 4 against 59 us at S = 8 / 16 (the 1.7B one 73 against 92), the rollout
# 1.06x / 0.91x its own BF16 at b16 / b64 against 0.88x / 0.71x, while the learner's step did not move
# (0.281 s at S <= 4, 0.289 uncapped, 0.280 at S = 1; docs/benchmarks.md, 2026-12-06). Chunks past 4 bought
# programs whose fp32 partials (written, then added by each tile's last program) cost more than they gained.
# MINITE_MAX_K_CHUNKS (a power of two, read at import) sets another cap: other bits than the default's, the
# same in the rollout and the learner (both import this module); the device benchmarks use it to time the trade.
DEFAULT_MAX_CHUNKS = 4


def _max_chunks_from_env() -> int:
    return _env_count("MINITE_MAX_K_CHUNKS", DEFAULT_MAX_CHUNKS, lambda n: n >= 1 and not n & (n - 1),
                      "a power of two (1, 2, 4, ...)")


MAX_CHUNKS = _max_chunks_from_env()


def k_chunks(n: int, k: int) -> int:
    """S, the number of K chunks for an (N, K) weight: a function of (N, K) only, never of M."""
    if CHUNKS_OVERRIDE is not None:
        return CHUNKS_OVERRIDE
    if interpreting():  # small shapes: 8 programs, BLOCK_N = 32, BLOCK_K = 64, so the tests get S = 1, 2, 4
        target, tile_n, block_k = 8, 32, 64
    else:
        target, tile_n, block_k = CHUNK_TARGET_PROGRAMS, CHUNK_TILE_N, FP4_BLOCK_K
    steps = cdiv(max(k, 1), block_k)
    s = 1
    while cdiv(n, tile_n) * s < target and steps % (2 * s) == 0 and 2 * s <= MAX_CHUNKS:
        s *= 2
    return s


_CONFIGS: dict = {}  # gemm_config's results, by its arguments and the module settings it reads


def gemm_config(m: int, n: int, k: int, fp4: bool) -> dict:
    """The tile configuration for (M, N, K). BLOCK_K and CHUNKS (the K chunks), and with them the
    reduction order, depend on (N, K) only; BLOCK_M, BLOCK_N, warps, stages, SWAP_AB and SPLIT (chunks in
    separate programs + a combine kernel, or walked in one program) may depend on M. Memoized (a fresh dict
    each call): it runs for every weight of every linear call, and computing it took ~25 µs of host time
    (`triton.cdiv` was a ~2 µs call), which a host-bound learner forward pays. The key holds every setting it
    reads, so the benchmarks and tests that change one get the configs of the new value."""
    key = (m, n, k, fp4, interpreting(), SMALL_M_TILES, SMALL_M_PLAIN, SWAP_MAX_M, SWAP_TILE_MAX, DECODE_WIDE,
           DECODE_X_MIN_M, SPLIT_K, CHUNKS_OVERRIDE, MAX_CHUNKS, id(CONFIG_OVERRIDE), id(DECODED_TILE))
    cfg = _CONFIGS.get(key)
    if cfg is None:
        if len(_CONFIGS) > 4096:  # (row counts vary from batch to batch: keep it bounded)
            _CONFIGS.clear()
        cfg = _CONFIGS[key] = _gemm_config(m, n, k, fp4)
    return dict(cfg)


def _gemm_config(m: int, n: int, k: int, fp4: bool) -> dict:
    cfg = _tile_config(m, n, k, fp4)
    if fp4:
        chunks = k_chunks(n, k)
        cfg = dict(cfg, CHUNKS=chunks, SPLIT=bool(SPLIT_K and chunks > 1 and cfg["SWAP_AB"]))
        cfg.setdefault("DECODED", False)
        cfg["A_DECODED"] = bool(cfg["SWAP_AB"] and DECODE_X_MIN_M is not None and m >= DECODE_X_MIN_M)
        if chunks > 1 and not cfg["SWAP_AB"] and cfg["BLOCK_N"] > 128 and not interpreting():
            cfg["BLOCK_N"] = 128  # the walk keeps a second accumulator: 128x256 would spill
    return cfg


def _tile_config(m: int, n: int, k: int, fp4: bool) -> dict:
    if interpreting():  # smaller tiles, same bucket structure as on the GPU, so the tests cross configs
        if fp4:
            if m <= SWAP_MAX_M:
                return dict(BLOCK_M=swap_block_m(m), BLOCK_N=32, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=1, SWAP_AB=True)
            return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=1, SWAP_AB=False,
                        DECODED=DECODE_WIDE)
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1,
                    SWAP_AB=SMALL_M_PLAIN and m <= SWAP_MAX_M)
    if fp4 and CONFIG_OVERRIDE:
        return dict(dict(SWAP_AB=False, GROUP_M=8), **CONFIG_OVERRIDE, BLOCK_K=FP4_BLOCK_K)
    if fp4:
        if SMALL_M_TILES and m <= SWAP_MAX_M:
            bm = swap_block_m(m)
            return dict(BLOCK_M=bm, BLOCK_K=FP4_BLOCK_K, GROUP_M=8, SWAP_AB=True, **SWAP_CONFIGS[bm])
        if DECODE_WIDE:
            return dict(DECODED_TILE, BLOCK_K=FP4_BLOCK_K, SWAP_AB=False, DECODED=True)
        # 128x256 tiles for wide layers; 128x128 when N is small, so more programs fill the GPU
        return dict(BLOCK_M=128, BLOCK_N=256 if n >= 4096 else 128, BLOCK_K=FP4_BLOCK_K, GROUP_M=8, num_warps=8,
                    num_stages=3, SWAP_AB=False)
    if SMALL_M_PLAIN and m <= SWAP_MAX_M:  # decode: the weight streams through narrow swapped tiles
        bm = swap_block_m(m)
        return dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4 if bm <= 128 else 8, num_stages=4,
                    SWAP_AB=True)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SWAP_AB=False)


def _flat_gs(t: NVFP4Tensor):
    """t's global scale as the kernels read it (a pointer to one value or to one a row) and its row stride."""
    gs = t.global_scale
    if gs.dim() == 0:
        return gs, 0
    return (gs if gs.is_contiguous() else gs.reshape(-1).contiguous()), 1  # (the kernels step 1 a row)


MAX_SEGMENTS = 3  # weights per launch (q/k/v)


def gemm_triton(x, w, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias): both NVFP4Tensor, or both plain tensors of one float dtype."""
    return gemm_many_triton(x, [w], [bias], out_dtype)[0]


def gemm_many_triton(x, ws: list, biases: list, out_dtype: torch.dtype) -> list[torch.Tensor]:
    """[x @ w.T (+ b) for w, b in zip(ws, biases)], each [..., N_w] in `out_dtype` for x [..., K] (its rows
    are the M rows), with the bits of `gemm_triton(x, w, b)` for each weight, in as few launches as the weights
    allow: consecutive weights with the same tile config (the same K chunks, so the same reduction order) and
    bias presence, up to MAX_SEGMENTS of them, share one launch; each program still computes a tile of one
    weight. A decode step's q/k/v (or gate/up) projections take one launch instead of three (two), and an
    activation decoded for the wide tiles is decoded once for all of them."""
    fp4 = isinstance(ws[0], NVFP4Tensor)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    x = _evenly_strided_rows(x)
    if fp4:
        check_decode(x.data.device, x, *ws)
    m = math.prod(lead)
    outs = [torch.empty(lead + (w.shape[0],), dtype=out_dtype, device=x.device) for w in ws]
    if m == 0:
        return outs
    cfgs = [gemm_config(m, w.shape[0], k, fp4) for w in ws]
    if fp4 and WIDE_PACKED_MAX_M is not None and m <= WIDE_PACKED_MAX_M:
        cfgs = [_weight_packed(c, w) for c, w in zip(cfgs, ws)]
    launches = launch_groups(cfgs, ws, biases)
    xd = None
    if fp4 and (cfgs[0].get("DECODED") or cfgs[0].get("A_DECODED")):  # the decoded activation, shared by every launch
        bk = cfgs[0]["BLOCK_K"]  # (the producer's, when it wrote one: `NVFP4Tensor.decoded`)
        xd = _decoded(x, bk)
    for idx in launches:
        segs = [(ws[i], biases[i], outs[i]) for i in idx if ws[i].shape[0]]
        if segs:
            _launch(x, xd, segs, cfgs[idx[0]], fp4)
    return outs


def _evenly_strided_rows(x):
    """x [..., K] (a float tensor or an NVFP4Tensor) as the kernels read its rows, row r at r * stride(-2): x
    itself when 2-D or when its parts are contiguous (a model's [B, T, K] activations: no reshape a call), else
    its [rows, K] form."""
    if len(x.shape) == 2:
        return x
    parts = (x.data, x.scale, x.global_scale) if isinstance(x, NVFP4Tensor) else (x,)
    if len(x.shape) > 2 and all(p.is_contiguous() for p in parts):
        return x
    return x.rows() if isinstance(x, NVFP4Tensor) else x.reshape(-1, x.shape[-1])


def _weight_packed(cfg: dict, w: NVFP4Tensor) -> dict:
    """A wide decoded-operand config for a weight without its decoded form -> the tile that decodes the weight
    itself from its packed bytes (A_DECODED: the activation still decoded); any other config as it is."""
    if cfg.get("DECODED") and not _carries_decoded(w, cfg["BLOCK_K"]):
        return dict(cfg, DECODED=False, A_DECODED=True)
    return cfg


def _carries_decoded(t: NVFP4Tensor, block_k: int) -> bool:
    """Whether t carries its decoded form (`NVFP4Tensor.decoded`) in the layout of a tile of this BLOCK_K."""
    return t.decoded is not None and block_k == fp4_block_k()


def _decoded(t: NVFP4Tensor, block_k: int) -> torch.Tensor:
    """t's decoded form for a tile of this BLOCK_K: the one it carries, else decoded now (one launch)."""
    return t.decoded if _carries_decoded(t, block_k) else decode_nvfp4(t, block_k)


def launch_groups(cfgs: list, ws: list, biases: list) -> list[range]:
    """The weights (by index) that share a launch: consecutive ones, at most MAX_SEGMENTS, with one tile
    config, one row layout and all or none with a bias."""
    out, i = [], 0
    while i < len(ws):
        j = i + 1
        while (j < len(ws) and j - i < MAX_SEGMENTS and cfgs[j] == cfgs[i] and _layout(ws[j]) == _layout(ws[i])
               and (biases[j] is None) == (biases[i] is None)):
            j += 1
        out.append(range(i, j))
        i = j
    return out


def _layout(w) -> tuple:
    """What weights sharing a launch must have in common besides the config: dtype and row strides."""
    if isinstance(w, NVFP4Tensor):
        return w.data.stride(), w.scale.stride()
    return w.dtype, w.stride()


def _launch(x, xd, segs: list, cfg: dict, fp4: bool):
    """One launch over up to three (w, bias, out) of one config (and, for split K chunks with
    COMBINE_IN_KERNEL off, the combine kernel's); returns the GEMM kernel's compiled handle
    (bench/gemm_probe.py reads its registers and SASS)."""
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    cfg = dict(cfg)
    cfg.setdefault("SWAP_AB", False)
    chunks = cfg.pop("CHUNKS", 1)
    split = cfg.pop("SPLIT", False)
    decoded = cfg.pop("DECODED", False)
    a_decoded = cfg.pop("A_DECODED", False)
    bk, bn = cfg["BLOCK_K"], cfg["BLOCK_N"]
    chunk_k = chunk_elements(k, chunks, bk)
    has_bias = segs[0][1] is not None
    seg_args = []  # per weight: data, scale bytes, global scale, its stride, bias, out, N
    for w, bias, c in segs:
        bias_arg = bias if has_bias else c
        if fp4:
            bgs, s_bgs = _flat_gs(w)
            if decoded:  # the weight's own decoded form when its version carries one (the learner's weights)
                wd = _decoded(w, bk)
                seg_args.append((wd, wd, bgs, s_bgs, bias_arg, c, w.shape[0]))
            else:
                seg_args.append((w.data, w.scale.view(torch.uint8), bgs, s_bgs, bias_arg, c, w.shape[0]))
        else:
            seg_args.append((w, w, w, 0, bias_arg, c, w.shape[0]))
    b0 = seg_args[0][0]
    if fp4:
        ags, s_ags = _flat_gs(x)
        if decoded:
            a_args, strides = (xd, xd, ags), (xd.stride(0), 0, s_ags, b0.stride(0), 0)
        elif a_decoded:
            a_args, strides = (xd, xd, ags), (xd.stride(0), 0, s_ags, b0.stride(0), segs[0][0].scale.stride(0))
        else:
            a_args = (x.data, x.scale.view(torch.uint8), ags)
            strides = (x.data.stride(-2), x.scale.stride(-2), s_ags, b0.stride(0), segs[0][0].scale.stride(0))
    else:
        a_args, strides = (x, x, x), (x.stride(-2), 0, 0, b0.stride(0), 0)
    ns = [a[6] for a in seg_args]
    n_total = sum(ns)
    t1, t2, grid_n = _tile_bounds(ns, bn)
    padded = seg_args + [seg_args[0]] * (MAX_SEGMENTS - len(seg_args))  # unused slots (NSEG tells)
    flat = [v for a in padded for v in a]
    # split: chunk partials [S, M, n_total] fp32 (torch.empty: no sync, graph-capturable), then the tile's last
    # program (COMBINE_IN_KERNEL) or the combine kernel adds them
    tiles = cdiv(m, cfg["BLOCK_M"]) * grid_n
    part = torch.empty(chunks, m, n_total, dtype=torch.float32, device=x.device) if split else segs[0][2]
    fixup = split and COMBINE_IN_KERNEL
    counters = tile_counters(x.device, tiles) if fixup else part
    kernel = _gemm_kernel[(tiles, chunks if split else 1)](
        *a_args, *flat, part, counters, m, k, chunk_k, n_total, t1, t2, grid_n, *strides,
        FP4=fp4, DOT_FP32=not fp4 and x.dtype == torch.float32, DOT_BY_SUM=interpreting() and not fp4,
        EVEN_K=k % bk == 0, HAS_BIAS=has_bias, CHUNKED=walk_mode(k, chunks, bk), SPLIT=split, DECODED=decoded, A_DECODED=a_decoded,
        NSEG=len(segs), FIXUP=fixup, **cfg, **pdl.launch(x.device),
    )
    if split and not fixup:
        cbm, cbn = (16, 32) if interpreting() else (32, 128)
        c1, c2, cgrid_n = _tile_bounds(ns, cbn)
        comb = [v for (_, _, bgs, s_bgs, bias_arg, c, n) in padded for v in (bgs, s_bgs, bias_arg, c, n)]
        _combine_kernel[(cdiv(m, cbm), cgrid_n)](
            part, a_args[2], m, chunks, m * n_total, n_total, strides[2], *comb, c1, c2,
            HAS_BIAS=has_bias, NSEG=len(segs), BLOCK_M=cbm, BLOCK_N=cbn, num_warps=4,
        )
    return kernel


_COUNTERS: dict = {}  # (device, stream) -> the counter buffers, newest last (older ones kept alive)


# Chunks of at least this many K steps are walked by a loop over chunks around a loop over steps (`w4a4_tile`'s
# CHUNKED = 3); shorter ones by one loop with selects (1), or, one step long, without (2). Same bits.
LONG_CHUNK_STEPS = 8
WALK_OVERRIDE: int | None = None  # bench/gemm.py only: 1 times the select walk for every chunk length (same bits)


def chunk_elements(k: int, chunks: int, block_k: int) -> int:
    """K elements per chunk when K is cut into `chunks` chunks of whole BLOCK_K steps (the last may end at K)."""
    return cdiv(cdiv(k, block_k), chunks) * block_k


def walk_mode(k: int, chunks: int, block_k: int) -> int:
    """`w4a4_tile`'s CHUNKED for K cut into S = `chunks` chunks: 0 for one chunk, 2 when every chunk is one
    BLOCK_K step, 3 for chunks of LONG_CHUNK_STEPS steps or more, else 1."""
    if chunks == 1:
        return 0
    if WALK_OVERRIDE is not None:
        return WALK_OVERRIDE
    steps = chunk_elements(k, chunks, block_k) // block_k
    return 2 if steps == 1 else 3 if steps >= LONG_CHUNK_STEPS else 1


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 [>= n] zeros: the split launches' per-tile arrival counters. A launch's last program of a tile
    resets its counter, so the buffer is all zeros between launches; launches on one stream run one after
    another, so each (device, stream) has its own buffer. A launch that needs more counters gets a larger
    buffer; the smaller ones are never freed, because a captured CUDA graph may still address them."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    bufs = _COUNTERS.setdefault((device, stream), [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return bufs[-1]


def _tile_bounds(ns: list, block_n: int) -> tuple[int, int, int]:
    """Tile columns of weights of widths `ns` laid side by side, each starting a new tile -> (first tile
    of weight 1, first tile of weight 2, all tile columns); an absent weight starts past the end."""
    tiles = [-(-n // block_n) for n in ns]
    total = sum(tiles)
    t1 = tiles[0] if len(ns) > 1 else total
    t2 = tiles[0] + tiles[1] if len(ns) > 2 else total
    return t1, t2, total
