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

from .nvfp4 import BLOCK, NVFP4Tensor, dequantize_unscaled

_MAX_ELEMS = 1 << 24  # intermediate elements per chunk (64 MiB of fp32)


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


def _tree_sum16(p: torch.Tensor) -> torch.Tensor:
    """Sum the last dimension (16) as a fixed pairwise tree."""
    while p.shape[-1] > 1:
        h = p.shape[-1] // 2
        p = p[..., :h] + p[..., h:]
    return p[..., 0]


def mm_plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T in fp32 with the fixed order above (operands upcast exactly to fp32)."""
    xf, wf = x.float(), w.float()
    m, k = xf.shape
    n = wf.shape[0]
    out = xf.new_empty(m, n)
    wb = wf.view(n, k // BLOCK, BLOCK)
    for lo, hi in _row_chunks(m, n * BLOCK):
        xb = xf[lo:hi].view(hi - lo, k // BLOCK, BLOCK)
        acc = None
        for b in range(k // BLOCK):
            part = _tree_sum16(xb[:, None, b, :] * wb[None, :, b, :])
            acc = part if acc is None else acc + part
        out[lo:hi] = acc
    return out
