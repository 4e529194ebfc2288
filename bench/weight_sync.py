"""Weight-sync cost over loopback (CPU is enough): one full UpdateWeights push of a random-weight
Qwen3-0.6B-shaped model to a rollout service in another process, NVFP4 (packed) vs BF16.

    python bench/weight_sync.py [--config 0.6b] [--repeats 6] [--chunk-mb 2]

For each precision it writes a random checkpoint, starts `minite rollout` on it, and pushes the weights
that precision serves (the learner's re-quantized NVFP4 parts, or bf16 tensors) `--repeats` times, each a
new version. Reported: payload bytes, seconds from the first message to the weights being live (client
side: serialize + stream + receive + CRC + assemble + swap) for the first push and the median of the later
ones, effective GB/s = bytes / seconds. The first two pushes write into fresh memory, whose first-touch page
faults cost more than the copy on this VM; from the third on the receiver recycles a retired version's memory.
"""
from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.learner import CONFIGS, make_config  # noqa: E402
from minite_core.model import load_model  # noqa: E402
from minite_core.model.random_init import random_checkpoint  # noqa: E402
from services.common.rpc import message_options  # noqa: E402
from services.common.weights import encode_update, push_bytes, raw_update_call  # noqa: E402
from services.up import Proc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="0.6b", choices=sorted(CONFIGS))
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--chunk-mb", type=float, default=2.0)
    args = ap.parse_args()
    token = secrets.token_urlsafe(16)
    env = dict(os.environ, MINITE_AUTH_TOKEN=token)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = random_checkpoint(Path(tmp) / "model", make_config(args.config, 4096))
        for precision in ("nvfp4", "bf16"):
            weights = load_model(path, precision=precision).w
            nbytes = push_bytes(weights)
            proc = Proc("rollout", [sys.executable, "-m", "minite_core.cli", "rollout", "--model-dir", str(path),
                                    "--precision", precision, "--grpc-port", "50061", "--http-port", "18061",
                                    "--max-slots", "1", "--max-seq-len", "64"],
                        Path(tmp) / f"rollout-{precision}.log", env, "minite-rollout ready")
            try:
                proc.wait_ready(600)
                ch = grpc.insecure_channel("127.0.0.1:50061", options=message_options(8))
                update = raw_update_call(ch)  # as the learner pushes
                times = []
                for v in range(1, args.repeats + 1):
                    t0 = time.perf_counter()
                    resp = update(encode_update(weights, v, chunk_bytes=int(args.chunk_mb * (1 << 20)), raw=True),
                                  metadata=(("authorization", f"Bearer {token}"),), timeout=600)
                    times.append(time.perf_counter() - t0)
                    assert resp.bytes == nbytes and resp.version == v
                ch.close()
            finally:
                proc.stop()
            med = statistics.median(times[2:] or times)
            rows.append((precision, nbytes, times[0], med, nbytes / med / 1e9))
    print(f"\nweight push, Qwen3-{args.config} shape (random weights), loopback, {os.cpu_count()} CPU cores, "
          f"chunks of {args.chunk_mb} MiB, {args.repeats} pushes")
    print(f"{'precision':10s} {'MB':>9s} {'first s':>8s} {'steady s':>9s} {'GB/s':>6s}")
    for p, b, first, s, g in rows:
        print(f"{p:10s} {b / 1e6:9.1f} {first:8.2f} {s:9.2f} {g:6.2f}")
    print(f"NVFP4 bytes / BF16 bytes = {rows[0][1] / rows[1][1]:.3f}; steady time ratio {rows[0][3] / rows[1][3]:.2f}")


if __name__ == "__main__":
    main()
