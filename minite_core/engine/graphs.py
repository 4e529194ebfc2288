"""CUDA graphs for the rollout engine's steps: the decode step, one per batch-size bucket (and the prefill, one per
rows and length bucket, up to `rollout.PREFILL_GRAPH_TOKENS`), surviving weight syncs.

A decode step of a small model is hundreds of small kernels; launched from Python each costs more than
it computes. Capturing the step once per batch-size bucket (1, 2, 4, ... up to the engine's slots) and
replaying it removes the launch cost. A batch of b sequences runs in the smallest bucket >= b; the
padding rows decode a dummy token into a scratch cache slot that no sequence owns. Every op is
batch-invariant, so the real rows get the same bits as in an eager forward of the b rows alone.

A graph reads its weights from fixed addresses. The runner owns one set of weight buffers (the
"graph weights"), captured once; a weight sync copies the new values into them in place
(`copy_weights_`), so the graphs stay valid across versions: no re-capture, no re-compile (the
failure mode reported for vLLM/SGLang where a weight update silently leaves a graph on stale
pointers cannot happen: the graph never sees other tensors). The buffers hold one version at a time:
the engine replays graphs only for sequences on the newest version and runs older, draining versions
eagerly.

Prefill graphs (on with the decode graphs; `RolloutEngine(prefill_graphs=False)`: eager): an eager prefill is
host-bound on a GPU (hundreds of launches, each tens of µs of Python, for a few ms of GPU work), so a prefill
replays a graph too, one per (rows bucket, length bucket): b prompts right-padded to t positions run as
`bucket(b)` x `length_bucket(t)` (`pad_prefill`): padding rows decode dummy tokens into the scratch row, padding
positions write cache entries past each prompt, which no query reads before that sequence's decode steps write
them (causal attention; the engine already right-pads a group to its longest prompt). The rows take the decode
graphs' buckets (powers of two and the slot count); a length bucket adds at most 15 or 1/4 more positions.
"""
from __future__ import annotations

import torch

from ..model import moe
from ..nvfp4 import NVFP4Tensor


def clone_weights(weights: dict) -> dict:
    out = {}
    for name, t in weights.items():
        if isinstance(t, NVFP4Tensor):
            out[name] = NVFP4Tensor(t.data.clone(), t.scale.clone(), t.global_scale.clone(), t.shape)
        else:
            out[name] = t.clone()
    return out


def copy_weights_(dst: dict, src: dict) -> None:
    """Write `src` into `dst`'s tensors in place; the names, shapes and formats must match."""
    if dst.keys() != src.keys():
        raise ValueError("weight sync: the new weights have other tensor names than the captured ones")
    for name, d in dst.items():
        s = src[name]
        if isinstance(d, NVFP4Tensor) != isinstance(s, NVFP4Tensor) or tuple(d.shape) != tuple(s.shape):
            raise ValueError(f"weight sync: {name} changed format or shape; graphs need the same layout")
        if isinstance(d, NVFP4Tensor):
            if d.global_scale.shape != s.global_scale.shape:
                raise ValueError(f"weight sync: {name} changed its global-scale layout")
            d.data.copy_(s.data)
            d.scale.copy_(s.scale)
            d.global_scale.copy_(s.global_scale)
            d.decoded = None  # (clones carry none; a decoded form of the old codes would now be stale)
        else:
            d.copy_(s)


def buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def length_bucket(t: int, cap: int) -> int:
    """The positions a prefill of t runs at: t rounded up to a multiple of max(16, 2^(bit_length(t - 1) - 3)), so
    at most 15 or a quarter more (4 buckets a doubling past 128), and at most `cap` (the cache's positions)."""
    step = max(16, 1 << max(0, (t - 1).bit_length() - 3))
    return min(cap, -(-t // step) * step)


def pad_prefill(ids: torch.Tensor, slots: torch.Tensor, last: torch.Tensor, rows: int, length: int, scratch: int):
    """A prefill's inputs (ids [b, t] from position 0, slots [b], each row's last prompt position [b]) padded to
    `rows` x `length`: padding rows read token 0 into the cache row `scratch`, padding positions token 0 (past
    every prompt). -> (ids, positions [rows, length], slots, last)."""
    b, t = ids.shape
    out_ids = ids.new_zeros(rows, length)
    out_ids[:b, :t] = ids
    out_slots = slots.new_full((rows,), scratch)
    out_slots[:b] = slots
    out_last = last.new_zeros(rows)
    out_last[:b] = last
    return out_ids, torch.arange(length, device=ids.device).expand(rows, length), out_slots, out_last


def graph_capturable(model) -> bool:
    """Can the decode forward be captured: dense, or every MoE layer on the grouped path (device offsets,
    no host sync); the per-expert loop sizes its work on the host."""
    from ..model import moe

    layers = [i for i in range(model.cfg.num_hidden_layers) if model.cfg.is_moe_layer(i)]
    with torch.no_grad():
        return all(moe.usable(model, f"model.layers.{i}.mlp.") for i in layers)


class StepGraphs:
    """Graph-captured decode (and prefill) forwards of `model` over `cache`; `scratch_slot` is a cache row no
    sequence uses."""

    def __init__(self, model, cache, max_batch: int, scratch_slot: int):
        self.model, self.cache, self.scratch = model, cache, scratch_slot
        self.max_len = cache.capacity  # (the positions a cache row holds)
        self.buckets = buckets(max_batch)
        dev = model.device
        top = self.buckets[-1]
        self.ids = torch.zeros(top, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(top, 1, dtype=torch.long, device=dev)
        self.slots = torch.full((top,), scratch_slot, dtype=torch.long, device=dev)
        self.weights: dict | None = None  # the graph weights
        self.loaded = None  # (id of the weights dict, version) whose values the graph weights hold
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.prefills: dict[tuple[int, int], tuple] = {}  # (rows, length) -> (graph, logits, (ids, pos, slots, last))
        self.pool = None

    def bucket(self, b: int) -> int:
        return next(x for x in self.buckets if x >= b)

    def load(self, weights: dict, version: int) -> None:
        """Make the graph weights hold `weights` (a copy in place after the first call)."""
        key = (id(weights), version)
        if self.loaded == key:
            return
        if self.weights is None:
            self.weights = clone_weights(weights)
        else:
            copy_weights_(self.weights, weights)
            moe.restack(self.model, self.weights)  # the MoE layers' stacked experts follow in place
        self.loaded = key

    def _forward(self, ids, pos, slots, logits_at=None) -> torch.Tensor:
        with self.model.using(self.weights):
            return self.model(ids, pos, self.cache, slots, check_ids=False, logits_at=logits_at,
                              logits_dtype=self.model.dtype)  # as the learner: see RolloutEngine._forward

    def _capture(self, forward):
        """(graph, output) of `forward()` captured (after a warm-up run)."""
        # warm up on a side stream (compiles the Triton kernels, settles the allocator), then capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            forward()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(g, pool=self.pool):
            out = forward()
        return g, out

    def run(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One decode step for b sequences (ids, pos [b, 1], slots [b], on the device) -> logits [b, V].
        The caller has `load`ed the weights; the result is valid until the next `run` or `prefill`."""
        b = ids.shape[0]
        n = self.bucket(b)
        self.ids[:b].copy_(ids)
        self.pos[:b].copy_(pos)
        self.slots[:b].copy_(slots)
        self.ids[b:n].zero_()
        self.pos[b:n].zero_()
        self.slots[b:n].fill_(self.scratch)
        if n not in self.graphs:
            self.graphs[n] = self._capture(lambda: self._forward(self.ids[:n], self.pos[:n], self.slots[:n]))
        g, out = self.graphs[n]
        g.replay()
        return out[:b, 0]

    def prefill_key(self, b: int, t: int) -> tuple[int, int]:
        """The (rows, length) bucket a prefill of b prompts of t positions runs in."""
        return self.bucket(b), length_bucket(t, self.max_len)

    def prefill_tokens(self, b: int, t: int) -> int:
        """The padded tokens of that bucket's graph."""
        rows, length = self.prefill_key(b, t)
        return rows * length

    def prefill(self, ids: torch.Tensor, slots: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """A prefill of b prompts right-padded to t positions (ids [b, t] from position 0, slots [b], each row's
        last prompt position [b], on the device) -> the logits there [b, V], by the graph of its (rows, length)
        bucket (`pad_prefill`). The caller has `load`ed the weights; valid until the next `run` or `prefill`."""
        b, t = ids.shape
        key = self.prefill_key(b, t)
        p_ids, p_pos, p_slots, p_last = pad_prefill(ids, slots, last, *key, self.scratch)
        if key not in self.prefills:
            static = (p_ids.clone(), p_pos.clone(), p_slots.clone(), p_last.clone())
            g, out = self._capture(lambda: self._forward(*static[:3], logits_at=static[3]))
            self.prefills[key] = (g, out, static)
        g, out, (s_ids, _, s_slots, s_last) = self.prefills[key]
        s_ids.copy_(p_ids)
        s_slots.copy_(p_slots)
        s_last.copy_(p_last)
        g.replay()
        return out[:b, 0]
