"""Host time per call of the learner's and the rollout's ops at tiny sizes (GPU): what one call costs the host
when the GPU keeps up, so whether a host-bound step is paying per launch, and for which op.

    python bench/launch_cost.py [--calls 200] [--cprofile gemm_kernel,quantize] [--stages]

Each op runs on inputs so small that the GPU finishes a call faster than the host issues the next; the time
of `calls` calls back to back, without a sync between them, divided by `calls`, is then the host's cost of
one call (Python, torch dispatch, Triton's launch path, the CUDA launch), not the GPU's. A torch op and a
cuBLAS matmul are the floor; the rows below them are miniTE's: a Triton kernel called directly (its
launcher alone), then the `ops` functions the engines call (checks, buffers, the launch), then an NVFP4 and
a BF16 `linears` forward and backward through autograd as the learner runs them. On the 2026-12-06 H100 the
NVFP4 learner step's forward and backward were host-bound by ~30 and ~76 ms more than BF16's, with only 28
and 112 Triton launches more (docs/benchmarks.md); this table says whether a launch of ours costs tens of
microseconds there or hundreds.

`--cprofile` names substrings of rows: each such row runs again under cProfile and its top functions by own
time are printed (where a launch's host time goes: our wrapper, Triton's binder and cache key, its C launcher).

`--stages` (GPU only) splits the Triton launches of the GEMM, the quantize and the dequantize into the steps of
Triton's `JITFunction.run`: the binder (arguments -> specialization key), the cache key, the globals check,
the launch metadata and the C launcher (`CompiledKernel.run`), each timed alone on the arguments of a
captured call: what a launcher that skipped Triton's Python could save. (Triton internals: 3.6 and 3.9.)

`--device cpu` runs the same calls on the CPU under the Triton interpreter (the tests: the script's paths,
not a measurement).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def host_us(fn, calls: int, sync, warmup: int = 3) -> float:
    """The host's cost of one call of `fn`, µs: `calls` calls issued back to back, then one sync."""
    for _ in range(warmup):  # compile, fill the allocator
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / calls * 1e6


def cases(device: str) -> list[tuple[str, object]]:
    """(name, a call) of every op timed, on tiny inputs on `device`."""
    import torch

    from minite_core import ops
    from minite_core.kernels import gemm, quantize

    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *sh: torch.randn(*sh, device=device, generator=g)  # noqa: E731
    bf16 = torch.bfloat16
    # M > SWAP_MAX_M: the wide tiles, as a learner step's and a prefill's GEMMs take them (smaller on the CPU dry run)
    m, k, n = (gemm.SWAP_MAX_M + 128, 128, 128) if device == "cuda" else (gemm.SWAP_MAX_M + 8, 64, 32)
    x = rnd(m, k).to(bf16)
    xq = ops.quantize(x, backend="triton", check_finite=False, decoded=True)
    master = rnd(n, k) * 0.05
    w_packed, = ops.quantize_weights([master], backend="triton")  # the rollout's: no decoded form
    w_learner, = ops.quantize_weights([master], backend="triton", decoded=True, dequantized=True)
    w_bf16 = master.to(bf16)
    masters = [master.clone().requires_grad_(True) for _ in range(3)]
    x_grad = x.clone().requires_grad_(True)

    def linears_fwd_bwd(ws):
        outs = ops.linears(x_grad, ws, backend="triton", check_finite=False, masters=masters)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return [
        ("torch add (floor)", lambda: x.add(1)),
        ("torch.mm bf16 (cuBLAS)", lambda: torch.mm(x, w_bf16.T)),
        ("triton _dequantize_kernel (launcher)", lambda: quantize.dequantize_triton(xq, bf16)),
        ("triton _decode_kernel (launcher)", lambda: gemm.decode_nvfp4(w_packed, gemm.fp4_block_k())),
        ("triton _quantize_kernel (launcher)", lambda: quantize.quantize_triton(x, None)),
        ("triton _gemm_kernel bf16 (launcher)", lambda: gemm.gemm_triton(x, w_bf16, None, bf16)),
        ("triton _gemm_kernel nvfp4, decoded operands", lambda: gemm.gemm_triton(xq, w_learner, None, bf16)),
        ("triton _gemm_kernel nvfp4, weight decoded per call", lambda: gemm.gemm_triton(xq, w_packed, None, bf16)),
        ("ops.dequantize", lambda: ops.dequantize(xq, bf16, backend="triton")),
        ("ops.quantize (decoded form too)", lambda: ops.quantize(x, backend="triton", check_finite=False, decoded=True)),
        ("ops.linears bf16 x3, forward", lambda: ops.linears(x, [w_bf16] * 3, backend="triton", check_finite=False)),
        ("ops.linears nvfp4 x3, forward", lambda: ops.linears(x, [w_learner] * 3, backend="triton", check_finite=False)),
        ("ops.linears bf16 x3, fwd + bwd (masters)", lambda: linears_fwd_bwd([w_bf16] * 3)),
        ("ops.linears nvfp4 x3, fwd + bwd (masters)", lambda: linears_fwd_bwd([w_learner] * 3)),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--cprofile", default="", help="comma-separated substrings of the rows to profile with cProfile")
    ap.add_argument("--stages", action="store_true", help="time the steps of Triton's launch path (GPU only)")
    args = ap.parse_args()
    if args.calls < 1:
        ap.error(f"--calls must be at least 1, got {args.calls}")
    if args.device == "cpu":
        if args.stages:
            ap.error("--stages times Triton's compiled launch path: it needs --device cuda")
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
    import torch

    from bench.common import cprofiled

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/launch_cost.py needs a CUDA GPU (or --device cpu for a dry run)")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    warmup = 3 if args.device == "cuda" else 1
    ops_ = cases(args.device)
    rows = [(name, host_us(fn, args.calls, sync, warmup)) for name, fn in ops_]
    print(f"host time per call, {args.calls} calls back to back, tiny inputs, {args.device}")
    for name, us in rows:
        print(f"launch {name:52s} {us:9.1f} us")
    wanted = [w for w in args.cprofile.split(",") if w]
    for name, fn in ops_:
        if any(w in name for w in wanted):
            print(f"\ncprofile {name}: {args.calls} calls, functions by own time")
            print(cprofiled(fn, args.calls, sync))
    if args.stages:
        launch_stages(args.calls, sync)


def launch_stages(calls: int, sync) -> None:
    """Print the host time of each step of Triton's `JITFunction.run` for three of our kernels' launches."""
    import torch
    import triton.runtime.jit as jit
    from triton import knobs
    from triton.runtime.driver import driver

    from minite_core import ops
    from minite_core.kernels import gemm, quantize

    captured, run = {}, jit.JITFunction.run

    def spy(self, *args, grid, warmup, **kwargs):  # the last call's arguments of each kernel
        kernel = run(self, *args, grid=grid, warmup=warmup, **kwargs)
        captured[self.fn.__name__] = (self, kernel, grid, args, dict(kwargs))
        return kernel

    bf16 = torch.bfloat16
    x = torch.randn(256, 128, device="cuda").to(bf16)
    w = (torch.randn(128, 128, device="cuda") * 0.05).to(bf16)
    xq = ops.quantize(x, backend="triton", check_finite=False)
    launchers = {"_gemm_kernel": lambda: gemm.gemm_triton(x, w, None, bf16),
                 "_quantize_kernel": lambda: quantize.quantize_triton(x, None),
                 "_dequantize_kernel": lambda: quantize.dequantize_triton(xq, bf16)}
    jit.JITFunction.run = spy
    try:
        for launcher in launchers.values():
            launcher()
    finally:
        jit.JITFunction.run = run
    print(f"\nTriton's launch path, µs a call ({calls} calls back to back)")
    for name, launcher in launchers.items():
        fn, kernel, grid, args, kwargs = captured[name]
        options = dict(kwargs, debug=kwargs.get("debug", fn.debug) or knobs.runtime.debug,
                       instrumentation_mode=knobs.compilation.instrumentation_mode)
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        _, key_cache, _, _, binder = fn.device_caches[device]
        bound, spec, opts = binder(*args, **options)
        values = list(bound.values())
        g = tuple(grid(bound) if callable(grid) else grid) + (1, 1)
        steps = {
            "our launcher + Triton": launcher,
            "Triton's run": lambda: fn[grid](*args, **kwargs),
            "binder": lambda: binder(*args, **options),
            "cache key": lambda: jit.compute_cache_key(key_cache, spec, opts),
            "globals check": lambda: [d.get(n) != v for (n, _), (v, d) in fn.used_global_vals.items()],
            "launch metadata": lambda: kernel.launch_metadata(g[:3], stream, *values),
            "C launcher": lambda: kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                                             None, None, None, *values),
        }
        cells = "; ".join(f"{step} {host_us(f, calls, sync):.1f}" for step, f in steps.items())
        print(f"stages {name} ({len(args)} arguments + {len(kwargs)} keywords): {cells}")


if __name__ == "__main__":
    main()
