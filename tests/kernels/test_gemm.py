"""Several weights in one GEMM launch (`gemm.gemm_many_triton`, the q/k/v and gate/up projections of a
layer): each output has the bits of a launch for that weight alone, for every tile path (swapped split
K chunks + combine, the one-program chunk walk, decoded wide tiles, plain dtypes), with biases, and with
weights that cannot share a launch (other K chunks, biases on some only); which weights share one.

On a CPU machine the kernels run under the Triton interpreter (small shapes); on a GPU, on the GPU.
"""
import pytest
import torch
from tests.backends import DEVICE, HAS_CUDA, HAS_TRITON

from minite_core import nvfp4

pytestmark = [pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter,
              pytest.mark.skipif(not HAS_TRITON, reason="triton missing")]

if HAS_TRITON:
    from minite_core.kernels import gemm


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    return rows.to(DEVICE)


# (K, widths of the weights) with one K chunk count for all widths (they share one launch), and M values
# on the swapped split path (M <= SWAP_MAX_M, S > 1), and the wide decoded walk (M > SWAP_MAX_M)
if DEVICE == "cpu":
    K, WIDTHS, MS = 96, (40, 24, 24), (3, 17, 140)  # interpreter: S = 2 for N <= 64
else:
    K, WIDTHS, MS = 1024, (2048, 1024, 1024), (1, 16, 100, 300)  # Qwen3-0.6B q/k/v: S = 4


def _weights(widths, mode="tensor", seed=10):
    return [nvfp4.quantize(_rand(n, K, seed=seed + i) * 0.1, scale_mode=mode) for i, n in enumerate(widths)]


@pytest.mark.parametrize("combine", ["in-kernel", "combine-kernel"])
@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("m", MS)
def test_weights_in_one_launch_have_the_bits_of_separate_launches(monkeypatch, combine, mode, m):
    """Split K chunks are added by the tile's last program (COMBINE_IN_KERNEL) or by the combine kernel: the
    same bits either way, and the arrival counters are all zero again after every launch."""
    monkeypatch.setattr(gemm, "COMBINE_IN_KERNEL", combine == "in-kernel")
    ws = _weights(WIDTHS, mode)
    assert len({gemm.k_chunks(w.shape[0], K) for w in ws}) == 1
    cfgs = [gemm.gemm_config(m, w.shape[0], K, True) for w in ws]
    assert gemm.launch_groups(cfgs, ws, [None] * 3) == [range(0, 3)]  # q/k/v: one launch
    xq = nvfp4.quantize(_rand(m, K, seed=3))
    for dtype in (torch.float32, torch.bfloat16):
        outs = gemm.gemm_many_triton(xq, ws, [None] * 3, dtype)
        for w, out in zip(ws, outs):
            assert out.shape == (m, w.shape[0]) and out.dtype == dtype
            assert torch.equal(out, gemm.gemm_triton(xq, w, None, dtype))
    biases = [_rand(1, w.shape[0], seed=20 + i)[0].to(torch.bfloat16) for i, w in enumerate(ws)]
    outs = gemm.gemm_many_triton(xq, ws, biases, torch.bfloat16)
    for w, b, out in zip(ws, biases, outs):
        assert torch.equal(out, gemm.gemm_triton(xq, w, b, torch.bfloat16))
    r = max(m, gemm.SWAP_MAX_M + 1)  # rows enough for the wide walk, the first m of them xq's
    walk = gemm.gemm_triton(nvfp4.NVFP4Tensor(xq.data.repeat(r, 1)[:r], xq.scale.repeat(r, 1)[:r],
                                              xq.global_scale.repeat(r, 1)[:r], (r, K)), ws[0], None, torch.float32)
    assert torch.equal(gemm.gemm_triton(xq, ws[0], None, torch.float32), walk[:m])  # split == one-program walk
    assert not gemm.tile_counters(xq.data.device, 1).any()


def test_weights_that_cannot_share_a_launch_get_their_own():
    """Other K chunk counts, a bias on some weights only, more than three weights: separate launches, the
    same bits as single launches."""
    wide = 8 * WIDTHS[0]  # enough tile columns that S drops
    ws = _weights((WIDTHS[1], wide, WIDTHS[2], WIDTHS[1], WIDTHS[2]), seed=30)
    assert gemm.k_chunks(wide, K) != gemm.k_chunks(WIDTHS[1], K)
    biases = [None, None, None, None, _rand(1, WIDTHS[2], seed=5)[0]]
    m = MS[1]
    cfgs = [gemm.gemm_config(m, w.shape[0], K, True) for w in ws]
    assert gemm.launch_groups(cfgs, ws, biases) == [range(0, 1), range(1, 2), range(2, 4), range(4, 5)]
    xq = nvfp4.quantize(_rand(m, K, seed=4))
    outs = gemm.gemm_many_triton(xq, ws, biases, torch.float32)
    for w, b, out in zip(ws, biases, outs):
        assert torch.equal(out, gemm.gemm_triton(xq, w, b, torch.float32))
    four = _weights((WIDTHS[1],) * 4, seed=40)
    assert [len(r) for r in gemm.launch_groups(cfgs[:1] * 4, four, [None] * 4)] == [3, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_plain_weights_in_one_launch(dtype):
    ws = [(_rand(n, K, seed=50 + i) * 0.1).to(dtype) for i, n in enumerate(WIDTHS)]
    for m in (MS[0], MS[-1]):
        x = _rand(m, K, seed=6).to(dtype)
        outs = gemm.gemm_many_triton(x, ws, [None] * 3, dtype)
        for w, out in zip(ws, outs):
            assert torch.equal(out, gemm.gemm_triton(x, w, None, dtype))


@pytest.mark.parametrize("m", (MS[1], MS[-1]))  # the swapped split tiles and the wide decoded walk
def test_rows_of_more_dims_read_in_place_or_reshaped_have_the_bits_of_2d_rows(m):
    """x [B, T, K] (a model's activations): its rows read where they lie when its parts are contiguous, reshaped
    when they are not (a slice of the positions); either way each output row has the bits of the same row in a
    2-D x, the outputs [B, T, N]."""
    x = _rand(m, 2, K, seed=8)
    ws = _weights(WIDTHS, "row", seed=70)
    plain = [(_rand(n, K, seed=80 + i) * 0.1).to(torch.bfloat16) for i, n in enumerate(WIDTHS[:2])]
    qx = nvfp4.quantize(x)
    strided = nvfp4.NVFP4Tensor(qx.data[:, :1], qx.scale[:, :1], qx.global_scale[:, :1], (m, 1, K))  # gaps between rows
    for rows3, q3, rows2 in ((x, qx, x.reshape(-1, K)), (x[:, :1], strided, x[:, 0])):  # contiguous / strided positions
        for w, out3, out2 in zip(ws, gemm.gemm_many_triton(q3, ws, [None] * 3, torch.float32),
                                 gemm.gemm_many_triton(nvfp4.quantize(rows2), ws, [None] * 3, torch.float32)):
            assert out3.shape == tuple(rows3.shape[:-1]) + (w.shape[0],)
            assert torch.equal(out3.reshape(out2.shape), out2)
        for out3, out2 in zip(gemm.gemm_many_triton(rows3.to(torch.bfloat16), plain, [None] * 2, torch.float32),
                              gemm.gemm_many_triton(rows2.to(torch.bfloat16), plain, [None] * 2, torch.float32)):
            assert torch.equal(out3.reshape(out2.shape), out2)


@pytest.mark.parametrize("tile_max", [128, 256])
@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_swapped_tiles_over_several_row_tiles_have_the_bits_of_the_default_tiles(monkeypatch, mode, tile_max):
    """SWAP_MAX_M raised (a decode step of more sequences on the swapped tiles that read the packed weight,
    instead of the wide tiles that decode it): the rows go in swapped tiles of SWAP_TILE_MAX rows (128, or 256:
    one weight decode for up to 256 rows), and every output has the bits of the wide tiles at this M, for NVFP4
    and bf16 weights."""
    m = 300
    ws = _weights(WIDTHS, mode, seed=90)
    plain = [(_rand(n, K, seed=95 + i) * 0.1).to(torch.bfloat16) for i, n in enumerate(WIDTHS)]
    xq, x = nvfp4.quantize(_rand(m, K, seed=9)), _rand(m, K, seed=9).to(torch.bfloat16)
    wide = gemm.gemm_many_triton(xq, ws, [None] * 3, torch.float32), gemm.gemm_many_triton(x, plain, [None] * 3, torch.float32)
    monkeypatch.setattr(gemm, "SWAP_MAX_M", 512)
    monkeypatch.setattr(gemm, "SWAP_TILE_MAX", tile_max)
    for fp4 in (True, False):
        cfg = gemm.gemm_config(m, WIDTHS[0], K, fp4)
        assert cfg["SWAP_AB"] and cfg["BLOCK_M"] <= tile_max, cfg  # (several row tiles; interpreted plain: 16)
        assert cfg["BLOCK_M"] == tile_max or not fp4, cfg  # (W4A4: two row tiles)
    swapped = gemm.gemm_many_triton(xq, ws, [None] * 3, torch.float32), gemm.gemm_many_triton(x, plain, [None] * 3, torch.float32)
    for a, b in zip(wide[0] + wide[1], swapped[0] + swapped[1]):
        assert torch.equal(a, b)
    assert not gemm.tile_counters(xq.device, 1).any()  # the split tiles' arrival counters back at zero


def test_empty_rows_and_empty_weights():
    ws = _weights((WIDTHS[1], 0, WIDTHS[2]), seed=60)
    xq = nvfp4.quantize(_rand(MS[1], K, seed=7))
    outs = gemm.gemm_many_triton(xq, ws, [None] * 3, torch.float32)
    assert [o.shape for o in outs] == [(MS[1], WIDTHS[1]), (MS[1], 0), (MS[1], WIDTHS[2])]
    assert torch.equal(outs[2], gemm.gemm_triton(xq, ws[2], None, torch.float32))
    empty = nvfp4.NVFP4Tensor(xq.data[:0], xq.scale[:0], xq.global_scale[:0], (0, K))
    assert [o.shape for o in gemm.gemm_many_triton(empty, ws, [None] * 3, torch.float32)] == [(0, n) for n in (WIDTHS[1], 0, WIDTHS[2])]


def test_tile_counters_grow_without_freeing_what_a_graph_may_address():
    dev = torch.device(DEVICE)
    small = gemm.tile_counters(dev, 1)
    big = gemm.tile_counters(dev, small.numel() + 1)
    assert big.numel() > small.numel() and not big.any()
    assert gemm.tile_counters(dev, 1) is big  # the newest serves every later launch
    assert any(b is small for bufs in gemm._COUNTERS.values() for b in bufs)  # the old one stays allocated


def _k_chunks_in_process(env: dict, n: int, k: int):
    """k_chunks(n, k) in a fresh interpreter with `env` (MINITE_MAX_K_CHUNKS is read at import)."""
    import os
    import subprocess
    import sys
    code = f"from minite_core.kernels import gemm; print(gemm.k_chunks({n}, {k}))"
    base = {key: v for key, v in os.environ.items() if key != "MINITE_MAX_K_CHUNKS"}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True)


def test_max_k_chunks_caps_every_shape_and_rejects_bad_values(monkeypatch):
    """MINITE_MAX_K_CHUNKS caps S for every (N, K) in the process (both engines import the one module):
    the benchmarks' way to weigh fewer chunks (the learner's wide tiles) against more (the decode's programs).
    Without it the cap is DEFAULT_MAX_CHUNKS."""
    n, k = 64, 4096  # few column tiles, many K steps: a large S without a cap (32 on the GPU, 4 interpreted)
    with monkeypatch.context() as mp:
        mp.setattr(gemm, "MAX_CHUNKS", 1 << 20)
        uncapped = gemm.k_chunks(n, k)
    assert uncapped >= 4 and gemm.k_chunks(n, k) == min(gemm.DEFAULT_MAX_CHUNKS, uncapped)
    for cap in (1, 2, uncapped * 2):
        run = _k_chunks_in_process({"MINITE_MAX_K_CHUNKS": str(cap)}, n, k)
        assert run.returncode == 0, run.stderr
        assert int(run.stdout) == min(cap, uncapped)
    run = _k_chunks_in_process({}, n, k)
    assert run.returncode == 0 and int(run.stdout) == min(gemm.DEFAULT_MAX_CHUNKS, uncapped), run.stderr
    for bad in ("3", "0", "two", "-2"):
        run = _k_chunks_in_process({"MINITE_MAX_K_CHUNKS": bad}, n, k)
        assert run.returncode != 0 and "MINITE_MAX_K_CHUNKS" in run.stderr and "power of two" in run.stderr


def test_wide_packed_bound_from_the_environment(monkeypatch):
    """MINITE_WIDE_PACKED_MAX_M: a row count, 0 for off; anything else is refused with the variable's name."""
    monkeypatch.delenv("MINITE_WIDE_PACKED_MAX_M", raising=False)
    assert gemm._wide_packed_from_env() == gemm.DEFAULT_WIDE_PACKED_MAX_M
    for value, bound in (("4096", 4096), ("0", None)):
        monkeypatch.setenv("MINITE_WIDE_PACKED_MAX_M", value)
        assert gemm._wide_packed_from_env() == bound
    for bad in ("-1", "4k", ""):
        monkeypatch.setenv("MINITE_WIDE_PACKED_MAX_M", bad)
        with pytest.raises(ValueError, match="MINITE_WIDE_PACKED_MAX_M"):
            gemm._wide_packed_from_env()


def test_swap_bound_from_the_environment(monkeypatch):
    """MINITE_SWAP_MAX_M: a row count >= 1; anything else is refused with the variable's name."""
    monkeypatch.delenv("MINITE_SWAP_MAX_M", raising=False)
    default = gemm.INTERPRETER_SWAP_MAX_M if gemm.interpreting() else gemm.DEFAULT_SWAP_MAX_M
    assert gemm._swap_bound_from_env() == default == (128 if gemm.interpreting() else 256)
    monkeypatch.setenv("MINITE_SWAP_MAX_M", "200")
    assert gemm._swap_bound_from_env() == 200
    for bad in ("0", "-1", "2k", ""):
        monkeypatch.setenv("MINITE_SWAP_MAX_M", bad)
        with pytest.raises(ValueError, match="MINITE_SWAP_MAX_M"):
            gemm._swap_bound_from_env()


def test_the_launchers_integer_helpers_equal_tritons():
    """`gemm.cdiv` / `gemm.next_pow2` (plain integers: Triton's are ~2 µs constexpr_function calls) give
    `triton.cdiv` / `triton.next_power_of_2`'s values, powers of two and their neighbours included."""
    import triton

    ns = sorted({0, 1, 2, 3} | {p + d for p in (2 ** e for e in range(2, 40)) for d in (-1, 0, 1)})
    assert [gemm.next_pow2(n) for n in ns] == [triton.next_power_of_2(n) for n in ns]
    for b in (1, 2, 3, 16, 64, 128, 1000):
        assert [gemm.cdiv(a, b) for a in ns] == [triton.cdiv(a, b) for a in ns], b
