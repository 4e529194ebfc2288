"""The `minite` command line.

    minite demo [--backend torch|triton] [--m M --n N --k K]

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
    xq = ops.quantize_activation(x, backend=args.backend)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="minite", description="miniTE: NVFP4 RL with bitwise-consistent engines")
    sub = ap.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="W4A4 linear: accuracy and batch invariance on random data")
    demo.add_argument("--backend", choices=["torch", "triton"], default="torch")
    demo.add_argument("--m", type=int, default=64)
    demo.add_argument("--n", type=int, default=256)
    demo.add_argument("--k", type=int, default=512)
    args = ap.parse_args(argv)
    for name in ("m", "n", "k"):
        if getattr(args, name, 1) <= 0:
            ap.error(f"--{name} must be positive")
    if getattr(args, "k", 16) % 16:
        ap.error("--k must be a multiple of 16 (the NVFP4 block size)")
    if args.cmd == "demo":
        return _demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
