"""Causal GQA attention (Triton) with one reduction order for prefill, training and decode.

One kernel serves all three. A program owns BLOCK_M query rows of one (batch, query head) and walks the
keys from 0 in fixed blocks of BLOCK_N, with an online softmax (running max m, running sum l, running
output acc, all fp32): per block, s = q k^T * scale (fp32 accumulation), keys after the query's position
or beyond the valid length masked to -inf, then m' = max(m, max s), p = exp(s - m'),
l = l * exp(m - m') + sum p, acc = acc * exp(m - m') + p v. The output is acc / l (fp32).

Why prefill == decode, bit for bit: a query at position p sees the same key blocks [0, BLOCK_N), ...
in the same order whether it sits in a prefill tile with other queries or alone in a decode step over a
KV cache of any capacity. The tile shape is fixed (a decode step pads its one query to BLOCK_M rows),
so every product and every per-row reduction is the same instruction on the same operands, and row r's
values never mix with other rows. A prefill tile may walk further than a given row needs (up to its
last row's position): for that row those blocks are fully masked, so m' = m, exp(m - m') = 1, p = 0, and
the update leaves l and acc exactly as they were. Keys at or beyond the valid length are loaded as
zeros, so stale cache contents never enter a sum.

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

from .gemm import interpreting


@triton.jit
def _attention_kernel(
    Q, K, V, O, QPOS, KVLEN,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, spb,
    scale, HQ, REP, TQ, TK,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_BY_SUM: tl.constexpr, IEEE: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    kvh = h // REP
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < TQ
    d = tl.arange(0, D)
    pos = tl.load(QPOS + b * spb + rows, mask=row_ok, other=-1)
    kv_len = tl.minimum(tl.load(KVLEN + b), TK)  # never read past the cache, whatever the caller says
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqt + d[None, :], mask=row_ok[:, None], other=0.0)
    hi = tl.minimum(tl.max(pos, axis=0) + 1, kv_len)  # keys this tile needs: up to its last query's position

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_len
        k = tl.load(K + b * skb + kvh * skh + cols[:, None] * skt + d[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(V + b * svb + kvh * svh + cols[:, None] * svt + d[None, :], mask=col_ok[:, None], other=0.0)
        if DOT_BY_SUM:
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        elif IEEE:  # fp32 operands: full fp32 products, not TF32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        valid = (cols[None, :] <= pos[:, None]) & col_ok[None, :]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no valid key yet (padding rows)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_BY_SUM:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(O + b * sob + h * soh + rows[:, None] * sot + d[None, :], out, mask=row_ok[:, None])


def attention_config() -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): fixed, the same for every call (prefill, decode, any batch)."""
    return (16, 16) if interpreting() else (64, 64)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] (a cache may be longer than kv_len), q_pos [B, Tq], kv_len [B] -> fp32 [B, Hq, Tq, D]."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if d & (d - 1) or d < 16:
        raise ValueError(f"the Triton attention needs a power-of-two head_dim >= 16, got {d}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    q_pos = q_pos.to(torch.int32).contiguous()
    kv_len = kv_len.to(torch.int32).contiguous()
    out = torch.empty(b, hq, tq, d, device=q.device, dtype=torch.float32)
    bm, bn = attention_config()
    grid = (b * hq, triton.cdiv(tq, bm))
    _attention_kernel[grid](
        q, k, v, out, q_pos, kv_len,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), q_pos.stride(0),
        float(scale), hq, hq // hkv, tq, tk,
        D=d, BLOCK_M=bm, BLOCK_N=bn, DOT_BY_SUM=interpreting(), IEEE=q.dtype == torch.float32,
        num_warps=4,
    )
    return out


class AttentionFunction(torch.autograd.Function):
    """Forward: the Triton kernel. Backward: the gradient of the same attention through torch SDPA."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, kv_len, scale):
        ctx.save_for_backward(q, k, v, q_pos, kv_len)
        ctx.scale = scale
        return attention_forward(q, k, v, q_pos, kv_len, scale)

    @staticmethod
    def backward(ctx, grad_out):
        from ..ops import sdpa_attention

        q, k, v, q_pos, kv_len = ctx.saved_tensors
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = sdpa_attention(qd, kd, vd, q_pos, kv_len, scale=ctx.scale)
            gq, gk, gv = torch.autograd.grad(out, (qd, kd, vd), grad_out)
        return gq, gk, gv, None, None, None
