"""W4A4 GEMM and activation-quantize benchmark (GPU): the table in docs/benchmarks.md.

    python bench/gemm.py [--quick] [--json out.json]

For each shape (N, K) and M it times, with triton.testing.do_bench_cudagraph (median of CUDA-graph replays):
  cublas-bf16   torch.matmul(x_bf16, w_bf16.T)
  fp8-scaled-mm torch._scaled_mm on e4m3 operands (per-tensor scales), bf16 out
  naive-deq     torch: dequantize the NVFP4 weight to bf16, then torch.matmul (what a user would write)
  minite-w4a4   ops.linear on an NVFP4 weight: fused activation quantize + W4A4 GEMM (end to end)
  minite-gemm   the W4A4 GEMM kernel alone on pre-quantized activations (S = gemm.k_chunks(N, K) K chunks;
                for M <= SWAP_MAX_M and S > 1 split over programs + a combine kernel)
  minite-gemm-walk  M <= SWAP_MAX_M, S > 1: the same bits with the chunks walked in one program (SPLIT_K = False)
  minite-gemm-combine-kernel  M <= SWAP_MAX_M, S > 1: the split chunks added by a second kernel instead of the tile's
                last program (COMBINE_IN_KERNEL = False; same bits, checked: combine-same-bits)
  minite-gemm-packed M > SWAP_MAX_M: the same bits from the packed operands decoded in every tile (DECODE_WIDE = False;
                the default decodes both operands once, `decode-both`, and runs the tile on fp16)
  minite-gemm-x-decoded M <= SWAP_MAX_M: the activation decoded once by its own launch, the tile decoding only the
                weight (DECODE_X_MIN_M = 1; same bits)
  minite-gemm-select-walk M > SWAP_MAX_M, S > 1: the chunks walked by one loop with selects (WALK_OVERRIDE = 1)
                instead of the default walk (a loop over long chunks, or one-step chunks without selects); same bits
  minite-gemm-s1 S > 1: the GEMM with one K chunk (CHUNKS_OVERRIDE = 1): what the chunks cost, or save, at
                this M (a different reduction order: S is one per (N, K) for every M, so a change of S
                changes the bits of the rollout and the learner alike); `--chunks 1,2,4` times each listed S
                (minite-gemm-s<S>, here and in the decode layer), the curve `k_chunks` chooses a point on
and the activation-quantize kernel's bandwidth against a plain device copy, (`decode_layer`) a Qwen3
layer's seven linears at decode batch sizes as the model runs them, and (`learner_layer`, last; alone with
`--learner-only`) the same linears at the learner's 4 x 2048 rows, forward and forward + backward, and
(`backward_parts`) the pieces of their straight-through backward one by one. It also
checks, on the GPU, that the swapped narrow tiles (M <= SWAP_MAX_M: BLOCK_M 16/32/64/128) give the same bits as
the wide ones (the condition for SMALL_M_TILES), and that the W4A4 output is invariant: row i of an M-row
product == the 1-row product.

The MoE table (`grouped`) times the grouped W4A4 GEMM (kernels/grouped_gemm.py: one launch over all
experts, routing read on the device) against a per-expert loop of cuBLAS bf16 matmuls and a per-expert
loop of the dense W4A4 kernel, for E experts of [N, K] and T tokens routed top-k (random logits, so
about T*k/E rows per expert), and checks that the grouped rows equal the dense kernel's bit for bit.
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
from minite_core import backward as bwd  # noqa: E402
from minite_core import nvfp4, ops  # noqa: E402
from minite_core.kernels import gemm as gemm_mod  # noqa: E402
from minite_core.kernels import grouped_gemm as gg  # noqa: E402
from minite_core.kernels import pdl  # noqa: E402
from minite_core.kernels.quantize import quantize_triton  # noqa: E402

# a dense projection; a MoE expert's gate_up (Qwen3-30B-A3B); Qwen3-0.6B's k/v projection (decode: S = 4 K chunks)
SHAPES = [(12288, 4096), (1536, 2048), (1024, 1024)]
MS = [1, 16, 64, 128, 256, 4096, 8192]
GROUPED = [(8, 768, 1024, 2), (128, 768, 1024, 8)]  # (E, N, K, top-k): 8 experts; Qwen3-30B-A3B-like 128 top-8
GROUPED_TOKENS = [1, 16, 64, 256, 1024, 4096]


def bench(fn) -> float:
    """Median seconds of fn replayed from a CUDA graph: GPU time without Python launch overhead (which,
    at a few tens of microseconds per Triton launch, would otherwise dominate every small case)."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3


def tile_config_check(n: int, k: int) -> dict:
    """Do the swapped narrow tiles (M <= SWAP_MAX_M) give the same bits as the wide tiles (GPU)? Is W4A4 invariant?"""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = nvfp4.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02, scale_mode="tensor")
    x = torch.randn(4096, k, device="cuda", generator=g, dtype=torch.bfloat16)
    xq = quantize_triton(x, None)
    default = gemm_mod.SMALL_M_TILES
    gemm_mod.SMALL_M_TILES = False
    big = gemm_mod.gemm_triton(xq, w, None, torch.bfloat16)
    same_tiles, invariant = {}, True
    for m in (1, 5, 16, 17, 40, 64, 100, 128):
        ok = True
        for lo in range(0, 4096 - m, 512):
            rows = nvfp4.NVFP4Tensor(xq.data[lo:lo + m], xq.scale[lo:lo + m], xq.global_scale[lo:lo + m], (m, k))
            gemm_mod.SMALL_M_TILES = True
            small = gemm_mod.gemm_triton(rows, w, None, torch.bfloat16)
            gemm_mod.SMALL_M_TILES = False
            ok &= torch.equal(small, big[lo:lo + m])
        same_tiles[m] = bool(ok)
    gemm_mod.SMALL_M_TILES = default
    for m in (1, 64):  # K chunks walked in one program (no split) == split over programs
        rows = nvfp4.NVFP4Tensor(xq.data[:m], xq.scale[:m], xq.global_scale[:m], (m, k))
        gemm_mod.SPLIT_K = False
        walk = gemm_mod.gemm_triton(rows, w, None, torch.bfloat16)
        gemm_mod.SPLIT_K = True
        same_tiles[f"walk{m}"] = bool(torch.equal(walk, big[:m]))
    for lo in range(0, 4096, 512):
        one = ops.linear(x[lo:lo + 1], w, backend="triton")
        invariant &= torch.equal(one, ops.linear(x[: lo + 300], w, backend="triton")[lo:lo + 1])
    return {"small_tiles_same_bits": all(same_tiles.values()), "by_M": same_tiles, "invariant": bool(invariant)}


def run(quick: bool, chunks=(1,)) -> list[dict]:
    rows = []
    ms = [1, 16, 64, 4096] if quick else MS
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
            r = {"N": n, "K": k, "M": m, "S": gemm_mod.k_chunks(n, k)}
            r["cublas-bf16"] = bench(lambda: torch.matmul(x, w_bf16.T))
            try:
                r["fp8-scaled-mm"] = bench(lambda: torch._scaled_mm(x_f8, w_f8.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            except RuntimeError:
                r["fp8-scaled-mm"] = None
            r["naive-deq"] = bench(lambda: torch.matmul(x, wq.dequantize(torch.bfloat16).T))
            r["minite-w4a4"] = bench(lambda: ops.linear(x, wq, backend="triton", check_finite=False))
            r["minite-gemm"] = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
            if m <= gemm_mod.SWAP_MAX_M:  # the wide tiles, for comparison
                gemm_mod.SMALL_M_TILES = False
                r["minite-gemm-wide-tiles"] = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                gemm_mod.SMALL_M_TILES = True
            if m > gemm_mod.SWAP_MAX_M:  # the packed operands decoded in every tile, for comparison (same bits)
                gemm_mod.DECODE_WIDE = False
                r["minite-gemm-packed"] = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                gemm_mod.DECODE_WIDE = True
                r["decode-both"] = bench(lambda: (gemm_mod.decode_nvfp4(xq, 128), gemm_mod.decode_nvfp4(wq, 128)))
            if m <= gemm_mod.SWAP_MAX_M and r["S"] > 1:  # the K chunks in one program, for comparison
                gemm_mod.SPLIT_K = False
                r["minite-gemm-walk"] = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                gemm_mod.SPLIT_K = True
                in_kernel = gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16)
                gemm_mod.COMBINE_IN_KERNEL = False  # the split chunks added by a second kernel (same bits)
                r["minite-gemm-combine-kernel"] = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                r["combine-same-bits"] = torch.equal(in_kernel, gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                gemm_mod.COMBINE_IN_KERNEL = True
            if m <= gemm_mod.SWAP_MAX_M:  # the activation decoded by its own launch, the tile decodes the weight only
                gemm_mod.DECODE_X_MIN_M = 1
                r["minite-gemm-x-decoded"] = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                gemm_mod.DECODE_X_MIN_M = None
            if m > gemm_mod.SWAP_MAX_M and r["S"] > 1:  # long chunks' nested walk vs the select walk (same bits)
                out = gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16)
                gemm_mod.WALK_OVERRIDE = 1
                r["minite-gemm-select-walk"] = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                r["select-walk-same-bits"] = torch.equal(out, gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                gemm_mod.WALK_OVERRIDE = None
            for s in chunks:  # what the K chunks cost: another S (a different reduction order, so other bits)
                if s != r["S"] and triton.cdiv(k, gemm_mod.FP4_BLOCK_K) % s == 0:
                    gemm_mod.CHUNKS_OVERRIDE = s
                    r[f"minite-gemm-s{s}"] = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                    gemm_mod.CHUNKS_OVERRIDE = None
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def run_grouped(quick: bool) -> list[dict]:
    """Grouped W4A4 GEMM vs per-expert loops (cuBLAS bf16; the dense W4A4 kernel), CUDA-graph medians."""
    rows = []
    for e, n, k, topk in GROUPED:
        g = torch.Generator(device="cuda").manual_seed(1)
        w32 = [torch.randn(n, k, device="cuda", generator=g) * 0.02 for _ in range(e)]
        experts = [nvfp4.quantize(w, scale_mode="tensor") for w in w32]
        w_bf16 = [w.to(torch.bfloat16) for w in w32]
        wq = gg.stack_experts(experts)
        for t in ([16, 1024] if quick else GROUPED_TOKENS):
            logits = torch.randn(t, e, device="cuda", generator=g)
            srt = gg.moe_sort(logits.topk(topk, dim=1).indices, e)
            x = torch.randn(t, k, device="cuda", generator=g, dtype=torch.bfloat16)[srt.tokens]
            xq = quantize_triton(x, None)
            offs = srt.offsets.tolist()  # host copy for the per-expert loops only (outside the timed region)
            active = [(i, offs[i], offs[i + 1]) for i in range(e) if offs[i + 1] > offs[i]]
            parts = [(i, lo, hi, nvfp4.NVFP4Tensor(xq.data[lo:hi], xq.scale[lo:hi], xq.global_scale[lo:hi], (hi - lo, k)))
                     for i, lo, hi in active]
            out_b = torch.empty(t * topk, n, device="cuda", dtype=torch.bfloat16)

            def cublas_loop():
                for i, lo, hi in active:
                    torch.matmul(x[lo:hi], w_bf16[i].T, out=out_b[lo:hi])

            def dense_loop():
                for i, lo, hi, xp in parts:
                    out_b[lo:hi] = gemm_mod.gemm_triton(xp, experts[i], None, torch.bfloat16)

            out = gg.grouped_gemm(xq, wq, srt.offsets, torch.bfloat16)
            same = all(torch.equal(out[lo:hi], gemm_mod.gemm_triton(xp, experts[i], None, torch.bfloat16))
                       for i, lo, hi, xp in parts)
            r = {"E": e, "N": n, "K": k, "topk": topk, "T": t, "rows": t * topk, "experts_hit": len(active),
                 "cublas-bf16-loop": bench(cublas_loop), "minite-dense-loop": bench(dense_loop),
                 "minite-grouped": bench(lambda: gg.grouped_gemm(xq, wq, srt.offsets, torch.bfloat16)),
                 "grouped_equals_dense": bool(same), "config": gg.grouped_config(t * topk, e, n, k)}
            w_bytes = len(active) * n * (k // 2 + k // 16)
            r["grouped_weight_TBps"] = w_bytes / r["minite-grouped"] / 1e12
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def quantize_bandwidth() -> dict:
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    t_copy = bench(lambda: dst.copy_(x))
    t_q = bench(lambda: quantize_triton(x, None))
    t_dec = bench(lambda: quantize_triton(x, None, decoded=True))  # with the decoded form (the learner's wide tiles)
    copy_bytes = 2 * x.numel() * x.element_size()
    q_bytes = x.numel() * x.element_size() + x.numel() // 2 + x.numel() // 16 + 4 * x.shape[0]
    return {"copy_GBps": copy_bytes / t_copy / 1e9, "quantize_GBps": q_bytes / t_q / 1e9,
            "ratio": (q_bytes / t_q) / (copy_bytes / t_copy), "decoded_too_us": t_dec * 1e6, "quantize_us": t_q * 1e6,
            "sweep": quantize_sweep(x, bench)}


QUANTIZE_SWEEP = [(w, nb) for w in (2, 4, 8) for nb in (32, 64, 128)]  # (num_warps, most blocks a chunk)


def quantize_sweep(x: torch.Tensor, timer) -> list[dict]:
    """The activation quantize of x under other launch settings (`quantize.QUANTIZE_WARPS`, `QUANTIZE_MAX_NB`):
    seconds each, and whether its codes, scales and global scales equal the default's (they must)."""
    from minite_core.kernels import quantize as qmod
    ref = quantize_triton(x, None)
    saved = qmod.QUANTIZE_WARPS, qmod.QUANTIZE_MAX_NB
    rows = []
    try:
        for warps, nb in QUANTIZE_SWEEP:
            qmod.QUANTIZE_WARPS, qmod.QUANTIZE_MAX_NB = warps, nb
            q = quantize_triton(x, None)
            same = (torch.equal(q.data, ref.data) and torch.equal(q.global_scale, ref.global_scale)
                    and torch.equal(q.scale.view(torch.uint8), ref.scale.view(torch.uint8)))
            rows.append({"warps": warps, "max_nb": nb, "seconds": timer(lambda: quantize_triton(x, None)), "same_bits": same})
    finally:
        qmod.QUANTIZE_WARPS, qmod.QUANTIZE_MAX_NB = saved
    return rows


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
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, SWAP_AB=True),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, SWAP_AB=True),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3, SWAP_AB=True),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3, SWAP_AB=True),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=2, SWAP_AB=True),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, SWAP_AB=True),
]


def sweep(n=12288, k=4096):
    g = torch.Generator(device="cuda").manual_seed(0)
    wq = nvfp4.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02, scale_mode="tensor")
    for m in (16, 64, 128, 4096):
        xq = quantize_triton(torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16), None)
        for cfg in SWEEP:
            want = gemm_mod.swap_block_m(m) if m <= gemm_mod.SWAP_MAX_M else 128
            if cfg["BLOCK_M"] != want or cfg.get("SWAP_AB", False) != (m <= gemm_mod.SWAP_MAX_M) and m > 16:
                continue
            gemm_mod.CONFIG_OVERRIDE = cfg
            try:
                t = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                print(f"sweep M={m} {cfg}: {t * 1e6:.1f} us, {2 * m * n * k / t / 1e12:.1f} TFLOP/s", flush=True)
            except Exception as e:  # a config that does not compile is reported, not fatal
                print(f"sweep M={m} {cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
            gemm_mod.CONFIG_OVERRIDE = None


DECODED_SWEEP = [  # tiles of the decoded wide path (BLOCK_K stays 128; only the output tile and pipelining vary)
    dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=2),
    dict(BLOCK_M=256, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4),
]


def decoded_sweep():
    """The decoded wide path's GEMM alone (operands decoded outside the timing) for each tile of DECODED_SWEEP."""
    default = dict(gemm_mod.DECODED_TILE)
    for n, k in SHAPES + [(3072, 1024), (1024, 3072), (2048, 1024)]:
        g = torch.Generator(device="cuda").manual_seed(0)
        w32 = torch.randn(n, k, device="cuda", generator=g) * 0.02
        wq, w_bf16 = nvfp4.quantize(w32, scale_mode="tensor"), w32.to(torch.bfloat16)
        for m in (4096, 8192):
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            xq = quantize_triton(x, None)
            t_cublas = bench(lambda: torch.matmul(x, w_bf16.T))
            ref = gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16)
            for tile in DECODED_SWEEP:
                gemm_mod.DECODED_TILE = tile
                try:
                    same = torch.equal(gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16), ref)
                    t = bench(lambda: gemm_mod.gemm_triton(xq, wq, None, torch.bfloat16))
                    print(f"decoded N={n} K={k} M={m} {tile}: {t * 1e6:.1f} us = {t_cublas / t:.2f}x cuBLAS bf16, "
                          f"same bits {same}", flush=True)
                except Exception as e:  # a config that does not compile is reported, not fatal
                    print(f"decoded N={n} K={k} M={m} {tile}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
    gemm_mod.DECODED_TILE = default


# Qwen3 layer shapes: hidden, q width (heads x head_dim), k/v width, MLP width
LAYERS = {"0.6b": (1024, 2048, 1024, 3072), "1.7b": (2048, 2048, 1024, 6144)}


def layer_shapes(h: int, nq: int, nkv: int, inter: int) -> dict[str, tuple[int, int]]:
    """A Qwen3 layer's seven linear weights [N, K] by projection, from LAYERS' (hidden, q width, k/v width,
    intermediate)."""
    return {"q": (nq, h), "k": (nkv, h), "v": (nkv, h), "o": (h, nq), "gate": (inter, h), "up": (inter, h),
            "down": (h, inter)}


def do_bench(fn) -> float:
    """Median seconds of fn called from Python (CUDA events: the host's launch time included where the GPU
    waits on it), for what cannot replay from a CUDA graph (autograd) or should not (`bench` is that one)."""
    return triton.testing.do_bench(fn, rep=200, return_mode="median") * 1e-3


def decode_layer(ms=(16, 64), chunks=(1,)) -> list[dict]:
    """A layer's linears as a decode step runs them (M = batch rows), CUDA-graph medians:
      cublas-bf16   the seven bf16 matmuls (torch.matmul), after a torch RMSNorm
      minite-bf16   the model's ops on bf16 weights (triton backend): q/k/v and gate/up in one launch each
      nvfp4-before  NVFP4, each linear alone: seven activation quantizes, seven GEMM launches
      nvfp4-now     NVFP4 as the model runs it: RMSNorm and SiLU*up quantize their output in the same kernel,
                    q/k/v and gate/up in one GEMM launch each
    and the two last ones again with programmatic dependent launch on (`kernels/pdl.py`; off by default),
    nvfp4-now with the activations decoded by their own launch (DECODE_X_MIN_M = 1), and with S K chunks for
    every linear (S = 1 and the other `chunks`).
    The attention output (the o_proj input) is a random activation; attention itself is not timed."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    rows = []
    for name, (h, nq, nkv, inter) in LAYERS.items():
        shapes = layer_shapes(h, nq, nkv, inter)
        wb = {k: rnd(*s) * 0.02 for k, s in shapes.items()}
        wq = {k: nvfp4.quantize(w.float(), scale_mode="tensor") for k, w in wb.items()}
        norm_w = rnd(h) * 0.1 + 1
        for m in ms:
            x, a = rnd(m, h), rnd(m, nq)
            kw = dict(backend="triton", check_finite=False)

            def cublas():
                hn = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * norm_w
                [hn @ wb[k].T for k in "qkv"]
                a @ wb["o"].T
                gt, up = hn @ wb["gate"].T, hn @ wb["up"].T
                (torch.nn.functional.silu(gt) * up) @ wb["down"].T

            def minite(w, fused: bool):
                if fused:
                    hn, hq = ops.rms_norm(x, norm_w, backend="triton", quantize=True) if w is wq else (ops.rms_norm(x, norm_w, backend="triton"), None)
                    ops.linears(hn, [w[k] for k in "qkv"], xq=hq, **kw)
                    ops.linear(a, w["o"], **kw)
                    gt, up = ops.linears(hn, [w["gate"], w["up"]], xq=hq, **kw)
                    hs, hsq = ops.silu_mul(gt, up, backend="triton", quantize=True) if w is wq else (ops.silu_mul(gt, up, backend="triton"), None)
                    ops.linears(hs, [w["down"]], xq=hsq, **kw)
                else:
                    hn = ops.rms_norm(x, norm_w, backend="triton")
                    [ops.linear(hn, w[k], **kw) for k in "qkv"]
                    ops.linear(a, w["o"], **kw)
                    gt, up = ops.linear(hn, w["gate"], **kw), ops.linear(hn, w["up"], **kw)
                    ops.linear(ops.silu_mul(gt, up, backend="triton"), w["down"], **kw)

            r = {"model": name, "M": m, "cublas-bf16": bench(cublas), "minite-bf16": bench(lambda: minite(wb, True)),
                 "nvfp4-before": bench(lambda: minite(wq, False)), "nvfp4-now": bench(lambda: minite(wq, True))}
            default, pdl.ENABLED = pdl.ENABLED, True
            r["minite-bf16-pdl"], r["nvfp4-now-pdl"] = bench(lambda: minite(wb, True)), bench(lambda: minite(wq, True))
            pdl.ENABLED = default
            gemm_mod.DECODE_X_MIN_M = 1  # the activations decoded by their own launch (same bits)
            r["nvfp4-now-x-decoded"] = bench(lambda: minite(wq, True))
            gemm_mod.DECODE_X_MIN_M = None
            for s in chunks:  # every linear with S K chunks (other bits): what the chunks cost here
                gemm_mod.CHUNKS_OVERRIDE = s
                r[f"nvfp4-now-s{s}"] = bench(lambda: minite(wq, True))
                gemm_mod.CHUNKS_OVERRIDE = None
            rows.append(r)
            print("# decode layer", json.dumps(r), flush=True)
    return rows


def learner_layer(m: int = 8192, timer=None, device: str = "cuda", layers: dict | None = None,
                  graph_timer=None) -> list[dict]:
    """A learner layer's linears, forward and forward + backward through the autograd path the learner runs
    (M = batch x seq rows; `triton.testing.do_bench` medians, not CUDA graphs: autograd runs on the host,
    so where the host is slower than the GPU these are host times). The forward also from a CUDA graph
    (`graph_timer`, default `bench`: fwd-graph, the GPU's time alone): fwd against fwd-graph says whether the
    layer's forward waits on the host.
      cublas-bf16      F.linear on bf16 weights that require grad (what a bf16 PyTorch step runs)
      minite-bf16      ops.linears on the fp32 masters cast to bf16 (the BF16 learner: `Qwen3.param`)
      minite-nvfp4     ops.linears on NVFP4 weights, the gradients to the fp32 masters (straight-through)
      minite-nvfp4-fp8 the same with backward="fp8" (e4m3 operands, per-row scales)
    q/k/v and gate/up as one call each, the o_proj and down inputs quantized by the call (in the model the
    norms and SiLU*up hand over q/k/v's, gate/up's and down's). Where the NVFP4 step's linears spend the time
    that the BF16 step's do not: the layer's forward and backward, without norms and attention."""
    timer = timer or do_bench
    graph_timer = graph_timer or bench
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *sh: torch.randn(*sh, device=device, generator=g)  # noqa: E731
    bf16 = torch.bfloat16
    rows = []
    for name, (h, nq, nkv, inter) in (layers or LAYERS).items():
        calls = [("x", ("q", "k", "v")), ("a", ("o",)), ("x", ("gate", "up")), ("hs", ("down",))]
        shapes = layer_shapes(h, nq, nkv, inter)
        masters = {k: (rnd(*sh) * 0.02).requires_grad_(True) for k, sh in shapes.items()}
        # the learner's re-quantize: per-tensor scales, the decoded form its wide forward tiles read and the
        # bf16 values its backward's dgrad reads
        wq = dict(zip(masters, ops.quantize_weights([w.detach() for w in masters.values()], backend="triton",
                                                    decoded=True, dequantized=True)))
        wb = {k: w.detach().to(bf16).requires_grad_(True) for k, w in masters.items()}
        inputs = {"x": rnd(m, h).to(bf16), "a": rnd(m, nq).to(bf16), "hs": rnd(m, inter).to(bf16)}
        inputs = {k: v.requires_grad_(True) for k, v in inputs.items()}
        douts = {k: rnd(m, sh[0]).to(bf16) for k, sh in shapes.items()}

        def layer(engine: str):
            outs, out_names = [], []
            for src, names in calls:
                x = inputs[src]
                if engine == "cublas-bf16":
                    outs += [torch.nn.functional.linear(x, wb[n]) for n in names]
                elif engine == "minite-bf16":
                    outs += ops.linears(x, [masters[n].to(bf16) for n in names], backend="triton", check_finite=False)
                else:
                    outs += ops.linears(x, [wq[n] for n in names], backend="triton", check_finite=False,
                                        masters=[masters[n] for n in names],
                                        backward="fp8" if engine.endswith("fp8") else "ste")
                out_names += names
            return outs, out_names

        def fwd_bwd(engine: str):
            outs, out_names = layer(engine)
            params = [wb[n] for n in shapes] if engine == "cublas-bf16" else [masters[n] for n in shapes]
            torch.autograd.grad(outs, list(inputs.values()) + params, [douts[n] for n in out_names], allow_unused=True)

        r = {"model": name, "M": m}
        for engine in ("cublas-bf16", "minite-bf16", "minite-nvfp4", "minite-nvfp4-fp8"):
            with torch.no_grad():
                r[f"{engine}-fwd"] = timer(lambda: layer(engine))
                try:
                    r[f"{engine}-fwd-graph"] = graph_timer(lambda: layer(engine))
                except Exception as e:  # (a capture that fails costs only its column)
                    r[f"{engine}-fwd-graph"] = None
                    print(f"# learner layer {engine}: no CUDA-graph time, {type(e).__name__}: {str(e)[:200]}", flush=True)
            r[f"{engine}-fwd-bwd"] = timer(lambda: fwd_bwd(engine))
        rows.append(r)
        print("# learner layer", json.dumps(r), flush=True)
    return rows


def backward_parts(m: int = 8192, timer=None, device: str = "cuda", layers: dict | None = None) -> list[dict]:
    """The straight-through backward of a learner layer's linears (`backward.ste_cuda`), piece by piece, each
    summed over the layer (ms): where the NVFP4 backward's time goes against the BF16 one's.
      deq-w        the 7 weights dequantized to bf16 (dgrad's operands; NVFP4 only; since 2026-12-06 the learner
                   reads them from its re-quantize, `NVFP4Tensor.dequantized`, and no longer runs these)
      deq-x        the 4 saved activations Q(x) dequantized to bf16 (wgrad's operands; NVFP4 only)
      dgrad        the 7 products g @ W, bf16 out (both)
      wgrad-fp32   the 7 products g.T @ x with fp32 out (`out_dtype`): NVFP4's, whose gradients go to fp32
                   masters straight
      wgrad-bf16   the same with bf16 out: BF16's (its weights are bf16 casts of the masters; autograd
                   casts the gradient back to fp32 after)"""
    timer = timer or do_bench
    g = torch.Generator(device=device).manual_seed(1)
    rnd = lambda *sh: torch.randn(*sh, device=device, generator=g)  # noqa: E731
    bf16, f32 = torch.bfloat16, torch.float32
    deq = lambda t: ops.dequantize(t, bf16, backend="triton")  # noqa: E731
    rows = []
    for name, (h, nq, nkv, inter) in (layers or LAYERS).items():
        shapes = layer_shapes(h, nq, nkv, inter)
        src = {"q": "x", "k": "x", "v": "x", "o": "a", "gate": "x2", "up": "x2", "down": "hs"}
        ws = dict(zip(shapes, ops.quantize_weights([rnd(*sh) * 0.02 for sh in shapes.values()], backend="triton",
                                                   decoded=True)))
        xs = {k: ops.quantize(rnd(m, n).to(bf16), backend="triton", check_finite=False)
              for k, n in (("x", h), ("a", nq), ("x2", h), ("hs", inter))}
        gs = {k: rnd(m, sh[0]).to(bf16) for k, sh in shapes.items()}
        wd = {k: deq(w) for k, w in ws.items()}
        xd = {k: deq(x) for k, x in xs.items()}
        r = {"model": name, "M": m,
             "deq-w": timer(lambda: [deq(w) for w in ws.values()]),
             "deq-x": timer(lambda: [deq(x) for x in xs.values()]),
             "dgrad": timer(lambda: [bwd.cuda_mm(gs[k], wd[k], bf16) for k in shapes]),
             "wgrad-fp32": timer(lambda: [bwd.cuda_mm(gs[k].T, xd[src[k]], f32) for k in shapes]),
             "wgrad-bf16": timer(lambda: [bwd.cuda_mm(gs[k].T, xd[src[k]], bf16) for k in shapes])}
        rows.append(r)
        print("# backward parts", json.dumps(r), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="first time a few fixed tile configs")
    ap.add_argument("--grouped-only", action="store_true", help="only the MoE grouped GEMM table")
    ap.add_argument("--decoded-sweep", action="store_true", help="first time the decoded wide path's tiles")
    ap.add_argument("--chunks", default="1", help="K chunk counts S to time beside k_chunks' own, e.g. 1,2,4")
    ap.add_argument("--learner-only", action="store_true", help="only the learner layer's table (fwd, fwd + bwd)")
    args = ap.parse_args()
    chunks = tuple(int(c) for c in args.chunks.split(","))
    if not torch.cuda.is_available():
        sys.exit("bench/gemm.py needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    if args.learner_only:
        return print_learner_layer()
    if args.sweep:
        sweep()
    if args.decoded_sweep:
        decoded_sweep()
    def us(v):
        return f"{v * 1e6:9.1f}" if v else "      n/a"

    layer = [] if args.grouped_only else decode_layer(chunks=chunks)
    grouped = run_grouped(args.quick)
    if args.grouped_only:
        checks, qbw, rows = {}, None, []
    else:
        checks = {f"{n}x{k}": tile_config_check(n, k) for n, k in SHAPES}
        print("# tile/invariance checks:", json.dumps(checks), flush=True)
        qbw = quantize_bandwidth()
        rows = run(args.quick, chunks)
    if args.json:
        Path(args.json).write_text(json.dumps({"checks": checks, "quantize": qbw, "gemm": rows, "grouped": grouped,
                                               "decode_layer": layer}, indent=1))

    print("\n  E    N     K top    T  rows hit | cuBLAS bf16 loop | W4A4 dense loop | W4A4 grouped | grouped vs cuBLAS loop | weights TB/s | bits == dense")
    for r in grouped:
        print(f"{r['E']:3d} {r['N']:4d} {r['K']:5d} {r['topk']:3d} {r['T']:5d} {r['rows']:5d} {r['experts_hit']:3d} |"
              f"     {us(r['cublas-bf16-loop'])}us  |    {us(r['minite-dense-loop'])}us  | {us(r['minite-grouped'])}us  |"
              f" {r['cublas-bf16-loop'] / r['minite-grouped']:6.2f}x                | {r['grouped_weight_TBps']:5.2f}       | {r['grouped_equals_dense']}")
    if args.grouped_only:
        return

    print("\n   N     K     M  S | cuBLAS bf16 | fp8 mm | naive deq | minite w4a4 | gemm only | no split  | combine kernel | wide tiles  | packed wide | x decoded | S = 1     | w4a4 vs bf16 | TFLOP/s w4a4 (bf16)")
    for r in rows:
        flop = 2 * r["M"] * r["N"] * r["K"]
        print(f"{r['N']:5d} {r['K']:5d} {r['M']:5d} {r['S']:2d} | {us(r['cublas-bf16'])}us | {us(r['fp8-scaled-mm'])} | {us(r['naive-deq'])} |"
              f" {us(r['minite-w4a4'])}   | {us(r['minite-gemm'])} | {us(r.get('minite-gemm-walk'))} | {us(r.get('minite-gemm-combine-kernel'))}      |"
              f" {us(r.get('minite-gemm-wide-tiles'))}   |"
              f" {us(r.get('minite-gemm-packed'))}   | {us(r.get('minite-gemm-x-decoded'))} | {us(r.get('minite-gemm-s1'))} |"
              f" {r['cublas-bf16'] / r['minite-w4a4']:6.2f}x      | {flop / r['minite-w4a4'] / 1e12:7.1f} ({flop / r['cublas-bf16'] / 1e12:6.1f})")
    for r in rows:
        if "minite-gemm-select-walk" in r:
            print(f"walk {r['N']:5d} {r['K']:5d} {r['M']:5d} {r['S']:2d} | gemm only {us(r['minite-gemm'])}us, with the select walk"
                  f" {us(r['minite-gemm-select-walk'])}us, same bits: {r['select-walk-same-bits']}")
    print(f"\nquantize 8192x4096 bf16: {qbw['quantize_GBps']:.0f} GB/s vs copy {qbw['copy_GBps']:.0f} GB/s = {qbw['ratio']:.2f}"
          f" ({qbw['quantize_us']:.1f} us; writing the decoded form too: {qbw['decoded_too_us']:.1f} us)")
    print("quantize sweep (warps, most blocks a chunk: us, of copy, same bits): " + "; ".join(  # (same bytes moved)
        f"w{r['warps']} nb{r['max_nb']} {r['seconds'] * 1e6:.1f} {qbw['ratio'] * qbw['quantize_us'] * 1e-6 / r['seconds']:.2f}"
        f" {r['same_bits']}" for r in qbw["sweep"]))
    print("\nmodel    M | cuBLAS bf16 | minite bf16 | nvfp4 before | nvfp4 now | now vs before | now vs minite bf16 | with PDL: bf16, nvfp4 | nvfp4 x decoded | nvfp4 S = 1"
          " (a layer's linears)")
    for r in layer:
        print(f"decode {r['model']:4s} {r['M']:3d} | {us(r['cublas-bf16'])}us | {us(r['minite-bf16'])}us | {us(r['nvfp4-before'])}us  |"
              f" {us(r['nvfp4-now'])}us | {r['nvfp4-before'] / r['nvfp4-now']:6.2f}x       | {r['minite-bf16'] / r['nvfp4-now']:6.2f}x"
              f"            | {us(r['minite-bf16-pdl'])}us {us(r['nvfp4-now-pdl'])}us | {us(r['nvfp4-now-x-decoded'])}us |"
              f" {us(r.get('nvfp4-now-s1'))}us")
    if chunks != (1,):
        print("\nK chunks   N     K     M  S | own S     | " + " | ".join(f"S = {s:<5d}" for s in chunks) + "  (us; GEMM only, or the layer's linears)")
        for r in rows:
            print(f"chunks {r['N']:5d} {r['K']:5d} {r['M']:5d} {r['S']:2d} | {us(r['minite-gemm'])} | "
                  + " | ".join(us(r.get(f"minite-gemm-s{s}")) for s in chunks))
        for r in layer:
            print(f"chunks layer {r['model']:4s} M {r['M']:3d} | {us(r['nvfp4-now'])} | "
                  + " | ".join(us(r.get(f"nvfp4-now-s{s}")) for s in chunks))
    print_learner_layer()


def print_learner_layer() -> None:
    """`learner_layer`'s and `backward_parts`' tables (last: a failure there costs none of the tables above)."""
    _print_learner_layer()
    try:
        parts = backward_parts()
    except Exception as e:  # reported, not fatal
        print(f"\nbackward parts: FAILED {type(e).__name__}: {e}", flush=True)
        return
    keys = ("deq-w", "deq-x", "dgrad", "wgrad-fp32", "wgrad-bf16")
    print("\nbackward parts M | " + " | ".join(keys) + "  (ms, summed over a layer's 7 linears)")
    for r in parts:
        print(f"backward {r['model']:4s} {r['M']:5d} | " + " | ".join(f"{r[k] * 1e3:6.3f}" for k in keys))


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:5.2f}" if seconds is not None else "  n/a"


def _print_learner_layer() -> None:
    try:
        rows = learner_layer()
    except Exception as e:  # reported, not fatal
        print(f"\nlearner layer: FAILED {type(e).__name__}: {e}", flush=True)
        return
    engines = ("cublas-bf16", "minite-bf16", "minite-nvfp4", "minite-nvfp4-fp8")
    print("\nlearner layer M | " + " | ".join(f"{e} fwd (GPU alone), fwd+bwd" for e in engines)
          + " | nvfp4 / minite bf16 (fwd+bwd; ms)")
    for r in rows:
        print(f"learner {r['model']:4s} {r['M']:5d} | "
              + " | ".join(f"{r[f'{e}-fwd'] * 1e3:6.2f} ({_ms(r[f'{e}-fwd-graph'])}) {r[f'{e}-fwd-bwd'] * 1e3:6.2f}"
                           for e in engines)
              + f" | {r['minite-bf16-fwd-bwd'] / r['minite-nvfp4-fwd-bwd']:.2f}x, fp8 "
              f"{r['minite-bf16-fwd-bwd'] / r['minite-nvfp4-fp8-fwd-bwd']:.2f}x")


if __name__ == "__main__":
    main()
