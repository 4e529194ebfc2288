"""Grouped W4A4 GEMM for MoE experts (Triton): one launch for all experts, no host sync.

Layouts:
- activations `xq`: NVFP4Tensor [T, K] with per-row global scales [T, 1], its rows sorted by expert
  (`moe_sort` gives the order): rows offsets[e] .. offsets[e+1]-1 go to expert e.
- expert weights `w`: one NVFP4Tensor [E, N, K] from `stack_experts`: data uint8 [E, N, K/2], scale
  e4m3 [E, N, K/16], global_scale fp32 [E, N, 1]. Experts quantized with one scale each (the usual
  case) give an expanded view of a [E, 1, 1] tensor there (stride 0 along N, no copy); experts with
  per-row scales [N, 1] are stacked as they are.
- `expert_offsets`: int32 [E + 1] on the device, offsets[0] = 0, non-decreasing, offsets[E] <= T.
  Output rows outside [offsets[0], offsets[E]) are left unwritten.

The launcher reads only shapes on the host (T, N, K, E), never the offsets, so a CUDA graph can capture
it with the routing changing between replays. The grid is (N tiles, an upper bound on the row tiles):
expert e needs ceil(n_e / BLOCK_M) row tiles, and the sum over experts is at most
(T + min(E, T) * (BLOCK_M - 1)) // BLOCK_M. Each program loads the E + 1 offsets, prefix-sums the
experts' tile counts on the device, finds the expert that owns its row tile (or exits: the bound is
loose), and runs the dense kernel's tile (`gemm.w4a4_tile`: same decode, same BLOCK_K, same K chunks
`gemm.k_chunks(N, K)`, walked in chunk order in the program, same epilogue) on that expert's rows and
weight. So a row's bits equal the dense kernel's for that
row and expert, `grouped_gemm(xq, w, offs)[rows of e] == gemm_triton(xq[rows of e], w_e)`, for every
routing (tests/kernels/test_grouped_gemm.py checks it bit for bit).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..nvfp4 import NVFP4Tensor
from .gemm import (FP4_BLOCK_K, SWAP_CONFIGS, cdiv, check_decode, chunk_elements, interpreting, k_chunks, next_pow2,
                   swap_block_m, w4a4_epilogue, w4a4_tile, walk_mode)


class MoeSort(NamedTuple):
    """perm [T*k] int64: sorted position p holds the (token, slot) pair top_i.reshape(-1)[perm[p]];
    tokens [T*k] int64 = perm // k, the token of each sorted row (gather x[tokens] to get the sorted
    activations); offsets [E+1] int32 on the device: expert e owns sorted rows offsets[e] .. offsets[e+1]-1."""

    perm: torch.Tensor
    tokens: torch.Tensor
    offsets: torch.Tensor


def moe_sort(top_i: torch.Tensor, num_experts: int) -> MoeSort:
    """Group the (token, slot) pairs of a top-k routing by expert, stably: within an expert, rows keep
    token order (then slot order), so the order is deterministic. No host sync: the counts come from a
    scatter-add (torch.bincount would read the max back to the host on CUDA), the offsets from a cumsum."""
    if top_i.dim() != 2:
        raise ValueError(f"top_i must be [T, k], got shape {tuple(top_i.shape)}")
    k = top_i.shape[1]
    flat = top_i.reshape(-1).long()
    perm = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return MoeSort(perm, perm // k, offsets)


def stack_experts(experts: list[NVFP4Tensor]) -> NVFP4Tensor:
    """E expert weights [N, K] -> one NVFP4Tensor [E, N, K] (layout in the module docstring). All experts
    must share N, K and the kind of global scale (per tensor [] or per row [N, 1])."""
    if not experts:
        raise ValueError("stack_experts needs at least one expert")
    shape = tuple(experts[0].shape)
    if len(shape) != 2 or any(tuple(t.shape) != shape for t in experts):
        raise ValueError(f"experts must all be 2-D of one shape, got {[tuple(t.shape) for t in experts]}")
    per_row = experts[0].per_row
    if any(t.per_row != per_row for t in experts):
        raise ValueError("experts mix per-tensor and per-row global scales")
    e, (n, k) = len(experts), shape
    data = torch.stack([t.data for t in experts])
    scale = torch.stack([t.scale for t in experts])
    if per_row:
        gs = torch.stack([t.global_scale for t in experts])  # [E, N, 1]
    else:
        gs = torch.stack([t.global_scale.reshape(1, 1) for t in experts]).expand(e, n, 1)  # stride 0 along N
    return NVFP4Tensor(data, scale, gs, (e, n, k))


def grouped_config(t: int, e: int, n: int, k: int) -> dict:
    """One tile config for the launch, from shapes only: BLOCK_M by the mean rows per expert (any BLOCK_M
    gives the same bits, see gemm.py), BLOCK_K that of the dense kernel."""
    mean_rows = max(1, -(-t // max(e, 1)))
    bm = min(128, swap_block_m(mean_rows))  # (at most 128: SWAP_TILE_MAX's 256 is for the dense decode step)
    if interpreting():
        return dict(BLOCK_M=bm, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1, SWAP_AB=True)
    return dict(BLOCK_M=bm, BLOCK_K=FP4_BLOCK_K, SWAP_AB=True, **SWAP_CONFIGS[bm])


CONFIG_OVERRIDE: dict | None = None  # tests and benchmarks: force a tile config (BLOCK_K is kept)


@triton.jit
def _grouped_kernel(
    a_ptr, as_ptr, ags_ptr, b_ptr, bs_ptr, bgs_ptr, off_ptr, c_ptr,
    N, K, E, chunk_k,
    stride_am, stride_asm, stride_ags,
    stride_be, stride_bn, stride_bse, stride_bsn, stride_bgse, stride_bgsn, stride_cm,
    E_PAD: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, CHUNKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    # which expert owns row tile pid_m: prefix sum of the experts' tile counts, on the device
    ei = tl.arange(0, E_PAD)
    lo = tl.load(off_ptr + ei, mask=ei < E, other=0)
    hi = tl.load(off_ptr + ei + 1, mask=ei < E, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, axis=0)  # inclusive
    e = tl.sum((ends <= pid_m).to(tl.int32), axis=0)  # the first expert whose tiles reach past pid_m
    if e < E:
        here = ei == e
        first_tile = tl.sum(tl.where(here, ends - tiles, 0), axis=0)
        row_lo = tl.sum(tl.where(here, lo, 0), axis=0)
        row_hi = tl.sum(tl.where(here, hi, 0), axis=0)
        offs_m = row_lo + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < row_hi
        mask_n = offs_n < N
        e64 = e.to(tl.int64)
        # the dense kernel's K chunks, walked in order in this program
        acc = w4a4_tile(a_ptr, as_ptr, b_ptr + e64 * stride_be, bs_ptr + e64 * stride_bse, offs_m, mask_m, offs_n, mask_n, K,
                        0, K, chunk_k, stride_am, stride_asm, stride_bn, stride_bsn, EVEN_K, SWAP_AB, CHUNKED,
                        BLOCK_M, BLOCK_N, BLOCK_K)
        acc = w4a4_epilogue(acc, ags_ptr, stride_ags, bgs_ptr + e64 * stride_bgse, stride_bgsn, offs_m, mask_m, offs_n, mask_n)
        c = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def grouped_gemm(xq: NVFP4Tensor, w: NVFP4Tensor, expert_offsets: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """out[t] = xq[t] @ w[e].T for the expert e whose row range holds t; [T, N] in `out_dtype`."""
    if len(xq.shape) != 2 or len(w.shape) != 3 or xq.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_gemm shapes: xq {tuple(xq.shape)} must be [T, K], w {tuple(w.shape)} [E, N, K]")
    t, k = xq.shape
    e, n, _ = w.shape
    if expert_offsets.dtype != torch.int32 or tuple(expert_offsets.shape) != (e + 1,):
        raise ValueError(f"expert_offsets must be int32 [{e + 1}], got {expert_offsets.dtype} {tuple(expert_offsets.shape)}")
    if expert_offsets.device != xq.device or w.device != xq.device:
        raise ValueError(f"devices differ: xq {xq.device}, w {w.device}, expert_offsets {expert_offsets.device}")
    if xq.global_scale.dim() not in (0, 2) or w.global_scale.dim() not in (0, 3):
        raise ValueError("global scales: xq [] or [T, 1], w [] or [E, N, 1]")
    check_decode(xq.data.device, xq, w)
    c = torch.empty(t, n, dtype=out_dtype, device=xq.device)
    if t == 0 or n == 0:
        return c
    cfg = dict(grouped_config(t, e, n, k))
    if CONFIG_OVERRIDE:
        cfg.update(CONFIG_OVERRIDE)
        cfg["BLOCK_K"] = grouped_config(t, e, n, k)["BLOCK_K"]
    bm = cfg["BLOCK_M"]
    chunks = k_chunks(n, k)  # the dense kernel's K chunks for (N, K): same reduction order
    chunk_k = chunk_elements(k, chunks, cfg["BLOCK_K"])
    grid = (cdiv(n, cfg["BLOCK_N"]), (t + min(e, t) * (bm - 1)) // bm)
    ags = xq.global_scale
    s_ags = 0 if ags.dim() == 0 else ags.stride(0)
    wgs = w.global_scale
    s_ge, s_gn = (0, 0) if wgs.dim() == 0 else (wgs.stride(0), wgs.stride(1))
    for name, tens in (("xq.data", xq.data), ("xq.scale", xq.scale), ("w.data", w.data), ("w.scale", w.scale)):
        if tens.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    _grouped_kernel[grid](
        xq.data, xq.scale.view(torch.uint8), ags, w.data, w.scale.view(torch.uint8), wgs, expert_offsets, c,
        n, k, e, chunk_k,
        xq.data.stride(0), xq.scale.stride(0), s_ags,
        w.data.stride(0), w.data.stride(1), w.scale.stride(0), w.scale.stride(1), s_ge, s_gn, c.stride(0),
        E_PAD=next_pow2(e), EVEN_K=k % cfg["BLOCK_K"] == 0,
        CHUNKED=walk_mode(k, chunks, cfg["BLOCK_K"]), **cfg,
    )
    return c


__all__ = ["MoeSort", "moe_sort", "stack_experts", "grouped_gemm", "grouped_config"]
