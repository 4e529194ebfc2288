"""The `minite` command line.

    minite demo [--backend torch|triton] [--m M --n N --k K]
    minite train [--config run.toml] [--model-dir DIR --dataset FILE --reward FILE.py:NAME ...] [--resume]
    minite export RUN_DIR --out DIR [--format hf|compressed-tensors|modelopt]
    minite diagnose [--model DIR] [--precision nvfp4] [--rollout-knob K=V ...] [--learner-knob K=V ...] [--out DIR]

`demo` shows the core promise on random data: an NVFP4 (W4A4) linear layer whose output rows are
bit-identical whether a row is computed alone or inside a batch, with its error against an fp64
reference, and the same check for a library matmul (which is not batch-invariant).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _demo(args) -> int:
    import torch

    if args.backend == "triton" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' definition
    from . import nvfp4, ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(args.m, args.k, generator=g) * torch.exp(torch.randn(args.m, 1, generator=g))).to(device)
    w = (torch.randn(args.n, args.k, generator=g) * 0.05).to(device)
    wq = nvfp4.quantize(w, scale_mode="tensor")
    print(f"miniTE demo: x [{args.m}, {args.k}] @ w [{args.n}, {args.k}].T on {device}, backend {args.backend}")
    print(f"  weight bytes: bf16 {w.numel() * 2:,} -> NVFP4 {wq.nbytes:,} ({wq.nbytes / (w.numel() * 2):.2f}x)")

    t0 = time.perf_counter()
    y = ops.linear(x, wq, backend=args.backend)
    t1 = time.perf_counter()
    xq = ops.quantize(x, backend=args.backend)
    ref = xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).T
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    rows = [0, args.m // 2, args.m - 1]
    alone = all(torch.equal(ops.linear(x[i:i + 1], wq, backend=args.backend), y[i:i + 1]) for i in rows)
    lib = x @ w.T
    lib_alone = all(torch.equal(x[i:i + 1] @ w.T, lib[i:i + 1]) for i in rows)
    quant_err = ((xq.dequantize() - x).norm() / x.norm()).item()
    print(f"  activation quantize error (rel. L2):        {quant_err:.4f}")
    print(f"  W4A4 GEMM vs fp64 on the same operands:      {rel:.2e}   ({(t1 - t0) * 1e3:.1f} ms)")
    print(f"  W4A4 row alone == row in batch (bitwise):    {alone}")
    print(f"  library matmul row alone == row in batch:    {lib_alone}")
    return 0 if alone else 1


def _parse_knobs(items: list[str]) -> dict:
    knobs = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"a knob is NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        knobs[k] = v
    return knobs


def _diagnose(args) -> int:
    import tempfile
    from pathlib import Path

    import torch

    from .consistency.diagnose import diagnose, write_report
    from .engine import SamplingParams
    from .model import load_model
    from .model.qwen3 import Qwen3Config
    from .model.random_init import random_checkpoint

    path = args.model
    if path is None:  # a random-weight tiny Qwen3, made here
        path = tempfile.mkdtemp(prefix="minite-diagnose-")
        random_checkpoint(path, Qwen3Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                            max_position_embeddings=512), seed=args.seed)
    kw = dict(precision=args.precision, backend=args.backend)
    rollout = load_model(path, knobs=_parse_knobs(args.rollout_knob), **kw)
    learner = load_model(path, knobs=_parse_knobs(args.learner_knob), **kw)
    g = torch.Generator().manual_seed(args.seed)
    vocab = rollout.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 48, (args.prompts,), generator=g)]
    report = diagnose(rollout, learner, prompts, SamplingParams(max_tokens=args.max_tokens, seed=args.seed),
                      max_slots=args.slots, max_seq_len=64 + args.max_tokens)
    print(f"rollout: {args.precision} knobs {_parse_knobs(args.rollout_knob) or 'none'}; "
          f"learner: knobs {_parse_knobs(args.learner_knob) or 'none'}; {args.prompts} prompts, {args.slots} slots")
    print(report.table())
    out = Path(args.out)
    write_report(report, out)
    print(f"wrote {out / 'diagnose.json'} and {out / 'diagnose.png'}")
    return 0


def train(argv: list[str]) -> int:
    """`minite train`: one RL run in one process (the settings: rl/config.py RunConfig)."""
    import json
    from pathlib import Path

    from .rl import distributed
    from .rl.config import RunConfig, parse
    from .rl.loop import run
    from .rl.tiny import install_tiny_model

    cfg = parse(RunConfig, argv, "minite train")
    try:
        group = distributed.setup(cfg.data_parallel)  # under torchrun: this rank's place (None: one process)
        lead = group is None or group.leader
        stopped = _stop_on_signals(graceful=group is None)
        model_dir = cfg.model_path
        if not cfg.builtin_model and not (model_dir / "config.json").exists():
            raise FileNotFoundError(f"{model_dir} has no config.json (leave out --model-dir to use the built-in model)")
        if lead and not (model_dir / "config.json").exists():
            install_tiny_model(model_dir, seed=cfg.seed, moe=cfg.moe)
        if group is not None:
            group.barrier()
        history = run(cfg, stop=lambda: bool(stopped))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"minite train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the second Ctrl-C: now, in the middle of a step
        print("minite train: interrupted (the run directory keeps the last checkpoint; --resume continues from it)",
              file=sys.stderr)
        return 130
    if group is not None:
        group.barrier()
        import torch.distributed

        torch.distributed.destroy_process_group()
    if not lead:
        return 0
    run_dir = Path(cfg.run_dir)
    if stopped:
        print(f"minite train: stopped after step {history[-1]['step'] if history else 'none'} of {cfg.steps} "
              f"({stopped[0].name}); checkpoint: {run_dir / 'checkpoint'} (--resume continues from it)",
              file=sys.stderr)
        return 128 + stopped[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    b, a = summary.get("before", {}), summary.get("after", {})
    k = min(10, len(history))
    if "eval/reward" in b and "eval/reward" in a:
        print(f"greedy eval reward: {b['eval/reward']:.3f} -> {a['eval/reward']:.3f} "
              f"(reaching {cfg.pass_threshold:g}: {b['eval/accuracy']:.2f} -> {a['eval/accuracy']:.2f})")
    if history:
        drift = max(m["sampling/sampling_logp_difference/max"] for m in history)
        print(f"training reward, mean of the first/last {k} steps: {sum(m['reward'] for m in history[:k]) / k:.3f} -> "
              f"{sum(m['reward'] for m in history[-k:]) / k:.3f}; max rollout/learner |Δlogp| over the run: {drift:g} "
              f"({cfg.precision}); {len(history)} steps, {sum(m['seconds'] for m in history):.0f} s")
    print(f"metrics: {run_dir / 'metrics.jsonl'}, plot: {run_dir / 'reward_drift.png'}")
    return 0


def _stop_on_signals(graceful: bool) -> list:
    """SIGINT / SIGTERM end a one-process `minite train` after the step in progress, which is then checkpointed
    (the loop's `stop`); a second SIGINT stops at once (KeyboardInterrupt). Returns the list the first signal
    is put in. SIGINT is handled even where the shell started the run with SIGINT ignored (a script's
    background job), as `minite up` does. Under torchrun (`graceful` False) a signal stops every rank at once:
    torchrun passes it on to the ranks and kills those that do not end, so no rank could finish a step."""
    import signal

    stopped: list = []
    if not graceful:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return stopped

    def on_signal(signum, frame):
        if stopped:
            raise KeyboardInterrupt
        stopped.append(signal.Signals(signum))
        print(f"\nminite train: {stopped[0].name}: stopping after the step in progress (Ctrl-C again to stop now)",
              file=sys.stderr, flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stopped


SERVICES = {  # subcommands with their own settings parser (pydantic-settings: flags + MINITE_* env vars)
    "train": "minite_core.cli:train",
    "export": "minite_core.export:main",
    "rollout": "services.rollout.main",
    "learner": "services.learner.main",
    "up": "services.up",
}


def _build_model(args) -> int:
    from .rl.tiny import build_tiny_model, install_tiny_model

    if args.rebuild or args.moe or args.seed != 0:
        build_tiny_model(args.out, seed=args.seed, moe=args.moe)
        print(f"built the tiny model in {args.out}")
    else:
        install_tiny_model(args.out)
        print(f"copied the built-in tiny model (shipped, seed 0) to {args.out}; --rebuild runs its warm-up here")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("minite")
    except PackageNotFoundError:  # a checkout that was not installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:
        import importlib

        module, _, fn = SERVICES[argv[0]].partition(":")
        return getattr(importlib.import_module(module), fn or "main")(argv[1:])
    ap = argparse.ArgumentParser(prog="minite", description="miniTE: NVFP4 RL with bitwise-consistent engines; "
                                 "also `minite train|export|rollout|learner|up --help`")
    ap.add_argument("--version", action="version", version=f"minite {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="W4A4 linear: accuracy and batch invariance on random data")
    demo.add_argument("--backend", choices=["torch", "triton"], default="torch")
    demo.add_argument("--m", type=int, default=64)
    demo.add_argument("--n", type=int, default=256)
    demo.add_argument("--k", type=int, default=512)
    diag = sub.add_parser("diagnose", help="compare a rollout configuration with a learner configuration, op by op")
    diag.add_argument("--model", default=None, help="HF checkpoint directory (default: a random tiny Qwen3)")
    diag.add_argument("--precision", choices=["fp32", "bf16", "nvfp4"], default="nvfp4")
    diag.add_argument("--backend", choices=["torch", "triton"], default="torch")
    diag.add_argument("--rollout-knob", action="append", metavar="NAME=VALUE",
                      help="a misalignment knob for the rollout engine, e.g. matmul=library (repeatable)")
    diag.add_argument("--learner-knob", action="append", metavar="NAME=VALUE")
    diag.add_argument("--prompts", type=int, default=8)
    diag.add_argument("--max-tokens", type=int, default=16)
    diag.add_argument("--slots", type=int, default=4)
    diag.add_argument("--seed", type=int, default=0)
    diag.add_argument("--out", default="runs/diagnose")
    build = sub.add_parser("build-model", help="the tiny model in --out: the shipped one (dense, seed 0), or built by "
                                                 "its supervised warm-up (--rebuild, --moe, another --seed)")
    build.add_argument("--out", default="runs/tiny-model")
    build.add_argument("--moe", action="store_true")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--rebuild", action="store_true", help="run the warm-up here even for the shipped model")
    args = ap.parse_args(argv)
    for name in ("m", "n", "k", "prompts", "max_tokens", "slots"):
        if getattr(args, name, 1) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if getattr(args, "k", 16) % 16:
        ap.error("--k must be a multiple of 16 (the NVFP4 block size)")
    try:
        if args.cmd == "demo":
            return _demo(args)
        if args.cmd == "build-model":
            return _build_model(args)
        return _diagnose(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"minite {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
