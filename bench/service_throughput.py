"""Request throughput of the rollout service on the built-in tiny model (CPU is enough): gRPC Generate vs
REST /v1/completions, closed loop with C concurrent clients for D seconds each.

    python bench/service_throughput.py [--model-dir runs/tiny-model] [--clients 16] [--seconds 10]

Each request is an addition prompt with n=1, max_tokens 4 (what the RL job sends, one sample per call).
Reported: requests/s, generated tokens/s, median and p95 request latency. The rollout runs in its own
process (`minite rollout`, NVFP4, torch backend); clients are threads of this process.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minite.v1 import rollout_pb2 as pb  # noqa: E402
from minite.v1 import rollout_pb2_grpc  # noqa: E402
from minite_core.rl.addition import AdditionRows, build_tokenizer  # noqa: E402
from services.up import Proc  # noqa: E402


def closed_loop(call, clients: int, seconds: float):
    lat, toks, stop = [], [], time.monotonic() + seconds
    lock = threading.Lock()

    def worker(i):
        rng, rows, tok = random.Random(i), AdditionRows(2), build_tokenizer()
        while time.monotonic() < stop:
            prompt = tok.encode(rows[rng.randrange(len(rows))]["prompt"]).ids
            t0 = time.perf_counter()
            n = call(prompt, random.randrange(1 << 30))
            with lock:
                lat.append(time.perf_counter() - t0)
                toks.append(n)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    return len(lat) / wall, sum(toks) / wall, statistics.median(lat), lat[int(0.95 * (len(lat) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="runs/tiny-model")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    if not (Path(args.model_dir) / "config.json").exists():
        sys.exit(f"{args.model_dir} has no model: `minite build-model --out {args.model_dir}` first")
    with tempfile.TemporaryDirectory() as tmp:
        proc = Proc("rollout", [sys.executable, "-m", "minite_core.cli", "rollout", "--model-dir", args.model_dir,
                                "--grpc-port", "50071", "--http-port", "18071", "--max-slots", "64"],
                    Path(tmp) / "rollout.log", dict(os.environ), "minite-rollout ready")
        try:
            proc.wait_ready(300)
            ch = grpc.insecure_channel("127.0.0.1:50071")
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)

            def grpc_call(prompt, seed):
                r = stub.Generate(pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=prompt), params=pb.SamplingParams(
                    max_tokens=4, seed=seed, stop_token_ids=[2])), timeout=60)
                return len(r.choices[0].token_ids)

            http = httpx.Client(limits=httpx.Limits(max_connections=args.clients), timeout=60)

            def rest_call(prompt, seed):
                r = http.post("http://127.0.0.1:18071/v1/completions",
                              json={"prompt": prompt, "max_tokens": 4, "seed": seed, "stop_token_ids": [2]})
                r.raise_for_status()
                return len(r.json()["choices"][0]["token_ids"])

            closed_loop(grpc_call, 2, 1.0)  # warm-up
            rows = [("gRPC Generate", *closed_loop(grpc_call, args.clients, args.seconds)),
                    ("REST /v1/completions", *closed_loop(rest_call, args.clients, args.seconds))]
        finally:
            proc.stop()
    print(f"\nrollout service, built-in tiny model (NVFP4, torch backend), {os.cpu_count()} CPU cores, "
          f"{args.clients} concurrent clients, {args.seconds:.0f} s each")
    print(f"{'API':22s} {'req/s':>7s} {'tok/s':>7s} {'p50 ms':>7s} {'p95 ms':>7s}")
    for name, rps, tps, p50, p95 in rows:
        print(f"{name:22s} {rps:7.1f} {tps:7.1f} {p50 * 1e3:7.1f} {p95 * 1e3:7.1f}")


if __name__ == "__main__":
    main()
