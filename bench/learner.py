"""Learner throughput (GPU): tokens/s of one training step (forward + backward + AdamW + re-quantize)
on a random-weight Qwen3 config, miniTE NVFP4 vs miniTE BF16 vs a HF transformers bf16 training step.

    python bench/learner.py [--config 0.6b] [--batch 4] [--seq 2048] [--steps 5] [--attention sdpa]

The miniTE step is the Trainer's: the policy forward with fp32 master weights (NVFP4: W4A4 GEMMs, the
masters' gradients through the straight-through backward), a token-mean loss on the completion
logprobs (what GRPO's loss reduces to up to per-token weights), AdamW, then the masters re-quantized
into the weights the rollout engine uses. HF: Qwen3ForCausalLM in bf16 with sdpa attention, AdamW,
cross-entropy loss. All on the same random config. Tokens/s = batch * seq / median step seconds. A second
table splits each engine's step into phases (forward, backward, clip + AdamW, re-quantize) by CUDA events,
in as many more steps; `--profile` adds one profiled step per engine: GPU time by kernel family.

`--attention sdpa` runs miniTE's attention through torch SDPA (the misalignment knob) in both
precisions, so the comparison isolates the linear layers; the aligned torch attention materializes
[B, H, T, T, D] and does not fit at seq 2048 (a Triton attention kernel is issue 6's).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import CONFIGS, kernel_breakdown, kernel_intervals, make_config, profiled  # noqa: E402
from minite_core.kernels import gemm  # noqa: E402
from minite_core.model import load_model  # noqa: E402
from minite_core.model.qwen3 import Qwen3Config  # noqa: E402
from minite_core.model.random_init import random_checkpoint  # noqa: E402
from minite_core.rl.step import LearnerState, fp32_masters, make_optimizer  # noqa: E402


def time_steps(step, n: int) -> list[float]:
    step()  # warm-up: compile the Triton kernels, fill the allocator
    step()
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


class Phases:
    """CUDA events at a step's phase boundaries (`mark(name)`: the phase that ends here): each phase's median
    GPU-stream milliseconds over the steps recorded, and the host's (the time the host took to issue the
    phase). The events sit in the stream, so a phase's GPU time is from the end of the previous phase's work
    to the end of its own, host waits included: a phase whose host time is about its GPU time is host-bound."""

    def __init__(self):
        self.steps: list[list[tuple[str, torch.cuda.Event, float]]] = []
        self.on = False

    def start(self) -> None:
        if self.on:
            self.steps.append([("", self._event(), time.perf_counter())])

    def mark(self, name: str) -> None:
        if self.on:
            self.steps[-1].append((name, self._event(), time.perf_counter()))

    @staticmethod
    def _event() -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def medians(self) -> dict:
        """phase -> (median GPU ms, median host ms)."""
        torch.cuda.synchronize()
        per = {}
        for marks in self.steps:
            for (_, a, ta), (name, b, tb) in zip(marks, marks[1:]):
                per.setdefault(name, []).append((a.elapsed_time(b), (tb - ta) * 1e3))
        return {name: tuple(statistics.median(x) for x in zip(*v)) for name, v in per.items()}


def minite_step_fn(path: Path, precision: str, batch: int, seq: int, knobs: dict, backward: str = "ste",
                   phases: Phases | None = None, decoded_once: bool = True):
    policy = load_model(path, precision=precision, backend="triton", device="cuda", knobs=knobs)
    policy.backward = backward  # the NVFP4 linears' gradient recipe (minite_core/backward.py)
    fp32 = load_model(path, precision="fp32", device="cuda")
    masters = fp32_masters(fp32.w)
    del fp32
    # the Trainer's learner step: fused AdamW on CUDA, clip, re-quantize once
    state = LearnerState(policy, masters, make_optimizer(masters.values(), lr=1e-5), max_grad_norm=1.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, policy.cfg.vocab_size, (batch, seq), generator=g).tolist()
    prompts, completions = [s[:1] for s in ids], [s[1:] for s in ids]

    ph = phases or Phases()

    def step():
        gemm.OPERANDS_DECODED_ONCE = decoded_once  # (a bench-only module setting: this step's, then the default)
        try:
            ph.start()
            loss = -torch.cat(state.logprobs(prompts, completions)).mean()
            ph.mark("forward")
            state.optimize(loss, after_backward=lambda: ph.mark("backward"))
            ph.mark("clip + AdamW")
            state.requantize()
            ph.mark("re-quantize")
        finally:
            gemm.OPERANDS_DECODED_ONCE = True
    return step


def hf_step_fn(cfg: Qwen3Config, batch: int, seq: int, phases: Phases | None = None):
    import transformers
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "dtype")})
    hf_cfg._attn_implementation = "sdpa"
    model = transformers.Qwen3ForCausalLM(hf_cfg).to(device="cuda", dtype=torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    ph = phases or Phases()

    def step():
        ph.start()
        loss = model(input_ids=ids, labels=ids).loss
        ph.mark("forward")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        ph.mark("backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ph.mark("clip + AdamW")
    return step


def profile(name: str, step, step_s: float, device: str = "cuda") -> None:
    """One more step under torch.profiler: its GPU time by kernel family against the unprofiled step time
    `step_s` (a GPU idle share well above zero: the step waits on the host, launch overhead or syncs, not on
    kernels), then the kernels that take the most. (`device` "cpu": the CPU ops, for the tests.)"""
    prof = profiled(step, device)
    b = kernel_breakdown(kernel_intervals(prof, device))
    print(f"--- {name}: step {step_s * 1e3:.1f} ms (unprofiled median), GPU busy {b['busy'] * 1e3:.1f} ms "
          f"({b['busy'] / step_s:.0%}; idle {max(0.0, step_s - b['busy']) * 1e3:.1f} ms), {b['kernels']} kernels")
    for fam, (sec, n) in sorted(b["families"].items(), key=lambda kv: -kv[1][0]):
        print(f"    {fam:30s} {sec * 1e3:8.1f} ms {n:6d} kernels")
    ev = prof.key_averages()
    print(ev.table(sort_by="cuda_time_total" if device == "cuda" else "cpu_time_total", row_limit=25,
                   max_name_column_width=60))
    if device == "cuda":  # where the host spends the step (a GPU that idles waits on these): ops, launches, syncs
        print(ev.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="0.6b", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "invariant"])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--backward", default="", help="also time the NVFP4 step with these gradient recipes, e.g. fp8")
    ap.add_argument("--profile", action="store_true", help="print where each step spends GPU time, and how long the GPU idles")
    ap.add_argument("--decode-per-call", action="store_true",
                    help="also time NVFP4 with the wide tiles' operands decoded in the GEMM at every call (as before "
                         "2026-12-06) instead of by the kernels that quantized them")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/learner.py needs a CUDA device")
    cfg = make_config(args.config, args.seq)
    knobs = {"attention": "sdpa"} if args.attention == "sdpa" else {}
    tokens = args.batch * args.seq
    rows, phase_ms = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        path = random_checkpoint(Path(tmp) / "model", cfg)
        runs = [(f"minite-{p}", lambda ph, p=p: minite_step_fn(path, p, args.batch, args.seq, knobs, phases=ph))
                for p in ("bf16", "nvfp4")]
        runs += [(f"minite-nvfp4-{b}-bwd", lambda ph, b=b: minite_step_fn(path, "nvfp4", args.batch, args.seq, knobs, b, ph))
                 for b in args.backward.split(",") if b and b != "ste"]
        if args.decode_per_call:
            runs.append(("minite-nvfp4-decode-per-call",
                         lambda ph: minite_step_fn(path, "nvfp4", args.batch, args.seq, knobs, phases=ph, decoded_once=False)))
        if not args.skip_hf:
            runs.append(("hf-transformers-bf16", lambda ph: hf_step_fn(cfg, args.batch, args.seq, ph)))
        for name, build in runs:
            try:
                torch.cuda.reset_peak_memory_stats()
                ph = Phases()
                step = build(ph)
                times = time_steps(step, args.steps)
                med = statistics.median(times)
                rows.append((name, med, tokens / med, torch.cuda.max_memory_allocated() / 2**30))
            except Exception as e:  # report and go on: one failing row must not cost the others
                rows.append((name, float("nan"), float("nan"), float("nan")))
                print(f"{name}: FAILED {type(e).__name__}: {e}", file=sys.stderr)
                torch.cuda.empty_cache()
                continue
            try:  # the phases, in steps of their own (the events' records stay out of the timed steps)
                ph.on = True
                for _ in range(args.steps):
                    step()
                phase_ms[name] = ph.medians()
            except Exception as e:  # a failing phase split must not cost the timings either
                print(f"{name}: phases FAILED {type(e).__name__}: {e}", file=sys.stderr)
            ph.on = False
            if args.profile:
                try:
                    profile(name, step, med)
                except Exception as e:  # nor a failing profile the timings
                    print(f"{name}: profile FAILED {type(e).__name__}: {e}", file=sys.stderr)
            del step
            torch.cuda.empty_cache()
    print(f"\nlearner step, Qwen3-{args.config} shape, batch {args.batch} x seq {args.seq}, attention={args.attention}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'engine':24s} {'step s':>8s} {'tokens/s':>10s} {'peak GiB':>9s}")
    for name, med, tps, mem in rows:
        print(f"{name:24s} {med:8.3f} {tps:10.0f} {mem:9.1f}")
    names = list(dict.fromkeys(n for ph in phase_ms.values() for n in ph))
    print(f"\nphases, GPU ms (host ms): medians of {args.steps} more steps, CUDA events and the host's clock; a GPU phase"
          " includes its waits for the host")
    print(f"{'engine':24s} " + " ".join(f"{n:>16s}" for n in names))
    for name, ph in phase_ms.items():
        print(f"{name:24s} " + " ".join(f"{ph[n][0]:8.1f} ({ph[n][1]:5.1f})" if n in ph else f"{'-':>16s}" for n in names))
    by = {r[0]: r[2] for r in rows}
    if by.get("minite-bf16"):
        print(f"NVFP4 / BF16 = {by['minite-nvfp4'] / by['minite-bf16']:.2f}x")
    if by.get("hf-transformers-bf16"):
        print(f"NVFP4 / HF   = {by['minite-nvfp4'] / by['hf-transformers-bf16']:.2f}x")
    for name, tps in by.items():
        if name.endswith("-bwd") and by.get("minite-bf16"):
            print(f"{name[len('minite-nvfp4-'):]} NVFP4 / BF16 = {tps / by['minite-bf16']:.2f}x"
                  + (f", / HF = {tps / by['hf-transformers-bf16']:.2f}x" if by.get("hf-transformers-bf16") else ""))


if __name__ == "__main__":
    main()
