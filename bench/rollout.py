"""Rollout throughput (GPU): decode tokens/s of miniTE's rollout engine vs HF transformers `generate`.

    python bench/rollout.py [--configs 0.6b,1.7b,moe] [--batches 1,16,64,256] [--prompt 128] [--new 128]

Each run: `batch` random prompts of `prompt` tokens, `new` tokens sampled per sequence (temperature 1,
no top-k / top-p, no stop token), wall time from the call to the last token, tokens/s = batch * new /
seconds (prefill included, as a user of `generate` sees it). One warm-up run of the same shape first
(Triton compiles, CUDA-graph capture, torch.compile), then the median of `--repeats` runs. miniTE's peers
also time a run of one new token (prefill and the first sample): the wall time's split into the prefill and
a decode step ((wall - that) / (new - 1)), and NVFP4 against BF16 on the decode steps alone.

Peers, all on the same random-weight checkpoint:
- minite-nvfp4: RolloutEngine, W4A4 weights and activations, Triton backend, CUDA-graph decode;
- minite-bf16:  the same engine with bf16 weights (Triton plain GEMM);
- minite-nvfp4-pdl, minite-bf16-pdl (only when named in --peers): the two with programmatic dependent
  launch on (`kernels/pdl.py`, off by default);
- minite-bf16-free: the same bf16 engine with the "free" knobs (cuBLAS matmul, torch SDPA attention), i.e.
  what the aligned kernels cost (eager: the knobs are not graph-captured);
- hf-dynamic:   transformers generate, bf16, sdpa, dynamic KV cache;
- hf-static:    transformers generate with cache_implementation="static" (generate compiles the forward).

`--profile`: torch.profiler of one NVFP4 and one BF16 generate (GPU kernels by family, CPU ops); `--cprofile`:
the prefill's host side by Python function. MINITE_WIDE_PACKED_MAX_M (kernels/gemm.py) times the prefill's
wide tiles on packed weights against the decode of each weight per call (the bits do not change).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import cprofiled, cuda_time, kernel_breakdown, kernel_intervals, make_config  # noqa: E402
from minite_core.engine import RolloutEngine, SamplingParams  # noqa: E402
from minite_core.kernels import gemm, pdl  # noqa: E402
from minite_core.model import load_model  # noqa: E402
from minite_core.model.random_init import random_checkpoint  # noqa: E402

PEERS = ("minite-nvfp4", "minite-bf16", "minite-bf16-free", "hf-dynamic", "hf-static")  # and the two -pdl on request


def prompts_for(cfg, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, cfg.vocab_size, (batch, length), generator=g)


def minite_runner(path: Path, precision: str, knobs: dict, batch: int, prompt: int, new: int):
    model = load_model(path, precision=precision, backend="triton", device="cuda", knobs=knobs)
    engine = RolloutEngine(model, max_slots=batch, max_seq_len=prompt + new + 1)
    ids = prompts_for(model.cfg, batch, prompt).tolist()

    def run(seed: int, tokens: int = new) -> int:
        outs = engine.generate(ids, SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed))
        return sum(len(o.token_ids) for o in outs)
    return run, engine


def hf_runner(path: Path, cfg, batch: int, prompt: int, new: int, static: bool):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to("cuda").eval()
    ids = prompts_for(cfg, batch, prompt).to("cuda")
    mask = torch.ones_like(ids)
    extra = dict(cache_implementation="static") if static else {}

    def run(seed: int) -> int:
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=0, **extra)
        return (out.shape[1] - prompt) * batch
    return run, model


def measure(run, repeats: int) -> tuple[float, int]:
    run(0)  # warm-up
    times, tokens = [], 0
    for r in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = run(r + 1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), tokens


def first_runners(args):
    """(label, run) of minite-nvfp4 then minite-bf16 on the first config and batch of `args` (the profiles')."""
    name, batch = args.configs.split(",")[0], int(args.batches.split(",")[0])
    cfg = make_config(name, args.prompt + args.new + 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = random_checkpoint(Path(tmp) / "model", cfg)
        for precision in ("nvfp4", "bf16"):
            run, _ = minite_runner(path, precision, {}, batch, args.prompt, args.new)
            yield f"minite-{precision} {name} b{batch}", run


def profile(args) -> None:
    """Where a generate() of the first config / batch spends CPU and GPU time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile as prof
    for label, run in first_runners(args):
        run(0)
        wall = cuda_time(lambda: run(1))
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            run(2)
            torch.cuda.synchronize()
        ev, b = p.key_averages(), kernel_breakdown(kernel_intervals(p))
        print(f"--- {label}: wall {wall:.3f} s unprofiled; GPU busy {b['busy']:.3f} s "
              f"profiled ({b['busy'] / wall:.0%}), {b['kernels']} kernels")
        for fam, (sec, n) in sorted(b["families"].items(), key=lambda kv: -kv[1][0]):
            print(f"    {fam:30s} {sec * 1e3:8.1f} ms {n:6d} kernels")
        print(ev.table(sort_by="self_device_time_total", row_limit=16, max_name_column_width=50))
        print(ev.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=50))


def host_profile(args) -> None:
    """The prefill's host side (a generate() of one token, first config and batch): its wall time and the
    Python functions it spends it in (cProfile), NVFP4 then BF16. The prefill runs eagerly (no CUDA graph),
    so where it is host-bound this is its time; MINITE_WIDE_PACKED_MAX_M sets the wide tiles' packed path."""
    for label, run in first_runners(args):
        sec = measure(lambda seed: run(seed, 1), max(args.repeats, 3))[0]
        print(f"--- {label} prefill + first token: {sec * 1e3:.1f} ms (gemm.WIDE_PACKED_MAX_M = "
              f"{gemm.WIDE_PACKED_MAX_M}); functions by own time, 3 calls")
        print(cprofiled(lambda: run(1, 1), 3, torch.cuda.synchronize, top=20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="0.6b,1.7b,moe")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=1e9, help="seconds: skip the remaining runs after this")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--profile", action="store_true", help="profile one minite-nvfp4 run of the first config and batch")
    ap.add_argument("--cprofile", action="store_true", help="the prefill's host side by Python function (cProfile)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/rollout.py needs a CUDA device")
    start, default_pdl = time.perf_counter(), pdl.ENABLED
    if args.profile:
        return profile(args)
    if args.cprofile:
        return host_profile(args)
    rows = []
    for name in args.configs.split(","):
        cfg = make_config(name, args.prompt + args.new + 1)
        with tempfile.TemporaryDirectory() as tmp:
            path = random_checkpoint(Path(tmp) / "model", cfg)
            for peer in args.peers.split(","):
                for batch in [int(b) for b in args.batches.split(",")]:
                    if time.perf_counter() - start > args.budget:
                        print(f"{name} {peer} b{batch}: skipped (time budget)", file=sys.stderr)
                        continue
                    try:
                        if peer.startswith("minite"):
                            precision = "nvfp4" if peer.startswith("minite-nvfp4") else "bf16"
                            pdl.ENABLED = peer.endswith("-pdl") or default_pdl  # read at launch (and capture) time
                            knobs = {"matmul": "library", "attention": "sdpa"} if peer.endswith("free") else {}
                            run, keep = minite_runner(path, precision, knobs, batch, args.prompt, args.new)
                        else:
                            run, keep = hf_runner(path, cfg, batch, args.prompt, args.new, peer == "hf-static")
                        sec, tokens = measure(run, args.repeats)
                        row = dict(config=name, peer=peer, batch=batch, seconds=sec, tokens=tokens, tok_s=tokens / sec)
                        if peer.startswith("minite") and args.new > 1:  # the wall time split: prefill, decode steps
                            row["prefill_s"] = measure(lambda seed, run=run: run(seed, 1), args.repeats)[0]
                            row["step_s"] = (sec - row["prefill_s"]) / (args.new - 1)
                        rows.append(row)
                        split = (f"  (prefill + first token {row['prefill_s'] * 1e3:7.1f} ms, a decode step "
                                 f"{row['step_s'] * 1e3:6.3f} ms)" if "step_s" in row else "")
                        print(f"{name:5s} {peer:17s} b{batch:<4d} {sec:8.3f} s {tokens / sec:10.0f} tok/s{split}", flush=True)
                        del run, keep
                    except Exception as e:  # one failing row must not cost the others
                        print(f"{name} {peer} b{batch}: FAILED {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                    pdl.ENABLED = default_pdl
                    torch.cuda.empty_cache()
    print(f"\nrollout decode, {args.prompt}-token prompts, {args.new} new tokens, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    by = {(r["config"], r["peer"], r["batch"]): r["tok_s"] for r in rows}
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{'config':6s} {'peer':17s} " + " ".join(f"{'b' + str(b):>9s}" for b in batches))
    for name in args.configs.split(","):
        for peer in args.peers.split(","):
            vals = [by.get((name, peer, b)) for b in batches]
            print(f"{name:6s} {peer:17s} " + " ".join(f"{v:9.0f}" if v else f"{'-':>9s}" for v in vals))
        for b in batches:
            mine = by.get((name, "minite-nvfp4", b))
            for peer in ("minite-bf16", "hf-static"):
                if mine and by.get((name, peer, b)):
                    print(f"{name} b{b}: minite-nvfp4 / {peer} = {mine / by[(name, peer, b)]:.2f}x")
            steps = {r["peer"]: r for r in rows if (r["config"], r["batch"]) == (name, b) and "step_s" in r}
            if {"minite-nvfp4", "minite-bf16"} <= set(steps):
                n4, b16 = steps["minite-nvfp4"], steps["minite-bf16"]
                print(f"{name} b{b}: decode steps only, minite-nvfp4 / minite-bf16 = {b16['step_s'] / n4['step_s']:.2f}x "
                      f"({n4['step_s'] * 1e3:.3f} vs {b16['step_s'] * 1e3:.3f} ms); prefill "
                      f"{n4['prefill_s'] * 1e3:.1f} vs {b16['prefill_s'] * 1e3:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
