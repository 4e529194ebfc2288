"""Data-parallel learner throughput: tokens/s per rank of the Trainer's step under torchrun (FSDP2 or DDP),
and a bitwise check that every rank scores a probe sequence to the same logprobs after the steps.

    python3 -m torch.distributed.run --standalone --nproc-per-node N bench/learner_dp.py \
        [--config 1.7b] [--batch 4] [--seq 2048] [--steps 5] [--data-parallel fsdp] [--baseline TOKENS_PER_S]

Weak scaling: every rank takes `--batch` sequences, so the global batch grows with N. The step is the
data-parallel Trainer's (minite_core/rl/distributed.py): the masters gathered for the forward (W4A4 on
the Triton backend), a token-mean loss, backward with the fp32 gradient reduction, clip, AdamW, then every
rank re-quantizes the whole masters into the weights a rollout would serve. Scaling efficiency = tokens/s
per rank at N over the single-rank figure (`--baseline`, from a run with --nproc-per-node 1).
On a CPU host (`--device cpu --backend torch --config tiny`) it checks the mechanics with gloo.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import CONFIGS, make_config  # noqa: E402
from minite_core.model import load_model  # noqa: E402
from minite_core.model.random_init import random_checkpoint  # noqa: E402
from minite_core.nvfp4 import NVFP4Tensor  # noqa: E402
from minite_core.rl import distributed  # noqa: E402
from minite_core.rl.tiny import TINY  # noqa: E402
from minite_core.rl.step import LearnerState, make_optimizer  # noqa: E402


def digest(weights: dict) -> str:
    """SHA-256 of the served weights' bytes (every NVFP4 part), in name order."""
    h = hashlib.sha256()
    for n in sorted(weights):
        t = weights[n]
        for part in ((t.data, t.scale, t.global_scale) if isinstance(t, NVFP4Tensor) else (t,)):
            h.update(part.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="1.7b", choices=sorted(CONFIGS) + ["tiny"])
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--data-parallel", default="fsdp", choices=["fsdp", "ddp"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton", choices=["torch", "triton"])
    ap.add_argument("--baseline", type=float, default=None, help="tokens/s of one rank alone (for the efficiency)")
    args = ap.parse_args()
    group = distributed.setup(args.data_parallel)
    device = group.device if args.device == "cuda" else torch.device(args.device)
    cfg = TINY if args.config == "tiny" else make_config(args.config, args.seq)
    seq = min(args.seq, cfg.max_position_embeddings)
    with tempfile.TemporaryDirectory() as tmp:
        path = group.broadcast(str(random_checkpoint(Path(tmp) / "model", cfg, seed=0)) if group.leader else None)
        knobs = {} if args.backend == "triton" else {"attention": "sdpa"}
        policy = load_model(path, precision="nvfp4", backend=args.backend, device=device, knobs=knobs)
        fp32 = load_model(path, precision="fp32", device=device)
        group.barrier()  # (every rank has read the checkpoint before rank 0's directory goes)
    inner = distributed.Masters(fp32.w)
    del fp32
    module = distributed.wrap(inner, group)
    masters = {n: inner.get_parameter(n) for n in inner.names}
    state = LearnerState(policy, masters, make_optimizer(masters.values(), lr=1e-5), max_grad_norm=1.0)
    g = torch.Generator().manual_seed(1000 + group.rank)  # each rank its own rows
    ids = torch.randint(0, cfg.vocab_size, (args.batch, seq), generator=g).tolist()
    prompts, completions = [s[:1] for s in ids], [s[1:] for s in ids]

    def step():  # the Trainer's data-parallel step: gathered masters forward, sharded optimizer
        weights = distributed.step_masters(module)
        loss = -torch.cat(state.logprobs(prompts, completions, masters=weights)).mean() + distributed.touch(weights.unread())
        state.optimize(loss, after_backward=lambda: distributed.drop_unread(masters, weights.read))
        state.requantize(distributed.full(masters))

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(args.steps + 2):  # two warm-up steps
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    tps = args.batch * (seq - 1) / statistics.median(times)
    probe = torch.randint(0, cfg.vocab_size, (seq,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        lp = state.learner.logprobs(probe[:1], probe[1:]).cpu()
    rows = group.gather((tps, digest(policy.w), hashlib.sha256(lp.numpy().tobytes()).hexdigest(),
                         torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0))
    if group.leader:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        print(f"\ndata-parallel learner ({args.data_parallel}), Qwen3-{args.config} shape, {group.world} rank(s) x "
              f"batch {args.batch} x seq {seq}, NVFP4 W4A4 ({args.backend}), {name}, torch {torch.__version__}")
        print(f"{'rank':>4s} {'tokens/s':>10s} {'peak GiB':>9s}")
        for r, (t, _, _, mem) in enumerate(rows):
            print(f"{r:4d} {t:10.0f} {mem:9.1f}")
        per = statistics.mean(r[0] for r in rows)
        print(f"total {per * group.world:.0f} tokens/s, {per:.0f} per rank"
              + (f", scaling efficiency {per / args.baseline:.2f} of --baseline {args.baseline:.0f}" if args.baseline else ""))
        print(f"served weights identical on every rank: {len({r[1] for r in rows}) == 1}; "
              f"probe logprobs bitwise equal on every rank: {len({r[2] for r in rows}) == 1}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
