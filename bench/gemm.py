"""W4A4 GEMM and activation-quantize benchmark (GPU): the table in docs/benchmarks.md.

    python bench/gemm.py [--quick] [--json out.json]

For each shape (N, K) and M it times, with triton.testing.do_bench_cudagraph (median of CUDA-graph replays):
  cublas-bf16   torch.matmul(x_bf16, w_bf16.T)
  fp8-scaled-mm torch._scaled_mm on e4m3 operands (per-tensor scales), bf16 out
  naive-deq     torch: dequantize the NVFP4 weight to bf16, then torch.matmul (what a user would write)
  minite-w4a4   ops.linear on an NVFP4 weight: fused activation quantize + W4A4 GEMM (end to end)
  minite-gemm   the W4A4 GEMM kernel alone on pre-quantized activations
and the activation-quantize kernel's bandwidth against a plain device copy. It also checks, on the GPU,
that the narrow small-M tile config gives the same bits as the default one (the condition for
SMALL_M_TILES), and that the W4A4 output is invariant: row i of an M-row product == the 1-row product.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minite_core import nvfp4, ops  # noqa: E402
from minite_core.kernels import gemm as gemm_mod  # noqa: E402
from minite_core.kernels.quantize import quantize_triton  # noqa: E402

SHAPES = [(12288, 4096), (1536, 2048)]  # a dense projection; a MoE expert's gate_up (Qwen3-30B-A3B)
MS = [1, 16, 64, 256, 1024, 4096, 8192]


def bench(fn) -> float:
    """Median seconds of fn replayed from a CUDA graph: GPU time without Python launch overhead (which,
    at a few tens of microseconds per Triton launch, would otherwise dominate every small case)."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3


def tile_config_check(n: int, k: int) -> dict:
    """Do the narrow small-M tiles give the same bits as the default tiles (GPU)? And is W4A4 invariant?"""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = nvfp4.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02, scale_mode="tensor")
    x = torch.randn(4096, k, device="cuda", generator=g, dtype=torch.bfloat16)
    xq = quantize_triton(x, None)
    default = gemm_mod.SMALL_M_TILES
    gemm_mod.SMALL_M_TILES = False
    big = gemm_mod.gemm_triton(xq, w, None, torch.bfloat16)
    same_tiles, invariant = True, True
    for lo in range(0, 4096, 512):
        rows = nvfp4.NVFP4Tensor(xq.data[lo:lo + 16], xq.scale[lo:lo + 16], xq.global_scale[lo:lo + 16], (16, k))
        gemm_mod.SMALL_M_TILES = True
        small = gemm_mod.gemm_triton(rows, w, None, torch.bfloat16)
        gemm_mod.SMALL_M_TILES = False
        same_tiles &= torch.equal(small, big[lo:lo + 16])
        gemm_mod.SMALL_M_TILES = default
        one = ops.linear(x[lo:lo + 1], w, backend="triton")
        invariant &= torch.equal(one, ops.linear(x[: lo + 300], w, backend="triton")[lo:lo + 1])
    gemm_mod.SMALL_M_TILES = default
    return {"small_tiles_same_bits": bool(same_tiles), "invariant": bool(invariant)}


def run(quick: bool) -> list[dict]:
    rows = []
    ms = [1, 16, 4096] if quick else MS
    for n, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        w32 = torch.randn(n, k, device="cuda", generator=g) * 0.02
        w_bf16 = w32.to(torch.bfloat16)
        wq = nvfp4.quantize(w32, scale_mode="tensor")
        w_f8 = w32.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            xq = quantize_triton(x, None)
            x_f8 = x.to(torch.float8_e4m3fn)
            r = {"N": n, "K": k, "M": m}
            r["cublas-bf16"] = bench(lambda: torch.matmul(x, w_bf16.T))
            try:
                r["fp8-scaled-mm"] = bench(lambda: torch._scaled_mm(x_f8, w_f8.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            except RuntimeError:
                r["fp8-scaled-mm"] = None
            r["naive-deq"] = bench(lambda: torch.matmul(x, wq.dequantize(torch.bfloat16).T))
            r["minite-w4a4"] = bench(lambda: ops.linear(x, wq, backend="triton", check_finite=False))
            r["minite-gemm"] = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
            if m <= 16:  # the wide tiles, for comparison
                gemm_mod.SMALL_M_TILES = False
                r["minite-gemm-wide-tiles"] = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                gemm_mod.SMALL_M_TILES = True
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def quantize_bandwidth() -> dict:
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    t_copy = bench(lambda: dst.copy_(x))
    t_q = bench(lambda: quantize_triton(x, None))
    copy_bytes = 2 * x.numel() * x.element_size()
    q_bytes = x.numel() * x.element_size() + x.numel() // 2 + x.numel() // 16 + 4 * x.shape[0]
    return {"copy_GBps": copy_bytes / t_copy / 1e9, "quantize_GBps": q_bytes / t_q / 1e9,
            "ratio": (q_bytes / t_q) / (copy_bytes / t_copy)}


SWEEP = [  # fixed configs to compare (BLOCK_K must stay 128: the K order is shared by all M buckets)
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=2, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, SWAP_AB=True),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, SWAP_AB=True),
    dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, SWAP_AB=True),
]


def sweep(n=12288, k=4096):
    g = torch.Generator(device="cuda").manual_seed(0)
    wq = nvfp4.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02, scale_mode="tensor")
    for m in (16, 4096):
        xq = quantize_triton(torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16), None)
        for cfg in SWEEP:
            if (m <= 16) != (cfg["BLOCK_M"] == 16):
                continue
            gemm_mod.CONFIG_OVERRIDE = cfg
            try:
                t = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                print(f"sweep M={m} {cfg}: {t * 1e6:.1f} us, {2 * m * n * k / t / 1e12:.1f} TFLOP/s", flush=True)
            except Exception as e:  # a config that does not compile is reported, not fatal
                print(f"sweep M={m} {cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
            gemm_mod.CONFIG_OVERRIDE = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="first time a few fixed tile configs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gemm.py needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    if args.sweep:
        sweep()
    checks = {f"{n}x{k}": tile_config_check(n, k) for n, k in SHAPES}
    print("# tile/invariance checks:", json.dumps(checks), flush=True)
    qbw = quantize_bandwidth()
    rows = run(args.quick)
    if args.json:
        Path(args.json).write_text(json.dumps({"checks": checks, "quantize": qbw, "gemm": rows}, indent=1))

    def us(v):
        return f"{v * 1e6:9.1f}" if v else "      n/a"

    print("\n   N     K     M | cuBLAS bf16 | fp8 mm | naive deq | minite w4a4 | gemm only | wide tiles  | w4a4 vs bf16 | TFLOP/s w4a4 (bf16)")
    for r in rows:
        flop = 2 * r["M"] * r["N"] * r["K"]
        print(f"{r['N']:5d} {r['K']:5d} {r['M']:5d} | {us(r['cublas-bf16'])}us | {us(r['fp8-scaled-mm'])} | {us(r['naive-deq'])} |"
              f" {us(r['minite-w4a4'])}   | {us(r['minite-gemm'])} | {us(r.get('minite-gemm-wide-tiles'))}   |"
              f" {r['cublas-bf16'] / r['minite-w4a4']:6.2f}x      | {flop / r['minite-w4a4'] / 1e12:7.1f} ({flop / r['cublas-bf16'] / 1e12:6.1f})")
    print(f"\nquantize 8192x4096 bf16: {qbw['quantize_GBps']:.0f} GB/s vs copy {qbw['copy_GBps']:.0f} GB/s = {qbw['ratio']:.2f}")


if __name__ == "__main__":
    main()
