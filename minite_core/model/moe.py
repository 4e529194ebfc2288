"""The MoE experts in one grouped W4A4 GEMM per projection (inference on the Triton backend).

`Qwen3.moe` computes each expert's MLP on the tokens routed to it and adds the weighted outputs per
token in ascending expert order. The loop over experts needs the token lists on the host (one sync per
expert), so it cannot run inside a CUDA graph, and it launches 3 x E small GEMMs. Here the (token,
expert) pairs are sorted by expert on the device (`kernels.grouped_gemm.moe_sort`), each projection is
one grouped GEMM over all experts, and the per-token sum adds the k contributions in ascending expert
order, as the loop does (bf16 adds from zero, the same operations on the same operands).

Bits: every step is row-local and the grouped GEMM gives, for a row and its expert, the dense kernel's
bits (tests/kernels/test_grouped_gemm.py), so this path and the loop agree bit for bit; the learner, which needs
gradients, keeps the loop and still matches the rollout.

The experts' weights are stacked once per weight set ([E, N, K], `stack_experts`) and cached on the
model; the cache entry is checked against the expert tensors it was built from (identity), and
`restack` refreshes it in place after the rollout engine copies a new version into its CUDA-graph
weights.
"""
from __future__ import annotations

import torch

from .. import ops
from ..nvfp4 import NVFP4Tensor

PROJ = ("gate_proj", "up_proj", "down_proj")
_MAX_CACHED = 3  # weight sets whose stacks are kept (the serving version, a draining one, the learner's)


def usable(model, p: str) -> bool:
    """Can layer `p` take the grouped path: Triton backend, NVFP4 experts, per-row activation scales,
    no gradients wanted, no input observer (`Qwen3.observing_inputs` sees the per-expert linears)."""
    w = model.w.get(p + "experts.0.gate_proj.weight")
    return (model.backend == "triton" and isinstance(w, NVFP4Tensor) and model.knobs.act_scale == "row"
            and model.masters is None and not torch.is_grad_enabled() and model.knobs.matmul != "library"
            and model.input_observer is None)


def _experts(weights: dict, p: str, e: int, proj: str) -> list:
    return [weights[f"{p}experts.{i}.{proj}.weight"] for i in range(e)]


def stacks(model, p: str) -> dict:
    """{proj: stacked NVFP4Tensor [E, N, K]} for layer prefix `p` of the model's current weights."""
    stack_experts = ops._triton("grouped_gemm").stack_experts
    cache = model.__dict__.setdefault("_moe_stacks", {})
    e = model.cfg.num_experts
    key = (id(model.w), p)
    hit = cache.get(key)
    srcs = {proj: _experts(model.w, p, e, proj) for proj in PROJ}
    if hit is not None and all(a is b for proj in PROJ for a, b in zip(hit[0][proj], srcs[proj])):
        return hit[1]
    layers = sum(model.cfg.is_moe_layer(i) for i in range(model.cfg.num_hidden_layers))
    while len(cache) >= _MAX_CACHED * layers:  # bound the cache: drop the oldest entries
        del cache[next(iter(cache))]
    out = {proj: stack_experts(srcs[proj]) for proj in PROJ}
    cache[key] = (srcs, out)
    return out


def restack(model, weights: dict) -> None:
    """After `weights`' expert tensors were overwritten in place: refresh their cached stacks in place."""
    for (wid, p), (srcs, out) in model.__dict__.get("_moe_stacks", {}).items():
        if wid != id(weights):
            continue
        for proj in PROJ:
            st = out[proj]
            st.data.copy_(torch.stack([t.data for t in srcs[proj]]))
            st.scale.copy_(torch.stack([t.scale for t in srcs[proj]]))
            if srcs[proj][0].per_row:
                st.global_scale.copy_(torch.stack([t.global_scale for t in srcs[proj]]))
            else:  # an expanded [E, 1, 1] view: write its base
                st.global_scale[:, :1].copy_(torch.stack([t.global_scale.reshape(1, 1) for t in srcs[proj]]))


def grouped_moe(model, flat: torch.Tensor, p: str, top_v: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
    """The experts' weighted outputs summed per token: flat [T, H], top_v [T, k] (model dtype), top_i [T, k]."""
    kernels = ops._triton("grouped_gemm")
    grouped_gemm, moe_sort = kernels.grouped_gemm, kernels.moe_sort
    e, k = model.cfg.num_experts, top_i.shape[1]
    st = stacks(model, p)
    srt = moe_sort(top_i, e)
    xq = ops.quantize(flat.index_select(0, srt.tokens), backend="triton", check_finite=False)
    gate = grouped_gemm(xq, st["gate_proj"], srt.offsets, model.dtype)
    up = grouped_gemm(xq, st["up_proj"], srt.offsets, model.dtype)
    _, hq = ops.silu_mul(gate, up, backend="triton", quantize=True)  # SiLU*up and its NVFP4 from one kernel
    y = grouped_gemm(hq, st["down_proj"], srt.offsets, model.dtype)  # [T*k, H], sorted by expert
    contrib = y * top_v.reshape(-1).index_select(0, srt.perm).unsqueeze(-1)
    # row of pair (t, slot) in the sorted order; each token's slots visited in ascending expert order
    where = torch.empty_like(srt.perm)
    where[srt.perm] = torch.arange(srt.perm.numel(), device=flat.device)
    where = where.view(-1, k).gather(1, torch.argsort(top_i, dim=1, stable=True))
    out = torch.zeros_like(flat)
    for j in range(k):
        out = out + contrib.index_select(0, where[:, j]).to(out.dtype)
    return out
