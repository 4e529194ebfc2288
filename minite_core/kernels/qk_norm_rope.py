"""Qwen3's attention inputs in one kernel: q/k RMSNorm per head, NeoX RoPE, and (decode) the KV-cache write.

Between the q/k/v projections and attention, Qwen3 normalizes every head of q and k (RMSNorm over head_dim
with the q_norm / k_norm weights), rotates them (RoPE), and a decode step writes the new keys and values
into the cache: six launches as separate ops. `_qk_norm_rope_kernel` does it in one, a program per token,
with the row kernels' own arithmetic (`kernels.rows`): `rms_rstd` over each whole head row (the norm
kernel's sum of squares), `rms_scale` on each half of the row, `rope_rotate` on the normalized halves,
`round_to` for every rounding. Elementwise but for the per-row sum, so batch-invariant and decode ==
prefill. Under the interpreter it gives the bits of the norm and rope kernels in sequence; on the GPU the
sum of squares sits in another kernel's register layout and may take another order (both engines run
this kernel, so rollout == learner either way). Training (no cache): `QKNormRopeFunction`, whose backward
runs the RoPE and RMSNorm backward kernels with the rstd the forward wrote.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .gemm import next_pow2
from .rows import _unit_last, rms_norm_backward, rms_rstd, rms_scale, rope_apply, rope_rotate, round_to


@triton.jit
def _norm_rope_heads(X, sxt, tok, H, W, RSTD, c1, c2, s1, s2, nf, eps,
                     BLOCK_H: tl.constexpr, D: tl.constexpr, YDT: tl.constexpr):
    """Token `tok`'s H heads (rows of D in X [tokens, H * D], token stride sxt): the RMSNorm of each head
    (the norm kernel's `rms_rstd` on the whole row, then `rms_scale` on each half), then RoPE on the
    normalized values -> (normalized halves y1, y2, rotated halves o1, o2), [BLOCK_H, D/2] in YDT. Writes
    each head's rstd to RSTD [tokens * H] (the backward's)."""
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads[:, None] < H
    d = tl.arange(0, D)
    hd = tl.arange(0, D // 2)
    row = X + tok * sxt + heads[:, None] * D
    rstd = rms_rstd(tl.load(row + d[None, :], mask=h_ok, other=0.0).to(tl.float32), nf, eps)
    tl.store(RSTD + tok * H + heads, rstd, mask=heads < H)
    x1 = tl.load(row + hd[None, :], mask=h_ok, other=0.0).to(tl.float32)
    x2 = tl.load(row + D // 2 + hd[None, :], mask=h_ok, other=0.0).to(tl.float32)
    y1 = rms_scale(x1, rstd, tl.load(W + hd), X.dtype.element_ty, YDT)
    y2 = rms_scale(x2, rstd, tl.load(W + D // 2 + hd), X.dtype.element_ty, YDT)
    o1, o2 = rope_rotate(y1.to(tl.float32), y2.to(tl.float32), c1, c2, s1, s2, False)
    return y1, y2, round_to(o1, YDT), round_to(o2, YDT)


@triton.jit
def _store_heads(P, s_row, s_head, s_col, row, col, H, lo, hi, BLOCK_H: tl.constexpr, D: tl.constexpr):
    """Halves lo, hi [BLOCK_H, D/2] of H heads to P + row * s_row + head * s_head + col * s_col."""
    heads = tl.arange(0, BLOCK_H)
    hd = tl.arange(0, D // 2)
    p = P + row * s_row + heads[:, None] * s_head + col * s_col + hd[None, :]
    tl.store(p, lo, mask=heads[:, None] < H)
    tl.store(p + D // 2, hi, mask=heads[:, None] < H)


@triton.jit
def _qk_norm_rope_kernel(Q, K, V, WQ, WK, C, S, QO, KO, VO, QN, KN, RQ, RK, SLOT, POS,
                         T, HQ, HKV, sq, sk, sv, scb, sct, ssb, sst, skr, skh, skc, svr, svh, svc, nf, eps,
                         BLOCK_H: tl.constexpr, D: tl.constexpr, TO_CACHE: tl.constexpr, NORM_OUT: tl.constexpr,
                         PDL: tl.constexpr):
    """One program per token: q and k RMSNorm per head + RoPE; q to QO [tokens, HQ, D]; k to KO, which is
    a [B, T, HKV, D] buffer (row b, column t) or, TO_CACHE, the KV cache [slots, HKV, capacity, D] (row
    SLOT[b], column POS[b, t]), where v is copied as well. NORM_OUT: the normalized q, k to QN, KN."""
    if PDL:  # first: before any global memory access (kernels/pdl.py)
        pdl.prologue()
    tok = tl.program_id(0).to(tl.int64)
    b = tok // T
    t = tok % T
    hd = tl.arange(0, D // 2)
    c1 = tl.load(C + b * scb + t * sct + hd).to(tl.float32)[None, :]
    c2 = tl.load(C + b * scb + t * sct + D // 2 + hd).to(tl.float32)[None, :]
    s1 = tl.load(S + b * ssb + t * sst + hd).to(tl.float32)[None, :]
    s2 = tl.load(S + b * ssb + t * sst + D // 2 + hd).to(tl.float32)[None, :]
    y1, y2, o1, o2 = _norm_rope_heads(Q, sq, tok, HQ, WQ, RQ, c1, c2, s1, s2, nf, eps, BLOCK_H, D, QO.dtype.element_ty)
    _store_heads(QO, HQ * D, D, 0, tok, 0, HQ, o1, o2, BLOCK_H, D)
    if NORM_OUT:
        _store_heads(QN, HQ * D, D, 0, tok, 0, HQ, y1, y2, BLOCK_H, D)
    y1, y2, o1, o2 = _norm_rope_heads(K, sk, tok, HKV, WK, RK, c1, c2, s1, s2, nf, eps, BLOCK_H, D, QO.dtype.element_ty)
    if NORM_OUT:
        _store_heads(KN, HKV * D, D, 0, tok, 0, HKV, y1, y2, BLOCK_H, D)
    if TO_CACHE:
        row = tl.load(SLOT + b).to(tl.int64)
        col = tl.load(POS + tok).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        v = tl.load(V + tok * sv + heads[:, None] * D + d[None, :], mask=heads[:, None] < HKV, other=0.0)
        tl.store(VO + row * svr + heads[:, None] * svh + col * svc + d[None, :], v, mask=heads[:, None] < HKV)
    else:
        row = b
        col = t
    _store_heads(KO, skr, skh, skc, row, col, HKV, o1, o2, BLOCK_H, D)


def _heads_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] with each token's H * D values contiguous (a projection's output seen per head)."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1] or x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()
    return x


def qk_norm_rope_forward(q, k, v, wq, wk, eps: float, cos, sin, cache=None, norm_out: bool = False):
    """q [B, T, HQ, D], k and v [B, T, HKV, D] -> (q', k', q_norm, k_norm, rstd_q, rstd_k): q' = RoPE(RMSNorm(q))
    as a [B, HQ, T, D] view of a [B, T, HQ, D] buffer, k' likewise, or None with `cache` = (k_cache, v_cache
    [slots, HKV, capacity, D], slots [B], positions [B, T]): k' and v written to the cache rows at the
    positions. q_norm, k_norm: the normalized q, k [B, T, H, D] with `norm_out`, else None. One kernel."""
    q, k, v = _heads_rows(q), _heads_rows(k), _heads_rows(v)
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    ydt = torch.promote_types(q.dtype, wq.dtype)
    qo = torch.empty(b, t, hq, d, dtype=ydt, device=q.device)
    rq = torch.empty(b * t * hq, dtype=torch.float32, device=q.device)
    rk = torch.empty(b * t * hkv, dtype=torch.float32, device=q.device)
    qn = torch.empty_like(qo) if norm_out else qo
    kn = torch.empty(b, t, hkv, d, dtype=ydt, device=q.device) if norm_out else qo
    cos, sin = (_unit_last(c).expand(b, 1, t, d) for c in (cos, sin))
    if cache is None:
        ko = torch.empty(b, t, hkv, d, dtype=ydt, device=q.device)
        vo, slots, pos = ko, rq, rq  # (not read)
        kstr, vstr = (ko.stride(0), ko.stride(2), ko.stride(1)), (0, 0, 0)
    else:
        ko, vo, slots, pos = cache
        if ko.dtype != ydt or vo.dtype != v.dtype:
            raise ValueError(f"the KV cache holds {ko.dtype}, the keys are {ydt}: store them in the model dtype")
        pos = pos.contiguous()
        kstr, vstr = (ko.stride(0), ko.stride(1), ko.stride(2)), (vo.stride(0), vo.stride(1), vo.stride(2))
    if q.numel() and k.numel():
        _qk_norm_rope_kernel[(b * t,)](
            q, k, v, wq.contiguous(), wk.contiguous(), cos, sin, qo, ko, vo, qn, kn, rq, rk, slots, pos,
            t, hq, hkv, q.stride(1), k.stride(1), v.stride(1), cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2),
            *kstr, *vstr, float(d), float(eps),
            BLOCK_H=next_pow2(max(hq, hkv)), D=d, TO_CACHE=cache is not None, NORM_OUT=norm_out, num_warps=4,
            enable_fp_fusion=False, **pdl.launch(q.device))  # (`rows.rms_rstd`: no FMA contraction)
    return (qo.transpose(1, 2), None if cache is not None else ko.transpose(1, 2),
            qn if norm_out else None, kn if norm_out else None, rq, rk)


class QKNormRopeFunction(torch.autograd.Function):
    """RoPE(RMSNorm(q)), RoPE(RMSNorm(k)) in one kernel (no cache: training and prefill); the backward runs
    the RoPE and RMSNorm backward kernels. Returns (q', k', q_norm, k_norm); the last two (captures, with
    `norm_out`) carry no gradient."""

    @staticmethod
    def forward(ctx, q, k, wq, wk, eps, cos, sin, norm_out):
        qo, ko, qn, kn, rq, rk = qk_norm_rope_forward(q, k, k, wq, wk, eps, cos, sin, norm_out=norm_out)
        ctx.save_for_backward(q, k, wq, wk, cos, sin, rq, rk)
        extra = [z for z in (qn, kn) if z is not None]
        ctx.mark_non_differentiable(*extra)
        return (qo, ko, *extra)

    @staticmethod
    def backward(ctx, gq, gk, *_):
        q, k, wq, wk, cos, sin, rq, rk = ctx.saved_tensors
        grads = []
        for x, w, rstd, g, need_w in ((q, wq, rq, gq, ctx.needs_input_grad[2]), (k, wk, rk, gk, ctx.needs_input_grad[3])):
            gn = rope_apply(g, cos, sin, backward=True).transpose(1, 2)  # [B, T, H, D]
            d = x.shape[-1]
            dx, dw = rms_norm_backward(gn.reshape(-1, d), x.reshape(-1, d), w, rstd, need_w)
            grads.append((dx.view(x.shape), dw))
        (dq, dwq), (dk, dwk) = grads
        return dq, dk, dwq, dwk, None, None, None, None
