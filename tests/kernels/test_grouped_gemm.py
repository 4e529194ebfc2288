"""Grouped W4A4 GEMM for MoE experts: bit-equal to the dense kernel per expert, close to the torch
reference, for any routing (empty experts, experts with more rows than a tile) and any tile config;
`moe_sort` is stable and sync-free; `stack_experts` layouts.

On a CPU machine the kernels run under the Triton interpreter (small shapes); on a GPU, on the GPU
(and there also under a CUDA graph, with the routing changed between replays).
"""
import pytest
import torch
from tests.backends import DEVICE, HAS_CUDA, HAS_TRITON

from minite_core import nvfp4, reference

pytestmark = [pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter,
              pytest.mark.skipif(not HAS_TRITON, reason="triton missing")]

if HAS_TRITON:
    from minite_core.kernels import grouped_gemm as gg
    from minite_core.kernels.gemm import SWAP_CONFIGS, gemm_triton


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    return rows.to(DEVICE)


def _experts(e, n, k, mode="tensor", seed=1):
    return [nvfp4.quantize(_rand(n, k, seed=seed + i) * 0.05, scale_mode=mode) for i in range(e)]


def _routing(t, e, topk, seed=2, skip=()):
    """A top-k routing of t tokens over e experts (distinct experts per token), some experts never chosen,
    and a skewed distribution so that one expert gets more rows than a tile."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    logits[:, 0] += 2.0  # expert 0: popular
    for s in skip:
        logits[:, s] = -1e9
    return logits.topk(topk, dim=1).indices.to(DEVICE)


def _rows(xq, lo, hi):
    k = xq.shape[-1]
    return nvfp4.NVFP4Tensor(xq.data[lo:hi], xq.scale[lo:hi], xq.global_scale[lo:hi], (hi - lo, k))


def _check_against_dense(out, xq, experts, offsets):
    offs = offsets.tolist()
    for e, w in enumerate(experts):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            dense = gemm_triton(_rows(xq, lo, hi), w, None, out.dtype)
            assert torch.equal(out[lo:hi], dense), f"expert {e}: rows {lo}..{hi}"


# (E, N, K): the K chunks walked in one-step chunks and, in the last shape, in chunks of several steps
# (test_the_shapes_cover_both_walks); K not a multiple of the K tile in one of them
SHAPES = [(6, 40, 128), (5, 72, 96), (4, 100, 256)] if DEVICE == "cpu" else [(8, 768, 512), (16, 1536, 2048), (8, 4608, 2000)]


def test_the_shapes_cover_both_walks():
    from minite_core.kernels.gemm import k_chunks, walk_mode

    bk = 64 if DEVICE == "cpu" else gg.FP4_BLOCK_K
    modes = {walk_mode(k, k_chunks(n, k), bk) for _, n, k in SHAPES}
    assert modes == {1, 2}, modes


@pytest.mark.parametrize("e,n,k", SHAPES)
@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_grouped_equals_dense_per_expert_bitwise(e, n, k, mode):
    t, topk = (37, 2) if DEVICE == "cpu" else (700, 4)
    experts = _experts(e, n, k, mode)
    w = gg.stack_experts(experts)
    top = _routing(t, e, topk, skip=(e - 2,))  # one expert gets no rows
    srt = gg.moe_sort(top, e)
    x = _rand(t, k, seed=3)
    xq = nvfp4.quantize(x[srt.tokens])
    for dtype in (torch.float32, torch.bfloat16):
        out = gg.grouped_gemm(xq, w, srt.offsets, dtype)
        assert out.shape == (t * topk, n) and out.dtype == dtype
        _check_against_dense(out, xq, experts, srt.offsets)


def test_grouped_long_chunk_walk_equals_the_dense_kernel(monkeypatch):
    """The grouped kernel walks chunks of LONG_CHUNK_STEPS steps or more with a loop over chunks around a loop
    over steps (`w4a4_tile`'s CHUNKED = 3): the dense kernel's bits (its split programs, at these row counts).
    The threshold is lowered to the last shape's chunk length so that the CPU run takes that walk too."""
    from minite_core.kernels import gemm

    e, n, k = SHAPES[-1]
    bk = 64 if DEVICE == "cpu" else gg.FP4_BLOCK_K
    s = gemm.k_chunks(n, k)
    monkeypatch.setattr(gemm, "LONG_CHUNK_STEPS", gemm.chunk_elements(k, s, bk) // bk)
    assert gemm.walk_mode(k, s, bk) == 3
    experts = _experts(e, n, k, "row")
    srt = gg.moe_sort(_routing(37, e, 2, seed=8), e)
    xq = nvfp4.quantize(_rand(37, k, seed=9)[srt.tokens])
    _check_against_dense(gg.grouped_gemm(xq, gg.stack_experts(experts), srt.offsets, torch.float32), xq, experts, srt.offsets)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_grouped_bits_do_not_depend_on_the_tile(block_m):
    e, n, k = SHAPES[0]
    t, topk = (45, 3) if DEVICE == "cpu" else (900, 8)
    experts = _experts(e, n, k)
    w = gg.stack_experts(experts)
    srt = gg.moe_sort(_routing(t, e, topk, seed=5), e)
    xq = nvfp4.quantize(_rand(t, k, seed=6)[srt.tokens])
    # on the GPU also the rest of the swapped tile chosen for that BLOCK_M by the dense kernel
    gg.CONFIG_OVERRIDE = dict(BLOCK_M=block_m, **({} if DEVICE == "cpu" else SWAP_CONFIGS[block_m]))
    try:
        out = gg.grouped_gemm(xq, w, srt.offsets, torch.float32)
    finally:
        gg.CONFIG_OVERRIDE = None
    assert torch.equal(out, gg.grouped_gemm(xq, w, srt.offsets, torch.float32))
    _check_against_dense(out, xq, experts, srt.offsets)


def test_grouped_matches_the_torch_reference():
    e, n, k = SHAPES[0]
    t, topk = (30, 2) if DEVICE == "cpu" else (512, 8)
    experts = _experts(e, n, k)
    srt = gg.moe_sort(_routing(t, e, topk, seed=7), e)
    xq = nvfp4.quantize(_rand(t, k, seed=8)[srt.tokens])
    out = gg.grouped_gemm(xq, gg.stack_experts(experts), srt.offsets, torch.float32)
    offs = srt.offsets.tolist()
    for i, w in enumerate(experts):
        lo, hi = offs[i], offs[i + 1]
        if hi == lo:
            continue
        ref = reference.mm_nvfp4(_rows(xq, lo, hi), w)
        mag = reference.mm_nvfp4(_abs(_rows(xq, lo, hi)), _abs(w))
        assert ((out[lo:hi] - ref).abs() / (mag + 1e-30)).max().item() < k * 2**-24


def _abs(t):
    """The same NVFP4 tensor with every sign bit cleared: |x|, for the error bound's magnitudes."""
    return nvfp4.NVFP4Tensor(t.data & 0x77, t.scale, t.global_scale, t.shape)


def test_moe_sort_is_stable_and_consistent():
    e, topk = 7, 3
    top = _routing(50, e, topk, seed=9, skip=(4,))
    srt = gg.moe_sort(top, e)
    flat = top.reshape(-1)
    assert srt.offsets.dtype == torch.int32 and srt.offsets.device == top.device and srt.offsets.shape == (e + 1,)
    assert torch.equal(srt.offsets, torch.cat([torch.zeros(1, device=DEVICE, dtype=torch.int64),
                                               torch.bincount(flat, minlength=e).cumsum(0)]).to(torch.int32))
    assert srt.offsets[4] == srt.offsets[5]  # the skipped expert owns no rows
    sorted_e = flat[srt.perm]
    assert torch.equal(sorted_e, torch.sort(flat).values)
    assert torch.equal(srt.tokens, srt.perm // topk)
    offs = srt.offsets.tolist()
    for i in range(e):  # stable: within an expert, rows keep (token, slot) order
        seg = srt.perm[offs[i]:offs[i + 1]]
        assert torch.equal(seg, torch.sort(seg).values)
        assert bool((flat[seg] == i).all())
    assert torch.equal(gg.moe_sort(top, e).perm, srt.perm)


def test_stack_experts_layout():
    e, n, k = 3, 24, 64
    experts = _experts(e, n, k)
    w = gg.stack_experts(experts)
    assert w.shape == (e, n, k) and w.data.shape == (e, n, k // 2) and w.scale.shape == (e, n, k // 16)
    assert w.global_scale.shape == (e, n, 1) and w.global_scale.stride(1) == 0  # a view of [E, 1, 1]
    for i, t in enumerate(experts):
        assert torch.equal(w.data[i], t.data) and torch.equal(w.global_scale[i, 0, 0], t.global_scale)
    per_row = gg.stack_experts(_experts(e, n, k, "row"))
    assert per_row.global_scale.shape == (e, n, 1) and per_row.global_scale.stride(1) == 1
    with pytest.raises(ValueError, match="one shape"):
        gg.stack_experts([experts[0], _experts(1, n + 8, k)[0]])
    with pytest.raises(ValueError, match="mix"):
        gg.stack_experts([experts[0], _experts(1, n, k, "row")[0]])
    with pytest.raises(ValueError, match="int32"):
        gg.grouped_gemm(nvfp4.quantize(_rand(4, k)), w, torch.zeros(e + 1, dtype=torch.int64, device=DEVICE))


def test_grouped_empty_and_all_rows_to_one_expert():
    e, n, k = 4, 40, 64
    experts = _experts(e, n, k)
    w = gg.stack_experts(experts)
    top = torch.full((9, 1), 2, device=DEVICE)
    srt = gg.moe_sort(top, e)
    xq = nvfp4.quantize(_rand(9, k, seed=11)[srt.tokens])
    out = gg.grouped_gemm(xq, w, srt.offsets, torch.float32)
    assert torch.equal(out, gemm_triton(xq, experts[2], None, torch.float32))
    empty = gg.moe_sort(top[:0], e)
    assert gg.grouped_gemm(_rows(xq, 0, 0), w, empty.offsets).shape == (0, n)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs and sync checks need a GPU")
def test_grouped_is_sync_free_and_graph_capturable():
    e, n, k, t, topk = 8, 768, 1024, 64, 8
    experts = _experts(e, n, k)
    w = gg.stack_experts(experts)
    x = _rand(t, k, seed=12)
    srt = gg.moe_sort(_routing(t, e, topk, seed=13), e)
    xq = nvfp4.quantize(x[srt.tokens])
    top = _routing(t, e, topk, seed=13)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in moe_sort or the launcher raises
    try:
        gg.moe_sort(top, e)
        gg.grouped_gemm(xq, w, srt.offsets, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    offsets = srt.offsets.clone()
    static_x = xq
    gg.grouped_gemm(static_x, w, offsets, torch.bfloat16)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gg.grouped_gemm(static_x, w, offsets, torch.bfloat16)
    for seed in (13, 14, 15):  # new routing, same buffers: replay, no relaunch
        srt = gg.moe_sort(_routing(t, e, topk, seed=seed), e)
        new_xq = nvfp4.quantize(x[srt.tokens])
        for dst, src in ((static_x.data, new_xq.data), (static_x.scale, new_xq.scale),
                         (static_x.global_scale, new_xq.global_scale), (offsets, srt.offsets)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        _check_against_dense(out, static_x, experts, offsets)
