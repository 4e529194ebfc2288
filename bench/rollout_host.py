"""The host side of the rollout's eager forwards, measured on the CPU (no GPU needed): a prefill and an eager
decode step through the model with every Triton kernel a no-op, per precision (Python, torch dispatch and
the launches' argument handling: what an eager prefill waits on, since on the device it is host-bound --
docs/benchmarks.md, issue 18), the launches each makes, and with --cprofile the NVFP4 prefill's host time
by function.

    python bench/rollout_host.py [--layers 28] [--batch 16] [--prompt 16] [--repeats 5] [--min] [--cprofile]

The forwards are the engine's (`RolloutEngine._forward`: KV cache, slots, logits at the last prompt
position, under no_grad) on a Qwen3 of the given depth with small widths (the host cost of a launch does
not depend on the tensor's size). Host times are this machine's (single-threaded torch): medians, or with --min the
fastest call (steadier on a shared machine, for comparing two trees).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # the triton backend on CPU tensors; its kernels are replaced below
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.launches import Launches  # noqa: E402
from bench.learner_host import without_kernels  # noqa: E402
from minite_core.model.load import load_model  # noqa: E402
from minite_core.model.qwen3 import KVCache, Qwen3Config  # noqa: E402
from minite_core.model.random_init import random_checkpoint  # noqa: E402


def forwards(layers: int, precision: str, batch: int, prompt: int):
    """-> {"prefill": fn, "decode": fn}: the engine's two eager forwards on a random-weight model."""
    # widths that are whole decode blocks (`gemm.fp4_block_k`), as a real model's: no padded buffers to zero
    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    with tempfile.TemporaryDirectory() as d:
        model = load_model(random_checkpoint(d, cfg), precision=precision, backend="triton")
    cache = KVCache(cfg, batch, prompt + 8, model.dtype, model.device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=g)
    pos = torch.arange(prompt).expand(batch, prompt)
    slots = torch.arange(batch)
    last = torch.full((batch,), prompt - 1)

    @torch.no_grad()
    def prefill():
        return model(ids, pos, cache, slots, check_ids=False, logits_at=last, logits_dtype=model.dtype)

    @torch.no_grad()
    def decode():
        return model(ids[:, :1], torch.full((batch, 1), prompt), cache, slots, check_ids=False,
                     logits_dtype=model.dtype)

    return {"prefill": prefill, "decode": decode}


def host_times(fn, repeats: int, stat=statistics.median) -> float:
    """`stat` (median) of the host seconds of fn() with the Triton kernels as no-ops (one warm-up call first)."""
    times = []
    with without_kernels():
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            fn()
            if r:
                times.append(time.perf_counter() - t0)
    return stat(times)


def rollout_forwards_host(fns: dict, repeats: int = 5, stat=statistics.median) -> dict:
    """`forwards(...)` -> {"prefill" / "decode": (`stat` of the host seconds, Counter of launches)} (see the module
    docstring)."""
    out = {}
    for name, fn in fns.items():
        sec = host_times(fn, repeats, stat)
        with Launches(run_kernels=False) as mode:  # (counting costs host time: not timed)
            fn()
        out[name] = (sec, mode.counts)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min", action="store_true", help="the fastest call's host time instead of the median")
    ap.add_argument("--cprofile", action="store_true", help="the NVFP4 prefill's host time by function")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"rollout forwards, {args.layers} layers, batch {args.batch} x prompt {args.prompt}, host side "
          f"(Triton kernels as no-ops), {'fastest' if args.min else 'medians'} of {args.repeats}")
    print(f"{'precision':9s} | {'forward':7s} | {'host ms':>8s} | {'Triton':>6s} | {'aten':>5s}")
    fns = {}
    for precision in ("bf16", "nvfp4"):
        fns[precision] = forwards(args.layers, precision, args.batch, args.prompt)
        stat = min if args.min else statistics.median
        for name, (sec, c) in rollout_forwards_host(fns[precision], args.repeats, stat).items():
            tri = sum(v for k, v in c.items() if k.startswith("triton "))
            aten = sum(v for k, v in c.items() if k.startswith("aten "))
            print(f"{precision:9s} | {name:7s} | {sec * 1e3:8.1f} | {tri:6d} | {aten:5d}")
    if args.cprofile:
        prof = cProfile.Profile()
        with without_kernels():
            fns["nvfp4"]["prefill"]()
            prof.enable()
            for _ in range(args.repeats):
                fns["nvfp4"]["prefill"]()
            prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())


if __name__ == "__main__":
    main()
