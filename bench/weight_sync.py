"""Weight-sync cost over loopback (CPU is enough): one full UpdateWeights push of a random-weight
Qwen3-0.6B-shaped model to a rollout service in another process, NVFP4 (packed) vs BF16.

    python bench/weight_sync.py [--config 0.6b] [--repeats 6] [--chunk-mb 2] [--shared] [--device cpu|cuda]

For each precision it writes a random checkpoint, starts `minite rollout` on it, and pushes the weights
that precision serves (the learner's re-quantized NVFP4 parts, or bf16 tensors) `--repeats` times, each a
new version. Reported: payload bytes, seconds from the first message to the weights being live (client
side: serialize + stream + receive + CRC + assemble + swap) for the first push and the median of the later
ones, effective GB/s = bytes / seconds. The first two pushes write into fresh memory, whose first-touch page
faults cost more than the copy on this VM; from the third on the receiver recycles a retired version's memory.

`--shared` adds, on the same weights and the same rollout process, the same-host path (UpdateWeightsShared,
services/common/shared_weights.py): seconds per push = the learner writing the version into its arena
(copy + CRC-32 on the CPU, copy + GPU checksum with CUDA) + the RPC (the replica maps the arena, copies,
verifies, assembles, swaps). `--device cuda` (the default when CUDA is available with --shared) holds the
learner's weights on the GPU and starts the rollout with --device cuda: the arena is then a CUDA IPC buffer,
and the gRPC stream pays the device-to-host copies it always pays there.
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
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.learner import CONFIGS, make_config  # noqa: E402
from minite_core.model import load_model  # noqa: E402
from minite_core.model.random_init import random_checkpoint  # noqa: E402
from services.common.rpc import message_options  # noqa: E402
from minite.v1 import rollout_pb2_grpc as pb_grpc  # noqa: E402
from services.common.shared_weights import Arena  # noqa: E402
from services.common.weights import encode_update, push_bytes, raw_update_call  # noqa: E402
from services.up import Proc  # noqa: E402


def _steady(times: list[float]) -> float:
    return statistics.median(times[2:] or times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="0.6b", choices=sorted(CONFIGS))
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--chunk-mb", type=float, default=2.0)
    ap.add_argument("--shared", action="store_true", help="also push through the same-host shared-memory path")
    ap.add_argument("--device", default=None, help="where the weights live (default: cuda with --shared when "
                    "available, else cpu)")
    args = ap.parse_args()
    device = args.device or ("cuda" if args.shared and torch.cuda.is_available() else "cpu")
    token = secrets.token_urlsafe(16)
    env = dict(os.environ, MINITE_AUTH_TOKEN=token)
    auth = (("authorization", f"Bearer {token}"),)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = random_checkpoint(Path(tmp) / "model", make_config(args.config, 4096))
        for precision in ("nvfp4", "bf16"):
            weights = {n: t.to(device) for n, t in load_model(path, precision=precision).w.items()}
            nbytes = push_bytes(weights)
            proc = Proc("rollout", [sys.executable, "-m", "minite_core.cli", "rollout", "--model-dir", str(path),
                                    "--precision", precision, "--grpc-port", "50061", "--http-port", "18061",
                                    "--max-slots", "1", "--max-seq-len", "64", "--device", device],
                        Path(tmp) / f"rollout-{precision}.log", env, "minite-rollout ready")
            try:
                proc.wait_ready(600)
                ch = grpc.insecure_channel("127.0.0.1:50061", options=message_options(8))
                update = raw_update_call(ch)  # as the learner pushes
                times = []
                for v in range(1, args.repeats + 1):
                    t0 = time.perf_counter()
                    resp = update(encode_update(weights, v, chunk_bytes=int(args.chunk_mb * (1 << 20)), raw=True),
                                  metadata=auth, timeout=600)
                    times.append(time.perf_counter() - t0)
                    assert resp.bytes == nbytes and resp.version == v
                rows.append((precision, "grpc", nbytes, times[0], _steady(times), nbytes / _steady(times) / 1e9, None))
                if args.shared:
                    stub, arena = pb_grpc.RolloutServiceStub(ch), Arena()
                    times, rpc_times = [], []
                    for v in range(args.repeats + 1, 2 * args.repeats + 1):
                        t0 = time.perf_counter()
                        arena.write(weights, v)
                        t1 = time.perf_counter()
                        resp = stub.UpdateWeightsShared(arena.request(v), metadata=auth, timeout=600)
                        times.append(time.perf_counter() - t0)
                        rpc_times.append(time.perf_counter() - t1)
                        assert resp.bytes == nbytes and resp.version == v
                    rows.append((precision, f"shared-{arena.buf.device.type}", nbytes, times[0], _steady(times),
                                 nbytes / _steady(times) / 1e9, _steady(rpc_times)))
                ch.close()
            finally:
                proc.stop()
    gpu = f", {torch.cuda.get_device_name()}" if device == "cuda" else ""
    print(f"\nweight push, Qwen3-{args.config} shape (random weights), loopback, {os.cpu_count()} CPU cores{gpu}, "
          f"weights on {device}, chunks of {args.chunk_mb} MiB, {args.repeats} pushes per path")
    print(f"{'precision':10s} {'path':11s} {'MB':>9s} {'first s':>8s} {'steady s':>9s} {'GB/s':>6s} {'rpc s':>6s}")
    for p, how, b, first, st, g, r in rows:
        print(f"{p:10s} {how:11s} {b / 1e6:9.1f} {first:8.2f} {st:9.3f} {g:6.2f} {'' if r is None else f'{r:6.3f}'}")
    grpc_rows = [r for r in rows if r[1] == "grpc"]
    print(f"NVFP4 bytes / BF16 bytes = {grpc_rows[0][2] / grpc_rows[1][2]:.3f}; "
          f"steady time ratio {grpc_rows[0][4] / grpc_rows[1][4]:.2f}")
    for p in ("nvfp4", "bf16"):
        by = {r[1].split("-")[0]: r for r in rows if r[0] == p}
        if "shared" in by:
            print(f"{p}: shared / grpc steady seconds = {by['shared'][4] / by['grpc'][4]:.3f}")


if __name__ == "__main__":
    main()
