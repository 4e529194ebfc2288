"""The host side of one learner step, measured on the CPU (no GPU needed): the Triton kernels it launches and
the torch ops that would each launch a GPU kernel, per phase and per layer, and the host time of each phase
with every Triton kernel a no-op (Python, autograd and torch dispatch: what the GPU waits on wherever the
host falls behind, i.e. around a host sync).

    python bench/learner_host.py [--layers 28] [--repeats 5]

The step is the Trainer's (`rl.step.LearnerState`, as bench/learner.py runs it): forward through the fp32
masters, backward, AdamW, re-quantize, on a Qwen3 of the given depth with small widths (the host cost of a
launch does not depend on the tensor's size). The linears take the GPU's backward recipe (`backward.ste_cuda`,
which runs on CPU tensors too), not the CPU's fixed-order one, and batch x seq = 4 x 64 rows, so the GEMMs take
their wide-tile path (M > 128) as at the learner's 4 x 2048. Gradients are zeroed before AdamW (the no-op
kernels leave garbage in their outputs). Host times are this machine's (single-threaded torch); on the
device, bench/learner.py --profile gives the GPU's busy time against the step's wall time.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # the triton backend on CPU tensors; its kernels are replaced below
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

from bench.launches import Launches  # noqa: E402
from minite_core import backward as bwd  # noqa: E402
from minite_core import ops  # noqa: E402
from minite_core.model.load import load_model  # noqa: E402
from minite_core.model.qwen3 import Qwen3Config  # noqa: E402
from minite_core.model.random_init import random_checkpoint  # noqa: E402
from minite_core.rl.step import LearnerState, fp32_masters, make_optimizer  # noqa: E402

PHASES = ("forward", "backward", "adamw", "requantize")


@contextlib.contextmanager
def gpu_backward():
    """Within the block the linears' backward takes the GPU's recipe (`_gpu_linear_grads`)."""
    saved, ops._linear_grads = ops._linear_grads, _gpu_linear_grads
    try:
        yield
    finally:
        ops._linear_grads = saved


@contextlib.contextmanager
def without_kernels():
    """Within the block every Triton kernel is skipped (for timing: no dispatch mode, no counting)."""
    saved = interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = lambda fn, *args, **kwargs: None
    try:
        yield
    finally:
        interpreter.InterpretedFunction.run = saved


_CPU_LINEAR_GRADS = ops._linear_grads


def _gpu_linear_grads(ctx, g2, x2, w, w_tensor, need_x, need_w, deq, shared):
    """`ops._linear_grads` as on a GPU: the straight-through recipe through `ste_cuda` (CPU tensors allowed)."""
    if ctx.bwd != "ste":
        return _CPU_LINEAR_GRADS(ctx, g2, x2, w, w_tensor, need_x, need_w, deq, shared)
    return bwd.ste_cuda(g2, x2, w, ctx.xq, ctx.x_dtype if need_x else None, w_tensor.dtype if need_w else None, deq)


def learner_step_host(layers: int, precision: str, repeats: int = 3) -> dict:
    """-> {phase: (median host seconds, Counter of launches)} of a learner step (see the module docstring)."""
    cfg = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with tempfile.TemporaryDirectory() as d:
        path = random_checkpoint(d, cfg)
        policy = load_model(path, precision=precision, backend="triton", knobs={"attention": "sdpa"})
        masters = fp32_masters(load_model(path, precision="fp32").w)
    state = LearnerState(policy, masters, make_optimizer(masters.values(), lr=1e-5), max_grad_norm=1.0)
    ids = torch.randint(0, cfg.vocab_size, (4, 40), generator=torch.Generator().manual_seed(0)).tolist()
    prompts, completions = [s[:1] for s in ids], [s[1:] for s in ids]
    box = {}

    def forward():
        box["loss"] = -torch.cat(state.logprobs(prompts, completions)).mean()

    def backward():
        state.opt.zero_grad()
        box.pop("loss").backward()

    def adamw():
        for m in masters.values():  # the no-op kernels' outputs are garbage: step on zero gradients
            if m.grad is not None:
                m.grad.zero_()
        state.opt.step()

    steps = list(zip(PHASES, (forward, backward, adamw, state.requantize)))
    times, counts = collections.defaultdict(list), {}
    with gpu_backward():
        for r in range(repeats + 1):  # the first step warms up (allocations, lazy state)
            for phase, fn in steps:
                with without_kernels():
                    t0 = time.perf_counter()
                    fn()
                    elapsed = time.perf_counter() - t0
                if r:
                    times[phase].append(elapsed)
        for phase, fn in steps:  # one more step, counted (the counting itself costs host time: not timed)
            with Launches(run_kernels=False) as mode:
                fn()
            counts[phase] = mode.counts
    return {p: (statistics.median(times[p]), counts[p]) for p in PHASES}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"learner step, {args.layers} layers, host side (Triton kernels as no-ops), {args.repeats} steps, medians")
    print(f"{'precision':9s} | {'phase':10s} | {'host ms':>8s} | {'Triton':>6s} | {'aten':>5s} | Triton kernels")
    for precision in ("bf16", "nvfp4"):
        total = 0.0
        for phase, (sec, c) in learner_step_host(args.layers, precision, args.repeats).items():
            total += sec
            tri = {k[len("triton "):]: v for k, v in sorted(c.items()) if k.startswith("triton ")}
            aten = sum(v for k, v in c.items() if k.startswith("aten "))
            print(f"{precision:9s} | {phase:10s} | {sec * 1e3:8.1f} | {sum(tri.values()):6d} | {aten:5d} | {tri}")
        print(f"{precision:9s} | {'step':10s} | {total * 1e3:8.1f} |")


if __name__ == "__main__":
    main()
