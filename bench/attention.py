"""Attention kernel table (GPU): miniTE's batch-invariant Triton attention vs torch SDPA (flash), prefill
and decode, plus the bitwise checks that decode over a KV cache equals prefill on the GPU.

    python bench/attention.py

Shapes: Qwen3-0.6B/1.7B attention (16 query heads, 8 KV heads, head_dim 128), bf16. Prefill: batch 4 x
seq 2048, causal. Decode: one query per sequence over a cache of 2048 valid keys, batch 1/16/64, through
the split launch (one program per (sequence, KV head, chunk of SPLIT_N keys), then the combine kernel)
and, for comparison, forced through the one-program-per-tile launch (what decode ran before the split).
Rollout decode: bench/rollout.py's step (batch 16/64/256, a slot cache of 256 positions, 192 valid keys, bf16
out), alone, with the o_proj input's NVFP4 quantize fused in (NVFP4's step) and with 2 or 1 pipelining stages
(`attention.DECODE_STAGES`); TB/s counts the valid K and V.
Times: medians of CUDA-graph replays (triton.testing.do_bench_cudagraph): capturing the decode step in a
graph is itself a check that the launcher never syncs with the host.
Checks (printed): decode == prefill bitwise at positions around the block and chunk boundaries, over the
prefill's own keys and over a longer cache with stale keys; a decode step in a batch == alone; the split
and tile launches agree on a whole prefill; how many binaries of the attention kernel were compiled (1:
prefill and decode ran the same code) and their registers / spills.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minite_core.kernels import attention as A  # noqa: E402
from minite_core.kernels.attention import attention_config, attention_forward  # noqa: E402


def bench(fn) -> float:
    torch.cuda.synchronize()  # do_bench_cudagraph runs fn on its own stream: the inputs must be written first
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3


def checks(q, k, v, pos, lens, ours, scale) -> dict[str, bool]:
    """Bitwise checks on the prefill inputs (q/k/v [B, H, T, D], positions 0..T-1, all keys valid)."""
    bm, bn, sn = attention_config()
    b, hkv, t, d = k.shape
    cap = t + sn + 37  # a longer cache: the prefill's keys, then stale ones
    kc = torch.randn(b, hkv, cap, d, device="cuda", dtype=k.dtype)
    vc = torch.randn(b, hkv, cap, d, device="cuda", dtype=v.dtype)
    kc[:, :, :t], vc[:, :, :t] = k, v
    same, same_cache, same_two = True, True, True
    for p in sorted({0, 1, bn - 1, bn, sn - 1, sn, sn + 1, 2 * sn, 1000, t - 2, t - 1}):
        p_t, len_t = torch.full((b, 1), p, device="cuda"), torch.full((b,), p + 1, device="cuda")
        same &= torch.equal(attention_forward(q[:, :, p:p + 1], k, v, p_t, len_t, scale), ours[:, :, p:p + 1])
        same_cache &= torch.equal(attention_forward(q[:, :, p:p + 1], kc, vc, p_t, len_t, scale), ours[:, :, p:p + 1])
        if p:
            two = attention_forward(q[:, :, p - 1:p + 1], kc, vc, pos[:, p - 1:p + 1], len_t, scale)
            same_two &= torch.equal(two, ours[:, :, p - 1:p + 1])
    at = torch.tensor([t - 1, sn, 5, 1000][:b], device="cuda")
    qd = q[torch.arange(b, device="cuda"), :, at].unsqueeze(2)
    batch = attention_forward(qd, kc, vc, at.view(b, 1), at + 1, scale)
    alone = all(torch.equal(attention_forward(qd[i:i + 1], kc[i:i + 1], vc[i:i + 1], at[i:i + 1].view(1, 1),
                                              at[i:i + 1] + 1, scale), batch[i:i + 1]) for i in range(b))
    alone &= all(torch.equal(batch[i, :, 0], ours[i, :, int(at[i])]) for i in range(b))
    split_prefill = torch.equal(attention_forward(q, k, v, pos, lens, scale, split=True), ours)
    return {"decode == prefill": same, "decode over a longer cache == prefill": same_cache,
            "2-query step == prefill": same_two, "batched decode == alone == prefill": alone,
            "split launch == tile launch (whole prefill)": split_prefill}


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
    ok = checks(q, k, v, pos, lens, ours, scale)
    for bd in (1, 16, 64):
        qd = torch.randn(bd, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        kd = torch.randn(bd, hkv, t, d, device="cuda", dtype=torch.bfloat16)
        vd = torch.randn(bd, hkv, t, d, device="cuda", dtype=torch.bfloat16)
        pd = torch.full((bd, 1), t - 1, device="cuda")
        ld = torch.full((bd,), t, device="cuda")
        split = attention_forward(qd, kd, vd, pd, ld, scale)
        ok[f"decode b{bd}: split launch == tile launch"] = torch.equal(
            split, attention_forward(qd, kd, vd, pd, ld, scale, split=False))
        err_d = (split - F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True).float()).abs().max().item()
        t_o = bench(lambda: attention_forward(qd, kd, vd, pd, ld, scale))
        t_tile = bench(lambda: attention_forward(qd, kd, vd, pd, ld, scale, split=False))
        t_s = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True))
        byts = 2 * bd * hkv * t * d * 2
        rows.append((f"decode b{bd} cache{t}", t_o, t_s, byts / t_o / 1e12, byts / t_s / 1e12))
        rows.append((f"  (tile launch b{bd})", t_tile, t_s, byts / t_tile / 1e12, byts / t_s / 1e12))
        err = max(err, err_d)
    kernels = A._attention_kernel.device_caches[torch.cuda.current_device()][0]
    info = [(getattr(c, "n_regs", "?"), getattr(c, "n_spills", "?")) for c in kernels.values()]  # (before the
    # rollout's decode below: its slot-cache rows, fused quantize and pipelining depths compile binaries of their own)
    # the rollout's decode step as bench/rollout.py runs it: a slot cache of 256 positions (128 prompt + 128 new
    # tokens), ~192 valid keys a sequence (the run's mean), rows read through kv_rows, the output in bf16 as the
    # model takes it; and with the o_proj input's NVFP4 quantize fused into the kernel (NVFP4's decode step)
    cap, ctx = 256, 192
    for bd in (16, 64, 256):
        kd = torch.randn(bd, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
        vd = torch.randn(bd, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
        qd = torch.randn(bd, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        pd, ld = torch.full((bd, 1), ctx - 1, device="cuda"), torch.full((bd,), ctx, device="cuda")
        slots = torch.randperm(bd, device="cuda")
        kw = dict(kv_rows=slots, out_dtype=torch.bfloat16)
        plain = attention_forward(qd, kd, vd, pd, ld, scale, **kw)
        fused, fused_q = attention_forward(qd, kd, vd, pd, ld, scale, quantize=True, **kw)
        ok[f"rollout decode b{bd}: fused quantize leaves the output as is"] = torch.equal(plain, fused)
        t_plain = bench(lambda: attention_forward(qd, kd, vd, pd, ld, scale, **kw))
        t_fused = bench(lambda: attention_forward(qd, kd, vd, pd, ld, scale, quantize=True, **kw))
        ks, vs = kd[slots, :, :ctx].contiguous(), vd[slots, :, :ctx].contiguous()  # (SDPA: the valid keys only)
        t_s = bench(lambda: F.scaled_dot_product_attention(qd, ks, vs, scale=scale, enable_gqa=True))
        byts = 2 * bd * hkv * ctx * d * 2  # the valid keys and values read once
        rows.append((f"rollout decode b{bd}", t_plain, t_s, byts / t_plain / 1e12, byts / t_s / 1e12))
        rows.append((f"  (+ fused quantize b{bd})", t_fused, t_s, byts / t_fused / 1e12, byts / t_s / 1e12))
        for stages in (2, 1):  # attention.DECODE_STAGES: fewer pipelining stages, more programs an SM (same bits)
            A.DECODE_STAGES = stages
            staged, staged_q = attention_forward(qd, kd, vd, pd, ld, scale, quantize=True, **kw)
            ok[f"rollout decode b{bd}, {stages} stages: same bits"] = torch.equal(
                attention_forward(qd, kd, vd, pd, ld, scale, **kw), plain) and torch.equal(staged, plain) and all(
                torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(staged_q, fused_q))
            t_st = bench(lambda: attention_forward(qd, kd, vd, pd, ld, scale, **kw))
            rows.append((f"  ({stages} stages b{bd})", t_st, t_s, byts / t_st / 1e12, byts / t_s / 1e12))
        A.DECODE_STAGES = None
    bm, bn, sn = attention_config()
    print(f"\nattention, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"bf16, Hq {hq} Hkv {hkv} D {d}; BLOCK_M {bm} BLOCK_N {bn} SPLIT_N {sn}")
    for name, good in ok.items():
        print(f"  bitwise: {name}: {good}")
    print(f"  compiled _attention_kernel binaries: {len(info)} (want 1: prefill and decode ran the same "
          f"code); (registers, spills) each: {info}")
    print(f"  max |ours - sdpa| (prefill and decode outputs) = {err:.3g}")
    print(f"{'case':26s} {'minite us':>10s} {'sdpa us':>9s} {'ratio':>6s} {'minite':>8s} {'sdpa':>8s}  (TFLOP/s prefill, TB/s decode)")
    for name, a, s, ra, rs in rows:
        print(f"{name:26s} {a * 1e6:10.1f} {s * 1e6:9.1f} {s / a:6.2f} {ra:8.2f} {rs:8.2f}")
    if not all(ok.values()):
        sys.exit("a bitwise check failed")


if __name__ == "__main__":
    main()
