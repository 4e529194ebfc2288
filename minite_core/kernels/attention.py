"""Causal GQA attention (Triton) with one reduction order for prefill, training and decode.

Every query row reduces over its keys in the same fixed pieces, in the same order, with the same
floating-point operations, whatever the call (prefill, training forward, decode over a KV cache of any
capacity, any batch):

- Keys are cut into chunks of SPLIT_N keys, [0, SPLIT_N), [SPLIT_N, 2 SPLIT_N), ... (SPLIT_N a fixed
  multiple of BLOCK_N; `attention_config`), and each chunk into blocks of BLOCK_N keys.
- Chunk partial (m_c, l_c, acc_c), all fp32: an online softmax over the chunk's blocks in order, from
  (m, l, acc) = (-inf, 0, 0): s = q k^T * scale (fp32 accumulation), keys after the query's position or
  at/beyond the valid length masked to -inf, m' = max(m, max s), p = exp(s - m'), alpha = exp(m - m'),
  l' = fma(l, alpha, sum p), acc' = p v accumulated onto acc * alpha.
- Combine, chunk 0, 1, 2, ... left to right from the empty state (M, L, A) = (-inf, 0, 0):
  M' = max(M, m_c), a = exp(M - M'), c = exp(m_c - M'), L' = fma(l_c, c, L * a),
  A' = fma(acc_c, c, A * a); the first chunk is taken as is. The output is A / L (0 when L = 0).
- A block or a chunk in which a row has no valid key leaves that row's state exactly as it was (a
  select, not arithmetic: no -inf - -inf, no sign-of-zero change), so walking further than a row needs
  changes nothing for that row. A row's valid keys are a prefix [0, min(pos + 1, kv_len)), so every
  path sees the same non-empty blocks and chunks for it, in the same order.

One kernel (`_attention_kernel`) computes the chunk partials and combines them in registers; two
launch shapes use it:

- prefill (many query rows): grid (B * groups, query tiles, 1); a program walks all the chunks its tile
  needs and writes the normalized output.
- split (decode: a group's rows fit one tile): grid (B * groups, 1, cdiv(Tk, SPLIT_N)), groups below;
  program c computes chunk c only (programs past a row's keys write the empty state) and stores its
  (m, l, acc) in fp32 scratch; `_combine_kernel` then combines the chunks 0, 1, ... with the same
  `_combine` and `_finish`. fp32 scratch stores are exact, so the bits equal the prefill's. The number
  of chunks comes from the cache capacity (a shape), never from kv_len values: no host sync, so a decode
  step can be captured in a CUDA graph.

Tile rows: a program owns BLOCK_M rows of one (sequence, group). In a prefill a group is one query
head and its rows are query positions; in a decode step (one query per sequence) a group is the Hq/Hkv
query heads that share one KV head, packed as the tile's rows, so the K/V tiles are read once per KV
head. The tile shape, warps and dtypes are the same in every launch (a decode step pads its rows to
BLOCK_M), and a row's products and reductions are the same instructions on the same operands whichever
rows sit beside it: rows never mix. Keys at or beyond the valid length are loaded as zeros, so stale
cache contents never enter a sum. The kernels are compiled with fp fusion off (every mul and add rounds
on its own unless written as an explicit fma), so no compiler choice can differ between them; the sizes
that differ between prefill and decode are not value-specialized, so both run one binary of
`_attention_kernel`.

A decode step's output row of a sequence (its Hq heads at one position) is the o_proj input, which NVFP4
quantizes with a per-row global scale: its amax spans every head, so every program of the sequence (one per
KV head; in the split launch the combine's) holds only a part. With `quantize` the last of them to store its
part quantizes the row (`_quantize_when_last`: an arrival counter, as the GEMM's split tiles finish) with the
quantize kernel's own arithmetic on the stored bf16 values, so the bits of a quantize launch after the
attention, without that launch (NVFP4's only decode-step kernel that BF16 does not run).

The learner's backward recomputes the same attention with torch SDPA (the flash / memory-efficient
kernels) and differentiates that: only the forward must match the rollout, and the backward of a
mathematically identical function is as good a gradient as any.

Under TRITON_INTERPRET=1 the two products are elementwise multiply + tl.sum (the interpreter's bf16
dot is wrong, and its fp32 dot calls BLAS, whose per-row result depends on the row's place in the tile).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .gemm import cdiv, fp4_block_k, interpreting, last_to_arrive, next_pow2, tile_counters
from .quantize import ONE_TILE_MAX_K, decode_buffer, nvfp4_buffers, quantize_rows
from .rows import round_to

NUM_WARPS = 8  # the same for every launch of _attention_kernel (it fixes the tile's register layout); at 4 the
# two [BLOCK_M, D] fp32 accumulators spill on sm_90 (ptxas: 255 registers + 336 bytes of stack), at 8 they fit


def _helper(fn):
    """A device function inlined into both kernels; under the interpreter a plain Python function (the
    interpreter re-patches the language on every call of a jitted helper, which dominates its time)."""
    return fn if interpreting() else triton.jit(fn)


@_helper
def _combine(m, l, acc, mc, lc, accc):
    """Fold the chunk partial (mc, lc, accc) into the running (m, l, acc), per row. A chunk with no valid
    key (mc = -inf) leaves the state as it was; into the empty state (m = -inf) the chunk is taken as is."""
    skip = mc == float("-inf")
    take = m == float("-inf")
    m_new = tl.maximum(m, mc)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m - m_safe)
    c = tl.exp(mc - m_safe)
    l_new = tl.fma(lc, c, l * a)
    acc_new = tl.fma(accc, c[:, None], acc * a[:, None])
    m_out = tl.where(skip, m, m_new)
    l_out = tl.where(skip, l, tl.where(take, lc, l_new))
    acc_out = tl.where(skip[:, None], acc, tl.where(take[:, None], accc, acc_new))
    return m_out, l_out, acc_out


@_helper
def _finish(l, acc):
    """acc / l per row; 0 for a row with no valid key."""
    return tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)


@triton.jit
def _quantize_when_last(O, sob, b, CNT, arrivals, QN, QP, QS, QGS, QD, BLOCK_Q: tl.constexpr, DBK: tl.constexpr):
    """Sequence b's output row (its QN = Hq * D values at O + b * sob, which `arrivals` programs store in parts)
    quantized to NVFP4 by the last of them to finish (`gemm.last_to_arrive` on the sequence's counter, the GEMM's
    split-tile pattern), the row read back past L1 and `quantize_rows` on it: the values and the arithmetic of
    `quantize_triton` on the stored row, so its bits. The last program resets the counter to 0."""
    if last_to_arrive(CNT, b, arrivals):
        cols = tl.arange(0, BLOCK_Q)
        v = tl.load(O + b.to(tl.int64) * sob + cols[None, :], mask=(cols < QN)[None, :], other=0.0, cache_modifier=".cg")
        rows64 = b.to(tl.int64) + tl.arange(0, 1)
        quantize_rows(v.to(tl.float32), rows64, rows64 >= 0, QN, QP, QS, QGS, 1, BLOCK_Q, QD, DBK)
        tl.store(CNT + b, 0)


# Sizes that differ between prefill and decode (and the position tensor, whose stride is Tq) are not
# value-specialized, so both launches run one compiled binary. The remaining strides are multiples of
# head_dim either way.
@triton.jit(do_not_specialize=["QPOS", "KVLEN", "spb", "spr", "NGRP", "GPK", "ROWS", "TK", "NSPLIT", "CPS"])
def _attention_kernel(
    Q, K, V, O, MS, LS, ACCS, QPOS, KVLEN, KVROW, CNT, QP, QS, QGS, QD,
    sqb, sqg, sqr, skb, skh, skt, svb, svh, svt, sob, sog, sor, spb, spr,
    scale, NGRP, GPK, ROWS, TK, NSPLIT, CPS, QN,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr,
    DOT_BY_SUM: tl.constexpr, IEEE: tl.constexpr, HAS_KVROW: tl.constexpr, PDL: tl.constexpr,
    QUANT: tl.constexpr, BLOCK_Q: tl.constexpr, DBK: tl.constexpr,
):
    if PDL:  # first: before any global memory access (kernels/pdl.py)
        pdl.prologue()
    bg = tl.program_id(0)
    b = bg // NGRP
    kb = tl.load(KVROW + b).to(tl.int64) if HAS_KVROW else b  # the cache row (slot) of sequence b
    grp = bg % NGRP  # a query head (ROWS = its positions), or a KV head's query heads at one position
    kvh = grp // GPK
    tile = tl.cdiv(ROWS, BLOCK_M) - 1 - tl.program_id(1)  # latest positions (most keys) first
    split = tl.program_id(2)
    g = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = g < ROWS
    d = tl.arange(0, D)
    pos = tl.load(QPOS + b * spb + g * spr, mask=row_ok, other=-1)
    kv_len = tl.minimum(tl.load(KVLEN + b), TK)  # never read past the cache, whatever the caller says
    q = tl.load(Q + b * sqb + grp * sqg + g[:, None] * sqr + d[None, :], mask=row_ok[:, None], other=0.0)
    hi = tl.maximum(tl.minimum(tl.max(pos, axis=0) + 1, kv_len), 0)  # keys this tile needs
    c_lo = split * CPS
    c_hi = tl.minimum(c_lo + CPS, tl.cdiv(hi, SPLIT_N))  # this program's chunks: [c_lo, c_hi)
    end = tl.minimum(c_hi * SPLIT_N, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # the combined chunks
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    m_c = tl.full([BLOCK_M], float("-inf"), tl.float32)  # the current chunk
    l_c = tl.zeros([BLOCK_M], tl.float32)
    acc_c = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(c_lo * SPLIT_N, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_len
        k = tl.load(K + kb * skb + kvh * skh + cols[:, None] * skt + d[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(V + kb * svb + kvh * svh + cols[:, None] * svt + d[None, :], mask=col_ok[:, None], other=0.0)
        if DOT_BY_SUM:
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        elif IEEE:  # fp32 operands: full fp32 products, not TF32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        valid = (cols[None, :] <= pos[:, None]) & col_ok[None, :]
        s = tl.where(valid, s, float("-inf"))
        m_blk = tl.max(s, axis=1)
        m_new = tl.maximum(m_c, m_blk)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_c - m_safe)
        l_new = tl.fma(l_c, alpha, tl.sum(p, axis=1))
        if DOT_BY_SUM:
            acc_new = tl.fma(acc_c, alpha[:, None], tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1))
        elif IEEE:
            acc_new = tl.dot(p, v, acc_c * alpha[:, None], input_precision="ieee")
        else:
            acc_new = tl.dot(p.to(v.dtype), v, acc_c * alpha[:, None])
        skip = m_blk == float("-inf")  # no valid key in this block for the row: keep its state exactly
        m_c = tl.where(skip, m_c, m_new)
        l_c = tl.where(skip, l_c, l_new)
        acc_c = tl.where(skip[:, None], acc_c, acc_new)
        nxt = start + BLOCK_N
        if (nxt % SPLIT_N == 0) | (nxt >= end):  # the chunk ends here: fold it in, start the next one empty
            m_i, l_i, acc = _combine(m_i, l_i, acc, m_c, l_c, acc_c)
            m_c = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_c = tl.zeros([BLOCK_M], tl.float32)
            acc_c = tl.zeros([BLOCK_M, D], tl.float32)
    if NSPLIT == 1:
        out = round_to(_finish(l_i, acc), O.dtype.element_ty)
        tl.store(O + b * sob + grp * sog + g[:, None] * sor + d[None, :], out, mask=row_ok[:, None])
        if QUANT:  # (decode: a sequence's row is its NGRP groups' tiles)
            _quantize_when_last(O, sob, b, CNT, NGRP * tl.num_programs(1), QN, QP, QS, QGS, QD, BLOCK_Q, DBK)
    else:  # this program's chunk partial, exact in fp32; _combine_kernel folds the chunks in order
        r = (bg * NSPLIT + split) * ROWS + g
        tl.store(MS + r, m_i, mask=row_ok)
        tl.store(LS + r, l_i, mask=row_ok)
        tl.store(ACCS + r[:, None] * D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["NGRP", "ROWS", "NSPLIT"])
def _combine_kernel(
    O, MS, LS, ACCS, CNT, QP, QS, QGS, QD, sob, sog, sor, NGRP, ROWS, NSPLIT, QN,
    D: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr, BLOCK_Q: tl.constexpr,
    DBK: tl.constexpr,
):
    if PDL:  # first: before any global memory access (kernels/pdl.py)
        pdl.prologue()
    bg = tl.program_id(0)
    b = bg // NGRP
    grp = bg % NGRP
    g = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = g < ROWS
    d = tl.arange(0, D)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for c in range(0, NSPLIT):
        r = (bg * NSPLIT + c) * ROWS + g
        m_c = tl.load(MS + r, mask=row_ok, other=float("-inf"))
        l_c = tl.load(LS + r, mask=row_ok, other=0.0)
        acc_c = tl.load(ACCS + r[:, None] * D + d[None, :], mask=(row_ok & (m_c > float("-inf")))[:, None], other=0.0)
        m_i, l_i, acc = _combine(m_i, l_i, acc, m_c, l_c, acc_c)
    out = round_to(_finish(l_i, acc), O.dtype.element_ty)
    tl.store(O + b * sob + grp * sog + g[:, None] * sor + d[None, :], out, mask=row_ok[:, None])
    if QUANT:
        _quantize_when_last(O, sob, b, CNT, NGRP * tl.num_programs(1), QN, QP, QS, QGS, QD, BLOCK_Q, DBK)


def attention_config() -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT_N): fixed, the same for every call (prefill, decode, any batch). SPLIT_N,
    the keys per chunk, is a multiple of BLOCK_N; changing any of them changes the bits of every path
    alike (rollout and learner must run the same values)."""
    return (16, 8, 16) if interpreting() else (64, 64, 256)


# The software-pipelining depth (Triton's num_stages) of a decode step's launch; None: Triton's default, as the
# prefill's (one binary for both). Each stage holds a K and a V tile in shared memory, so fewer stages let more of
# a decode step's programs share an SM: at b256 (2,048 programs of one (sequence, KV head) each, a few key blocks
# apiece) the decode attention is latency-bound at ~40% of the KV bandwidth (docs/benchmarks.md, 2026-12-08).
# Pipelining reorders the loads, not the arithmetic: the same bits (tests/kernels/test_attention.py on the GPU);
# `bench/gpu_session.sh attn-stages` times it.
DECODE_STAGES: int | None = None

# Whether a decode step's attention kernel quantizes the o_proj input itself (`ops.attention(quantize=True)`);
# False: a quantize launch after it, the same bits (bench/gpu_session.sh attn-quant times both).
FUSE_QUANTIZE = True


def fuses_quantize(tq: int, hq: int, d: int, out_dtype: torch.dtype | None) -> bool:
    """Can `attention_forward` quantize its output in the kernel: a decode step (one query a sequence, so a
    sequence's output row, the o_proj input, is its Hq heads at one position), rounded to a model dtype, the
    row within one quantize tile (`quantize.ONE_TILE_MAX_K`)."""
    return FUSE_QUANTIZE and tq == 1 and out_dtype is not None and next_pow2(hq * d) <= ONE_TILE_MAX_K


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor,
                      scale: float, *, split: bool | None = None, kv_rows: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None, quantize: bool = False, decoded: bool = False):
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] (a cache may be longer than kv_len), q_pos [B, Tq], kv_len [B] -> fp32 [B, Hq, Tq, D].

    `out_dtype`: the output rounded once (to nearest even) to that dtype in the kernel, laid out as
    [B, Tq, Hq, D] and returned as its [B, Hq, Tq, D] view, so that the model's [B, Tq, Hq * D] is a view
    (no cast, no transposed copy).

    `kv_rows` [B]: k/v are a whole slot cache [S, Hkv, Tk, D] and sequence b reads its row kv_rows[b]
    (no gather of the cache rows; the values, and so the bits, are those of k[kv_rows]).

    `split`: None picks the split (decode) launch when there are fewer than 64 (sequence, KV head) groups
    (measured: faster at batch 1, slower than the tile launch at 16 and 64) and all Hq/Hkv * Tq query rows of a KV head fit one
    tile, the prefill launch otherwise; True / False force one. The bits are the same either way.

    `quantize` (a decode step, `fuses_quantize`): also the NVFP4 of each sequence's output row [Hq * D] with a
    per-row global scale, made by the kernel that stores the row's last part (`_quantize_when_last`): returns
    (out, (packed bytes [B, Hq*D/2], scale bytes [B, Hq*D/16], global scales [B])), plus the decoded form
    [B, Hq*D padded] with `decoded` -- the bits of `quantize_triton` on out's rows, one launch fewer."""
    b, hq, tq, d = q.shape
    if quantize and not fuses_quantize(tq, hq, d, out_dtype):
        raise ValueError(f"attention_forward(quantize=True) quantizes a decode step's output rows: one query a "
                         f"sequence (got {tq}), out_dtype set (got {out_dtype}), Hq * D <= {ONE_TILE_MAX_K} (got {hq * d})")
    hkv, tk = k.shape[1], k.shape[2]
    if kv_rows is not None:
        kv_rows = kv_rows.to(torch.int32).contiguous()
    if d & (d - 1) or d < 16:
        raise ValueError(f"the Triton attention needs a power-of-two head_dim >= 16, got {d}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    q_pos = q_pos.to(torch.int32).contiguous()
    kv_len = kv_len.to(torch.int32).contiguous()
    if out_dtype is None:
        out = torch.empty(b, hq, tq, d, device=q.device, dtype=torch.float32)
    else:
        out = torch.empty(b, tq, hq, d, device=q.device, dtype=out_dtype).transpose(1, 2)
    qn = hq * d
    if quantize:
        parts = nvfp4_buffers(b, qn, q.device) + ((decode_buffer(b, qn, q.device),) if decoded else ())
        qp, qs, qgs = parts[:3]
        qd, dbk = (parts[3], fp4_block_k()) if decoded else (qp, 1)
        cnt = tile_counters(q.device, b)
    else:
        qp = qs = qgs = qd = cnt = kv_len  # (not read)
        dbk = 1
    bq = next_pow2(qn) if quantize else 16
    if out.numel() == 0:
        return (out, parts) if quantize else out
    bm, bn, sn = attention_config()
    rep = hq // hkv
    if tq == 1:  # decode: a group is a KV head's `rep` query heads (rows), packed into one tile
        ngrp, gpk, rows = hkv, 1, rep
        sqg, sqr, sog, sor, spr = rep * q.stride(1), q.stride(1), rep * out.stride(1), out.stride(1), 0
    else:  # a group is one query head, its rows the query positions
        ngrp, gpk, rows = hq, rep, tq
        sqg, sqr, sog, sor, spr = q.stride(1), q.stride(2), out.stride(1), out.stride(2), q_pos.stride(1)
    tiles = cdiv(rows, bm)
    chunks = max(cdiv(tk, sn), 1)  # from the cache capacity: a shape, not kv_len's values
    if split is None:
        split = tiles == 1 and b * ngrp < 64  # few programs: split the keys; else the tile launch is faster (same bits)
    nsplit = chunks if split else 1
    if nsplit > 1:
        ms = torch.empty(b * ngrp * nsplit * rows, device=q.device, dtype=torch.float32)
        ls = torch.empty_like(ms)
        accs = torch.empty(b * ngrp * nsplit * rows * d, device=q.device, dtype=torch.float32)
        grid, cps = (b * ngrp, tiles, nsplit), 1
    else:
        ms = ls = accs = out  # not written
        grid, cps = (b * ngrp, tiles, 1), chunks
    _attention_kernel[grid](
        q, k, v, out, ms, ls, accs, q_pos, kv_len, kv_rows if kv_rows is not None else kv_len, cnt, qp, qs, qgs, qd,
        q.stride(0), sqg, sqr, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), sog, sor, q_pos.stride(0), spr,
        float(scale), ngrp, gpk, rows, tk, nsplit, cps, qn,
        D=d, BLOCK_M=bm, BLOCK_N=bn, SPLIT_N=sn, DOT_BY_SUM=interpreting(), IEEE=q.dtype == torch.float32,
        HAS_KVROW=kv_rows is not None, QUANT=quantize and nsplit == 1, BLOCK_Q=bq, DBK=dbk,
        num_warps=NUM_WARPS, enable_fp_fusion=False, **pdl.launch(q.device),
        **({"num_stages": DECODE_STAGES} if tq == 1 and DECODE_STAGES is not None else {}),
    )
    if nsplit > 1:
        br = 16
        _combine_kernel[(b * ngrp, cdiv(rows, br))](
            out, ms, ls, accs, cnt, qp, qs, qgs, qd, out.stride(0), sog, sor, ngrp, rows, nsplit, qn,
            D=d, BLOCK_R=br, QUANT=quantize, BLOCK_Q=bq, DBK=dbk,
            num_warps=4, enable_fp_fusion=False, **pdl.launch(q.device),
        )
    return (out, parts) if quantize else out


class AttentionFunction(torch.autograd.Function):
    """Forward: the Triton kernel. Backward: the gradient of the same attention through torch SDPA."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, kv_len, scale, out_dtype=None):
        ctx.save_for_backward(q, k, v, q_pos, kv_len)
        ctx.scale = scale
        return attention_forward(q, k, v, q_pos, kv_len, scale, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        from ..knobs import sdpa_attention

        q, k, v, q_pos, kv_len = ctx.saved_tensors
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = sdpa_attention(qd, kd, vd, q_pos, kv_len, scale=ctx.scale)
            gq, gk, gv = torch.autograd.grad(out, (qd, kd, vd), grad_out.to(out.dtype))
        return gq, gk, gv, None, None, None, None
