"""Attention kernel table (GPU): miniTE's batch-invariant Triton attention vs torch SDPA (flash), prefill
and decode, plus the bitwise check that decode over a KV cache equals prefill on the GPU.

    python bench/attention.py

Shapes: Qwen3-0.6B/1.7B attention (16 query heads, 8 KV heads, head_dim 128), bf16. Prefill: batch 4 x
seq 2048, causal. Decode: one query per sequence over a cache of 2048 valid keys, batch 1/16/64.
Times: medians of CUDA-graph replays (triton.testing.do_bench_cudagraph).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minite_core.kernels.attention import attention_forward  # noqa: E402


def bench(fn) -> float:
    torch.cuda.synchronize()  # do_bench_cudagraph runs fn on its own stream: the inputs must be written first
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench/attention.py needs a CUDA device")
    torch.manual_seed(0)
    hq, hkv, d, t = 16, 8, 128, 2048
    scale = d ** -0.5
    rows = []
    b = 4
    q = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(t, device="cuda").expand(b, t).contiguous()
    lens = torch.full((b,), t, device="cuda")
    ours = attention_forward(q, k, v, pos, lens, scale)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).float()
    err = (ours - ref).abs().max().item()
    flops = 4 * b * hq * t * t * d / 2  # causal: half the square
    t_ours = bench(lambda: attention_forward(q, k, v, pos, lens, scale))
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True))
    rows.append((f"prefill b{b} t{t}", t_ours, t_sdpa, flops / t_ours / 1e12, flops / t_sdpa / 1e12))
    same = True
    for p in (0, 1, 63, 64, 1000, t - 1):  # decode == prefill on the GPU, bit for bit
        one = attention_forward(q[:, :, p:p + 1], k, v, torch.full((b, 1), p, device="cuda"),
                                torch.full((b,), p + 1, device="cuda"), scale)
        same &= torch.equal(one, ours[:, :, p:p + 1])
    for bd in (1, 16, 64):
        qd = torch.randn(bd, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        kd = torch.randn(bd, hkv, t, d, device="cuda", dtype=torch.bfloat16)
        vd = torch.randn(bd, hkv, t, d, device="cuda", dtype=torch.bfloat16)
        pd = torch.full((bd, 1), t - 1, device="cuda")
        ld = torch.full((bd,), t, device="cuda")
        t_o = bench(lambda: attention_forward(qd, kd, vd, pd, ld, scale))
        t_s = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True))
        byts = 2 * bd * hkv * t * d * 2
        rows.append((f"decode b{bd} cache{t}", t_o, t_s, byts / t_o / 1e12, byts / t_s / 1e12))
    print(f"\nattention, {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, Hq {hq} Hkv {hkv} D {d}")
    print(f"decode == prefill bitwise: {same}; prefill max |ours - sdpa| = {err:.3g}")
    print(f"{'case':22s} {'minite us':>10s} {'sdpa us':>9s} {'ratio':>6s} {'minite':>8s} {'sdpa':>8s}  (TFLOP/s prefill, TB/s decode)")
    for name, a, s, ra, rs in rows:
        print(f"{name:22s} {a * 1e6:10.1f} {s * 1e6:9.1f} {s / a:6.2f} {ra:8.2f} {rs:8.2f}")


if __name__ == "__main__":
    main()
