"""Kernel launches of one decode step, counted on the CPU (no GPU needed): the Triton kernels the model
launches (run under TRITON_INTERPRET=1) and the torch ops that would each launch a kernel on a GPU
(every aten op but views and allocations), per precision, for a random-weight Qwen3 of a few layers.

    python bench/launches.py [--layers 2]

A decode step of a small model is launch-bound (docs/benchmarks.md, issue 18): this is the count that the
fusions in `ops` (q/k/v and gate/up in one GEMM launch, norm + quantize, q/k norm + RoPE + cache write,
residual add + norm, the split-K combine in the GEMM) bring down. Prints the launches per step and per
layer (the difference between two depths, so the per-step work -- embedding, RoPE tables, lm_head -- cancels).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from minite_core.model.load import load_model  # noqa: E402
from minite_core.model.qwen3 import KVCache, Qwen3Config  # noqa: E402
from minite_core.model.random_init import random_checkpoint  # noqa: E402

# aten ops that launch nothing on a GPU: views, metadata, allocations
NO_KERNEL = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "unsqueeze", "squeeze", "slice",
             "select", "as_strided", "alias", "detach", "split", "unbind", "empty", "empty_like", "new_empty",
             "empty_strided", "lift_fresh", "promote_types", "_has_compatible_shallow_copy_type", "is_same_size"}


class Launches(TorchDispatchMode):
    """Counts Triton launches and kernel-launching aten ops (the interpreter's own tensor work excluded).
    `run_kernels=False`: the Triton kernels are counted and skipped (bench/learner_host.py)."""

    def __init__(self, run_kernels: bool = True):
        super().__init__()
        self.counts = collections.Counter()
        self.inside = 0
        self.run_kernels = run_kernels

    def __enter__(self):
        run = interpreter.InterpretedFunction.run
        mode = self

        def counted(fn, *args, **kwargs):
            mode.counts["triton " + fn.fn.__name__] += 1
            if not mode.run_kernels:
                return None
            mode.inside += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                mode.inside -= 1
        self._run, interpreter.InterpretedFunction.run = run, counted
        return super().__enter__()

    def __exit__(self, *exc):
        interpreter.InterpretedFunction.run = self._run
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and name not in NO_KERNEL:
            self.counts["aten " + name] += 1
        return func(*args, **(kwargs or {}))


def decode_step_launches(layers: int, precision: str, batch: int = 16) -> collections.Counter:
    """The launches of one decode step of `batch` sequences at position 5 (over a zero cache), in the steady
    state (after a first step: one-time allocations such as the GEMM's tile counters are not counted)."""
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with tempfile.TemporaryDirectory() as d:
        model = load_model(random_checkpoint(d, cfg), precision=precision, backend="triton")
    cache = KVCache(cfg, batch, 32, torch.bfloat16, "cpu")
    slots = torch.arange(batch)
    ids = torch.randint(0, cfg.vocab_size, (batch, 5))
    def step():
        model(ids[:, :1], torch.full((batch, 1), 5), cache, slots, check_ids=False, logits_dtype=model.dtype)

    with torch.no_grad():
        step()
        with Launches() as count:
            step()
    return count.counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    print("precision | launches per step | per layer | what (one step)")
    for precision in ("nvfp4", "bf16"):
        deep, shallow = decode_step_launches(args.layers, precision), decode_step_launches(1, precision)
        per_layer = (sum(deep.values()) - sum(shallow.values())) / max(args.layers - 1, 1)
        print(f"{precision:9s} | {sum(deep.values()):17d} | {per_layer:9.0f} | {dict(sorted(deep.items()))}")


if __name__ == "__main__":
    main()
