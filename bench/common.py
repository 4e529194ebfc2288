"""Shared by the GPU benchmarks: the model shapes they run (random weights, nothing downloaded) and timing."""
from __future__ import annotations

import time

import torch

from minite_core.model.qwen3 import Qwen3Config

CONFIGS = {  # Qwen3-0.6B and Qwen3-1.7B shapes (vocabulary included), and a small Qwen3-MoE
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    # Qwen3-30B-A3B's layer structure (GQA 32/4 -> 16/8 here, 128 experts top-8 -> 32 experts top-4), scaled down
    "moe": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True),
}


def make_config(name: str, seq: int) -> Qwen3Config:
    moe = "num_experts" in CONFIGS[name]
    c = dict(CONFIGS[name], max_position_embeddings=max(seq, 4096), rms_norm_eps=1e-6, rope_theta=1e6,
             model_type="qwen3_moe" if moe else "qwen3",
             architectures=["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"])
    return Qwen3Config.from_hf(c)


def cuda_time(fn) -> float:
    """Wall seconds of fn() with the GPU drained before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# Where a step's GPU time goes, by kernel family (kernel name substrings, first match wins): the Triton kernels
# of minite_core/kernels by their function names (a norm or SiLU that quantizes its output counts as the norm),
# then the library kernels by the names CUDA libraries give them.
KERNEL_FAMILIES = (
    ("Triton GEMM (W4A4, plain)", ("_gemm_kernel", "_combine_kernel", "_grouped_kernel")),
    ("FP4 decode, dequantize", ("_decode_kernel", "_dequantize_kernel")),
    ("norms, SiLU, RoPE (quantizing or not)", ("_rms_norm", "_silu_mul", "_qk_norm_rope", "_rope_kernel")),
    ("quantize (NVFP4, e4m3)", ("_quantize_kernel", "_quantize_many_kernel", "_e4m3_rows_kernel")),
    ("logprobs (lse, token)", ("_lse_kernel", "_token_logprob")),
    ("attention", ("_attention_kernel", "flash", "fmha", "attention", "sdpa")),
    ("cuBLAS / cuBLASLt GEMM", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "sm80_")),
    ("optimizer, grad norm", ("adam", "multi_tensor", "foreach", "lpnorm")),
)


def kernel_breakdown(kernels: list[tuple[str, float, float]]) -> dict:
    """kernels: (name, start, end) of each GPU kernel of a window, in seconds -> {"busy": seconds the GPU ran
    at least one kernel (the union of the intervals: overlapping kernels count once), "kernels": count,
    "families": {family: (seconds, count)}, kernel time summed by KERNEL_FAMILIES, "other" last}. A step
    whose wall time is well above `busy` leaves the GPU idle: launch overhead or host syncs, not kernels."""
    busy, reach = 0.0, float("-inf")
    for _, start, end in sorted(kernels, key=lambda k: k[1]):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    families = {name: [0.0, 0] for name, _ in KERNEL_FAMILIES}
    families["other"] = [0.0, 0]
    for name, start, end in kernels:
        low = name.lower()
        fam = next((f for f, keys in KERNEL_FAMILIES if any(k.lower() in low for k in keys)), "other")
        families[fam][0] += end - start
        families[fam][1] += 1
    return {"busy": busy, "kernels": len(kernels), "families": {f: tuple(v) for f, v in families.items() if v[1]}}


def profiled(step, device: str = "cuda"):
    """One call of `step` under torch.profiler, recording `device`'s kernels ("cuda"; "cpu" records the CPU
    ops, which the tests use to run this path without a GPU) -> the profiler (`kernel_intervals` reads it).
    On "cuda" the host's side is recorded too (ops, autograd functions, CUDA runtime calls: launches, copies,
    syncs), for a table by host time where the GPU idles."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    return prof


def kernel_intervals(prof, device: str = "cuda") -> list[tuple[str, float, float]]:
    """(name, start s, end s) of every kernel a `profiled` run recorded on `device`."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    return [(e.name, e.time_range.start * 1e-6, e.time_range.end * 1e-6) for e in prof.events()
            if e.device_type == kind and e.time_range.end > e.time_range.start]


def cprofiled(fn, calls: int, sync, top: int = 14) -> str:
    """The top functions by own time of `calls` calls of `fn` under cProfile (where a host-bound call's time
    goes: our Python, Triton's launch path, torch's dispatch)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return "\n".join(lines[start:start + top + 1])
