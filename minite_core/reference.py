"""The `torch` backend: batch-invariant GEMMs in plain PyTorch (CPU and GPU).

A library matmul is not batch-invariant: BLAS picks kernels, blockings and thread splits by the
shape, so row i of an M=64 product can differ in the last bits from the same row computed alone.
Here the reduction order over K is written out, so it cannot depend on M:

    out[m, n] = (((P_0 + P_1) + P_2) + ... + P_{K/16-1})          left to right, fp32
    P_b       = the sum of the 16 products of block b              (its order: see below)

NVFP4 operands (W4A4): each operand element is code * block_scale, exact in fp32, and the 16 products
of a block share both block scales: P_b = (integer <= 2304) * (integer <= 225) * 2^e / 4, which needs
at most 20 significant bits. So P_b is exact in fp32 whatever order a BLAS sums it in (with or
without FMA, and even under TF32), and we may compute all P_b with one batched matmul and then add
them in the fixed order above. The global scales multiply in the epilogue: (acc * gs_x) * gs_w.

Plain operands (bf16/fp32 weights): products are not exact, so P_b is a fixed pairwise tree of
elementwise products (p0+p8, p1+p9, ...; then halves again), written with elementwise ops only.

Both paths process rows in chunks to bound memory; a row's result never depends on the chunking.
"""
from __future__ import annotations

import torch

from .nvfp4 import BLOCK, NVFP4Tensor, dequantize_unscaled, div
from .reduce import tree_sum

_MAX_ELEMS = 1 << 24  # intermediate elements per chunk (64 MiB of fp32)
_CACHE_ELEMS = 1 << 17  # products of a group of blocks in mm_plain (0.5 MiB of fp32)


def _row_chunks(m: int, per_row: int):
    step = max(1, _MAX_ELEMS // max(per_row, 1))
    for lo in range(0, m, step):
        yield lo, min(m, lo + step)


def _sum_blocks_in_order(partials: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
    """acc + P_0 + P_1 + ... over dim 0 of partials [B, m, n], strictly left to right."""
    for b in range(partials.shape[0]):
        acc = partials[b].clone() if acc is None else acc + partials[b]
    return acc


def mm_nvfp4(x: NVFP4Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T for NVFP4 operands, fp32 [M, N], global scales applied."""
    xa, wa = dequantize_unscaled(x), dequantize_unscaled(w)
    m, k = xa.shape
    n = wa.shape[0]
    nb = k // BLOCK
    wb = wa.view(n, nb, BLOCK).permute(1, 2, 0)  # [nb, 16, N]
    out = xa.new_empty(m, n)
    blocks_per_step = max(1, _MAX_ELEMS // max(m * n, 1))
    for lo, hi in _row_chunks(m, n * min(nb, blocks_per_step)):
        xb = xa[lo:hi].view(hi - lo, nb, BLOCK).transpose(0, 1)  # [nb, rows, 16]
        acc = None
        for b0 in range(0, nb, blocks_per_step):
            b1 = min(nb, b0 + blocks_per_step)
            acc = _sum_blocks_in_order(torch.bmm(xb[b0:b1], wb[b0:b1]), acc)
        out[lo:hi] = acc
    gx = x.global_scale.reshape(-1, 1) if x.per_row else x.global_scale
    gw = w.global_scale.reshape(1, -1) if w.per_row else w.global_scale
    return (out * gx) * gw


def mm_plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T in fp32 with the fixed order above (operands upcast exactly to fp32).

    The 16 products of a block are laid out first, [16, rows, N], so each level of the pairwise tree
    (p_j + p_{j+8}, then halves again: `reduce.tree_sum`'s order) adds two contiguous halves; a few
    blocks go through at once while their products stay cache-sized (~0.5 MiB)."""
    xf, wf = x.float(), w.float()
    m, k = xf.shape
    n = wf.shape[0]
    nb = k // BLOCK
    out = xf.new_empty(m, n)
    wt = wf.view(n, nb, BLOCK).permute(1, 2, 0).contiguous()  # [nb, 16, N]
    for lo, hi in _row_chunks(m, n * BLOCK):
        xt = xf[lo:hi].view(hi - lo, nb, BLOCK).permute(1, 2, 0).contiguous()  # [nb, 16, rows]
        group = max(1, _CACHE_ELEMS // (BLOCK * (hi - lo) * n))
        acc = None
        for b0 in range(0, nb, group):
            p = xt[b0:b0 + group].unsqueeze(3) * wt[b0:b0 + group].unsqueeze(2)  # [g, 16, rows, N]
            while p.shape[1] > 1:
                h = p.shape[1] // 2
                p = p[:, :h] + p[:, h:]
            acc = _sum_blocks_in_order(p[:, 0], acc)
        out[lo:hi] = acc
    return out


# ------------------------------------------------------------------------------- row-local ops
# Built only from elementwise ops, exact max reductions and `tree_sum`. Elementwise exp/log/rsqrt and
# the four arithmetic ops give the same bits for an element wherever it sits in a tensor; some library
# composites do not (on CPU, torch.sigmoid / F.silu give different bits for an element computed in a
# SIMD lane and in the scalar remainder), so silu is written out from exp.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) with the statistics in fp32, as HF's Qwen3RMSNorm."""
    xf = x.float()
    var = div(tree_sum(xf * xf), float(x.shape[-1]))
    y = (xf * torch.rsqrt(var + eps).unsqueeze(-1)).to(x.dtype)
    return weight * y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up = gate / (1 + exp(-gate)) * up, in fp32, rounded once to gate's dtype."""
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()).to(gate.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE as HF: x * cos + rotate_half(x) * sin, in x's dtype (each op rounded)."""
    return x * cos + rotate_half(x) * sin


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) over the last dimension, fp32."""
    z = logits.float()
    if temperature != 1.0:
        z = div(z, float(temperature))
    m = z.amax(-1, keepdim=True)
    return z - (m + torch.log(tree_sum(torch.exp(z - m))).unsqueeze(-1))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Causal GQA attention with one reduction order for prefill and decode.

    q [B, Hq, Tq, D]; k, v [B, Hkv, Tk, D] (a KV cache may be longer than its valid part);
    q_pos [B, Tq] absolute positions of the queries; kv_len [B] valid keys. Key j is seen by a query at
    position p when j <= p and j < kv_len. Scores and the weighted sum over keys use `tree_sum`, and
    masked keys contribute exact zeros at the end of the key axis, so a query gets the same bits from
    a full causal prefill and from a decode step over a cache of any capacity. Returns fp32.
    """
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    rep = hq // hkv
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = tree_sum(q.float().unsqueeze(3) * kf.unsqueeze(2)) * scale  # [B, H, Tq, Tk]
    j = torch.arange(tk, device=q.device)
    valid = (j.view(1, 1, tk) <= q_pos.unsqueeze(-1)) & (j.view(1, 1, tk) < kv_len.view(-1, 1, 1))  # [B, Tq, Tk]
    valid = valid.unsqueeze(1)
    scores = scores.masked_fill(~valid, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    e = torch.where(valid, torch.exp(scores - m), torch.zeros((), device=q.device))
    num = tree_sum(torch.where(valid.unsqueeze(-1), e.unsqueeze(-1) * vf.unsqueeze(2), torch.zeros((), device=q.device)), dim=-2)
    den = tree_sum(e).unsqueeze(-1)
    return torch.where(den > 0, num / den, torch.zeros((), device=q.device))  # a query with no valid key: 0
