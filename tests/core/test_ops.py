"""The op surface on both backends: quantize bit-exact across backends, GEMMs batch-invariant bit for
bit and within fp32-accumulation tolerance of an fp64 reference, autograd, and bad input.

On a CPU machine the Triton cases run under the interpreter (small shapes); on a GPU, on the GPU.
"""
import dataclasses

import pytest
import torch
from tests.backends import DEVICE, HAS_CUDA, HAS_TRITON, CudaScalarDivision, backend_params

from minite_core import nvfp4, ops, reference

BACKENDS = backend_params()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g) * 2)
    return rows.to(dtype).to(DEVICE)


def _weights(n, k, seed=1):
    w = _rand(n, k, seed=seed) * 0.1
    return {
        "nvfp4-tensor": nvfp4.quantize(w, scale_mode="tensor"),
        "nvfp4-row": nvfp4.quantize(w, scale_mode="row"),
        "bf16": w.to(torch.bfloat16),
        "fp32": w,
    }


def _same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ quantize


@pytest.mark.skipif(not HAS_CUDA and not HAS_TRITON, reason="triton missing")
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,k", [(1, 16), (7, 48), (37, 272), (130, 64), (2, 8208)])
@pytest.mark.parametrize("mode", ["row", "tensor"])
def test_triton_quantize_is_bit_exact_with_torch(dtype, rows, k, mode):
    x = _rand(rows, k, seed=rows + k, dtype=dtype)
    x[0, :16] = 0.0  # a zero block
    if rows > 3:
        x[2] = 0.0  # an all-zero row
        x[3, 1] = -0.0
        x[3, 5] = x[3].abs().max() * 7  # an outlier
    ref = ops.quantize(x, scale_mode=mode, backend="torch")
    got = ops.quantize(x, scale_mode=mode, backend="triton")
    assert _same_bits(got.data, ref.data)
    assert _same_bits(got.scale, ref.scale)
    assert _same_bits(got.global_scale, ref.global_scale)


@pytest.mark.skipif(not HAS_CUDA and not HAS_TRITON, reason="triton missing")
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,k", [(1, 16), (7, 48), (37, 272), (3, 2048)])
def test_triton_quantize_whole_row_tile_is_the_chunk_walk(monkeypatch, dtype, rows, k):
    """Few rows (a decode step's) take the whole row in one tile (`quantize.one_tile`), many rows the chunk
    walk: the same bytes, scales and global scales, and the same decoded form. (The test above compares the
    tile with the torch backend, so this one carries the walk to it.)"""
    from minite_core.kernels import quantize as qk

    x = _rand(rows, k, seed=rows * k, dtype=dtype)
    x[0, :16] = 0.0  # a zero block
    x[-1, -1] = x[-1].abs().max() * 9  # an outlier in the row's last block
    assert qk.one_tile(rows, k) >= k and qk.one_tile(qk.ONE_TILE_MAX_ROWS + 1, k) == 0
    tile = [qk.quantize_triton(x, None, decoded=d) for d in (False, True)]
    monkeypatch.setattr(qk, "ONE_TILE_MAX_ROWS", 0)  # every row count walks
    assert qk.one_tile(rows, k) == 0
    for a, b in zip(tile, [qk.quantize_triton(x, None, decoded=d) for d in (False, True)]):
        assert _same_bits(a.data, b.data) and _same_bits(a.scale, b.scale)
        assert _same_bits(a.global_scale, b.global_scale)
    assert torch.equal(tile[1].decoded, b.decoded)


@pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="triton missing")
def test_triton_quantize_explicit_scale_saturates_like_torch():
    x = _rand(9, 64, seed=3)
    gs = torch.tensor(x.abs().max().item() / 2688 / 50, device=DEVICE)  # forces saturation
    ref = ops.quantize(x, global_scale=gs, backend="torch")
    got = ops.quantize(x, global_scale=gs, backend="triton")
    assert _same_bits(got.data, ref.data) and _same_bits(got.scale, ref.scale)
    assert (ref.scale.view(torch.uint8) == 0x7E).any()  # 448 reached


# ------------------------------------------------------------------------------------------------ GEMM


def _fp64_reference(x, w, scale_mode):
    """(x @ w.T, |x| @ |w|.T) in fp64 on the operands the GEMM multiplies."""
    if isinstance(w, nvfp4.NVFP4Tensor):
        a, b = nvfp4.quantize(x, scale_mode=scale_mode).dequantize(torch.float64), w.dequantize(torch.float64)
    else:
        a, b = x.to(w.dtype).double(), w.double()
    return a @ b.T, a.abs() @ b.abs().T


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wkind", ["nvfp4-tensor", "nvfp4-row", "bf16", "fp32"])
def test_linear_is_batch_invariant(backend, wkind):
    m, n, k = (67, 40, 96) if DEVICE == "cpu" else (300, 520, 1024)
    w = _weights(n, k)[wkind]
    x = _rand(m, k, seed=5)
    y = ops.linear(x, w, backend=backend)
    rows = range(m) if DEVICE == "cuda" else [0, 1, 15, 16, 17, 33, m - 1]
    for i in rows:
        assert torch.equal(ops.linear(x[i : i + 1], w, backend=backend), y[i : i + 1]), f"row {i}"
    # a different batch around the same rows: other rows before, after, and a different M
    other = _rand(13, k, seed=6)
    y2 = ops.linear(torch.cat([other, x[:20], other[:3]]), w, backend=backend)
    assert torch.equal(y2[13:33], y[:20])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wkind,scale_mode", [("nvfp4-tensor", "row"), ("nvfp4-row", "row"), ("nvfp4-tensor", "tensor"),
                                               ("nvfp4-row", "tensor"), ("bf16", "row"), ("fp32", "row")])
def test_linear_matches_fp64_reference(backend, wkind, scale_mode):
    m, n, k = (19, 40, 160) if DEVICE == "cpu" else (257, 384, 2048)
    w = _weights(n, k, seed=7)[wkind]
    x = _rand(m, k, seed=8)
    y = ops.linear(x, w, backend=backend, scale_mode=scale_mode)
    ref, mag = _fp64_reference(x, w, scale_mode)
    # fp32 accumulation of K products errs by at most ~K * 2^-24 of the sum of their magnitudes
    err = ((y.double() - ref).abs() / (mag + 1e-30)).max().item()
    assert err < k * 2**-24, err
    assert y.dtype == x.dtype


INVARIANCE_MS = [1, 5, 16, 17, 40, 64, 100, 128, 129, 300] + ([] if DEVICE == "cpu" else [256, 257])  # (the swap
# bound: 128 interpreted, 256 on the GPU)
# (N, K, S = the K chunks): S = 1 (one chain), S > 1 split over programs (M <= SWAP_MAX_M) or walked in one
# (M > SWAP_MAX_M)
# (on the CPU interpreter one shape per chunk count, K not a power of two where it splits: CI time)
# (the K chunks' walk for M > SWAP_MAX_M has three forms, `gemm.walk_mode`: on the CPU K = 224 at S = 2 gives chunks
# of 2 steps of 64, at S = 4 one-step chunks; on the GPU 12288 x 4096 chunks of 16 steps (a loop over chunks),
# 6144 x 2000 of 4, 2048 x 512 of one; test_the_shapes_cover_both_walks)
INVARIANCE_SHAPES = ([(40, 64, 1), (100, 224, 2), (40, 224, 4)] if DEVICE == "cpu" else
                     [(17000, 1024, 1), (12288, 4096, 2), (1024, 1024, 4), (1536, 2048, 4), (2048, 512, 4), (6144, 2000, 4)])


@pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="triton missing")
def test_the_shapes_cover_both_walks():
    from minite_core.kernels.gemm import gemm_config, walk_mode

    modes = set()
    for n, k, _ in INVARIANCE_SHAPES:
        cfg = gemm_config(300, n, k, True)
        modes.add(walk_mode(k, cfg["CHUNKS"], cfg["BLOCK_K"]))
    # and the long chunks' walk (3): on the GPU 12288 x 4096 (chunks of 16 steps), on the CPU
    # test_the_long_chunk_walk_equals_the_split_programs
    assert modes == ({0, 1, 2} if DEVICE == "cpu" else {0, 1, 2, 3}), modes


@pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="triton missing")
@pytest.mark.parametrize("wkind", ["nvfp4-tensor", "nvfp4-row"])
@pytest.mark.parametrize("n,k,chunks", INVARIANCE_SHAPES, ids=lambda v: str(v))
def test_w4a4_gemm_rows_do_not_depend_on_the_tile_config(wkind, n, k, chunks):
    """The W4A4 kernel picks its tile by M (swapped narrow tiles of 16/32/64/128 columns up to M = SWAP_MAX_M,
    wide tiles above) and, where (N, K) has K chunks, runs them in separate programs plus a combine kernel
    (M <= SWAP_MAX_M) or in sequence in one program (M > SWAP_MAX_M): gemm(x[:1]) == gemm(x)[:1] and every row of an
    M-row product == the same row of the 300-row product, bit for bit, for M across every bucket."""
    from minite_core.kernels.gemm import gemm_config, gemm_triton, k_chunks

    assert k_chunks(n, k) == chunks
    w = _weights(n, k, seed=31)[wkind]
    xq = nvfp4.quantize(_rand(max(INVARIANCE_MS), k, seed=32))
    cfgs = [gemm_config(m, n, k, True) for m in INVARIANCE_MS]
    configs = {(c["BLOCK_M"], c["BLOCK_N"], c["SWAP_AB"], c["SPLIT"]) for c in cfgs}
    assert len(configs) >= 5, configs  # the test crosses tile configs
    assert len({(c["BLOCK_K"], c["CHUNKS"]) for c in cfgs}) == 1
    assert {c["SPLIT"] for c in cfgs} == ({False, True} if chunks > 1 else {False})

    def rows(lo, hi):
        return nvfp4.NVFP4Tensor(xq.data[lo:hi], xq.scale[lo:hi], xq.global_scale[lo:hi], (hi - lo, k))

    for dtype in (torch.float32, torch.bfloat16):
        ref = gemm_triton(rows(0, 300), w, None, dtype)
        one = gemm_triton(rows(0, 1), w, None, dtype)
        for m in INVARIANCE_MS:
            y = gemm_triton(rows(0, m), w, None, dtype)
            assert torch.equal(one, y[:1]), f"M={m}: gemm(x[:1]) != gemm(x)[:1]"
            assert torch.equal(y, ref[:m]), f"M={m}: rows differ from the same rows in the 300-row product"
        for lo, m in ((7, 1), (33, 17), (150, 100), (171, 129)):  # rows at other positions in their tiles
            assert torch.equal(gemm_triton(rows(lo, lo + m), w, None, dtype), ref[lo:lo + m]), (lo, m)
    # with a bias: the combine kernel's epilogue == the one-program epilogue
    bias = _rand(1, n, seed=33)[0].to(torch.bfloat16)
    ref = gemm_triton(rows(0, 300), w, bias, torch.bfloat16)
    for m in (5, 129):
        assert torch.equal(gemm_triton(rows(0, m), w, bias, torch.bfloat16), ref[:m]), f"bias, M={m}"
    # close to the torch reference (fp32 accumulation error bound)
    exact = reference.mm_nvfp4(rows(0, 300), w)
    mag = reference.mm_nvfp4(_nvfp4_abs(rows(0, 300)), _nvfp4_abs(w))
    got = gemm_triton(rows(0, 300), w, None, torch.float32)
    assert ((got - exact).abs() / (mag + 1e-30)).max().item() < k * 2**-24


@pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="triton missing")
@pytest.mark.parametrize("decode_wide", [True, False])
def test_the_long_chunk_walk_equals_the_split_programs(monkeypatch, decode_wide):
    """Chunks of LONG_CHUNK_STEPS steps or more are walked by a loop over chunks around a loop over steps
    (CHUNKED = 3): the bits of the split programs (M <= SWAP_MAX_M) that compute each chunk alone. On the CPU the
    threshold is lowered so that a test shape (chunks of 2 steps) takes that walk."""
    from minite_core.kernels import gemm

    n, k, chunks = [s for s in INVARIANCE_SHAPES if s[2] == 2][0]
    bk = gemm.gemm_config(300, n, k, True)["BLOCK_K"]
    monkeypatch.setattr(gemm, "LONG_CHUNK_STEPS", gemm.chunk_elements(k, chunks, bk) // bk)
    monkeypatch.setattr(gemm, "DECODE_WIDE", decode_wide)
    assert gemm.walk_mode(k, chunks, bk) == 3
    w = _weights(n, k, seed=51)["nvfp4-row"]
    xq = nvfp4.quantize(_rand(300, k, seed=52) * torch.logspace(-3, 2, 300, device=DEVICE).unsqueeze(1))
    walked = gemm.gemm_triton(xq, w, None, torch.float32)
    for lo, m in ((0, 1), (40, 17), (150, 128)):
        rows = nvfp4.NVFP4Tensor(xq.data[lo:lo + m], xq.scale[lo:lo + m], xq.global_scale[lo:lo + m], (m, k))
        assert gemm.gemm_config(m, n, k, True)["SPLIT"]
        assert torch.equal(gemm.gemm_triton(rows, w, None, torch.float32), walked[lo:lo + m]), (lo, m)


@pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="triton missing")
@pytest.mark.parametrize("n,k,chunks", INVARIANCE_SHAPES, ids=lambda v: str(v))
def test_wide_tiles_on_decoded_operands_equal_the_packed_kernel(monkeypatch, n, k, chunks):
    """M > SWAP_MAX_M decodes both operands once (`decode_nvfp4`: fp16 code * scale, each K step's evens then its
    odds) and runs the same tile on them: the bits of the tile that decodes the packed bytes itself."""
    from minite_core.kernels import gemm

    m = gemm.SWAP_MAX_M + 44  # the wide tiles' rows
    w = _weights(n, k, seed=41)["nvfp4-tensor"]
    xq = nvfp4.quantize(_rand(m, k, seed=42) * torch.logspace(-4, 2, m, device=DEVICE).unsqueeze(1))
    assert gemm.gemm_config(m, n, k, True)["DECODED"]
    decoded = gemm.gemm_triton(xq, w, None, torch.float32)
    monkeypatch.setattr(gemm, "DECODE_WIDE", False)
    assert not gemm.gemm_config(m, n, k, True)["DECODED"]
    assert torch.equal(decoded, gemm.gemm_triton(xq, w, None, torch.float32))
    # the decoded layout: code * block scale, each K step as its even elements then its odd ones, zeros past K
    bk = 64 if gemm.interpreting() else gemm.FP4_BLOCK_K
    d = gemm.decode_nvfp4(w, bk)
    full = torch.nn.functional.pad(nvfp4.dequantize_unscaled(w), (0, d.shape[1] - k))
    assert d.dtype == torch.float16 and d.shape == (n, -(-k // bk) * bk)
    assert torch.equal(d.float(), full.view(n, -1, bk // 2, 2).transpose(2, 3).reshape(n, -1))


@pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="triton missing")
@pytest.mark.parametrize("n,k,chunks", INVARIANCE_SHAPES, ids=lambda v: str(v))
def test_a_weight_decoded_at_its_requantize_gives_the_gemm_its_bits(monkeypatch, n, k, chunks):
    """`ops.quantize_weights(..., decoded=True)` (the learner's re-quantize) hands each weight its decoded form,
    which the wide tiles read instead of decoding the weight: the same bits at every M bucket, and the same
    bits as the weight quantized without it (or with the bench setting that turns the decoded forms off)."""
    from minite_core.kernels import gemm

    with monkeypatch.context() as mp:
        mp.setattr(gemm, "OPERANDS_DECODED_ONCE", False)
        off, = ops.quantize_weights([_rand(n, k, seed=43) * 0.05], backend="triton", decoded=True)
        assert off.decoded is None and not gemm.decodes_activation(gemm.SWAP_MAX_M + 44)

    master = _rand(n, k, seed=43) * 0.05
    plain, = ops.quantize_weights([master], backend="triton")
    cached, = ops.quantize_weights([master], backend="triton", decoded=True)
    assert plain.decoded is None and cached.decoded is not None
    assert cached.decoded.shape == (n, -(-k // gemm.fp4_block_k()) * gemm.fp4_block_k())
    for m in (1, 16, gemm.SWAP_MAX_M + 44):
        x = nvfp4.quantize(_rand(m, k, seed=44 + m))
        assert torch.equal(gemm.gemm_triton(x, cached, None, torch.float32), gemm.gemm_triton(x, plain, None, torch.float32)), m


def _model_linear_shapes() -> list[tuple[int, int]]:
    """(N, K) of every weight that NVFP4 precision quantizes in the benchmarks' Qwen3 configs (bench/common.py:
    0.6B, 1.7B and the MoE's attention and experts), from the model's own list of its tensors."""
    from bench.common import CONFIGS, make_config
    from minite_core.model.load import is_linear_weight

    return sorted({shape for name in CONFIGS for t, shape in make_config(name, 4096).expected_shapes().items()
                   if is_linear_weight(t)})


# on the CPU interpreter two small stand-ins (S = 2 and 4 K chunks, both ending in a part K step): the same path
MODEL_SHAPES = [(100, 224), (40, 208)] if DEVICE == "cpu" else _model_linear_shapes()


@pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="triton missing")
@pytest.mark.parametrize("n,k", MODEL_SHAPES, ids=lambda v: str(v))
def test_every_model_linear_gets_the_rollout_kernels_bits_from_the_learners_decoded_operands(monkeypatch, n, k):
    """Issue 18's lever 1 on every linear (N, K) of the 0.6B, 1.7B and MoE configs: the learner's GEMM (the
    wide tiles on the fp16 operands that the re-quantize and the activation's quantize decoded) gives the bits
    of the same tiles decoding the operands themselves, and of the wide tile decoding the packed bytes; and
    each row, the bits of that row through the rollout's narrow tiles (M = 1, 16, 64: split K chunks)."""
    from minite_core.kernels import gemm

    w, = ops.quantize_weights([_rand(n, k, seed=61) * 0.05], backend="triton", decoded=True)
    x = _rand(300, k, seed=62) * torch.logspace(-3, 2, 300, device=DEVICE).unsqueeze(1)
    xq = ops.quantize(x, backend="triton", decoded=True)
    assert w.decoded is not None and xq.decoded is not None and gemm.gemm_config(300, n, k, True)["DECODED"]

    def plain(t):
        return dataclasses.replace(t, decoded=None)
    for dtype in (torch.float32, torch.bfloat16):
        learner = gemm.gemm_triton(xq, w, None, dtype)
        assert torch.equal(learner, gemm.gemm_triton(plain(xq), plain(w), None, dtype)), dtype  # decoded by the GEMM
        with monkeypatch.context() as mp:
            mp.setattr(gemm, "DECODE_WIDE", False)  # the wide tile on the packed bytes
            assert torch.equal(learner, gemm.gemm_triton(plain(xq), plain(w), None, dtype)), dtype
        for lo, m in ((0, 1), (7, 16), (100, 64)):
            rows = nvfp4.NVFP4Tensor(xq.data[lo:lo + m], xq.scale[lo:lo + m], xq.global_scale[lo:lo + m], (m, k))
            assert gemm.gemm_config(m, n, k, True)["SWAP_AB"]
            assert torch.equal(gemm.gemm_triton(rows, w, None, dtype), learner[lo:lo + m]), (dtype, lo, m)


@pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="triton missing")
@pytest.mark.parametrize("op", ["quantize", "rms_norm", "silu_mul", "linear"])
def test_an_activation_for_wide_tiles_carries_its_decoded_form(op):
    """The ops that quantize an activation write its decoded form (`NVFP4Tensor.decoded`) where its rows
    meet the decoded wide tiles (M > SWAP_MAX_M): == the GEMM's own decode of the codes, the same codes as without
    it, and the linears on it give the bits of the linears decoding it themselves. K = 208: a part step."""
    from minite_core.kernels import gemm

    m, k = 3 * (gemm.SWAP_MAX_M // 3 + 14), 208  # the wide tiles' rows, in 3 x rows
    assert gemm.decodes_activation(m) and not gemm.decodes_activation(16)
    x, other = _rand(3, m // 3, k, seed=45), _rand(3, m // 3, k, seed=46)  # 3-D: [rows, K] decoded
    w = _rand(k, seed=47).abs() + 0.5
    if op == "quantize":
        q = ops.quantize(x, backend="triton", decoded=True)
        plain = ops.quantize(x, backend="triton")
    elif op == "rms_norm":
        _, q = ops.rms_norm(x, w, 1e-6, backend="triton", quantize=True)
        plain = ops.quantize(ops.rms_norm(x, w, 1e-6, backend="triton"), backend="triton")
    elif op == "silu_mul":
        _, q = ops.silu_mul(x, other, backend="triton", quantize=True)
        plain = ops.quantize(ops.silu_mul(x, other, backend="triton"), backend="triton")
    else:  # linear quantizes its input itself: the decoded form is used inside, and its output must not change
        ws = [_weights(40, k, seed=48)["nvfp4-tensor"], _weights(24, k, seed=49)["nvfp4-tensor"]]
        xq = ops.quantize(x, backend="triton")
        with_xq = ops.linears(x, ws, backend="triton", xq=xq, check_finite=False)
        inside = ops.linears(x, ws, backend="triton", check_finite=False)
        assert all(torch.equal(a, b) for a, b in zip(with_xq, inside))
        return
    assert plain.decoded is None and q.decoded is not None
    assert torch.equal(q.data, plain.data) and torch.equal(q.scale.view(torch.uint8), plain.scale.view(torch.uint8))
    rows = nvfp4.NVFP4Tensor(q.data.reshape(-1, k // 2), q.scale.reshape(-1, k // 16), q.global_scale.reshape(-1, 1), (m, k))
    assert torch.equal(q.decoded, gemm.decode_nvfp4(rows, gemm.fp4_block_k()))
    ws = [_weights(40, k, seed=48)["nvfp4-tensor"], _weights(24, k, seed=49)["nvfp4-tensor"]]
    a = ops.linears(x, ws, backend="triton", xq=q, check_finite=False)
    b = ops.linears(x, ws, backend="triton", xq=dataclasses.replace(q, decoded=None), check_finite=False)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="triton missing")
@pytest.mark.parametrize("n,k,chunks", INVARIANCE_SHAPES, ids=lambda v: str(v))
def test_small_m_tiles_on_a_decoded_activation_equal_the_packed_kernel(monkeypatch, n, k, chunks):
    """DECODE_X_MIN_M: the swapped tiles (M <= SWAP_MAX_M, split K chunks or not) take the activation decoded once by
    `decode_nvfp4` and decode only the weight themselves: the bits of the tile that decodes both."""
    from minite_core.kernels import gemm

    w = _weights(n, k, seed=43)["nvfp4-row"]
    xq = nvfp4.quantize(_rand(100, k, seed=44) * torch.logspace(-4, 2, 100, device=DEVICE).unsqueeze(1))
    for m in (1, 17, 100):
        rows = nvfp4.NVFP4Tensor(xq.data[:m], xq.scale[:m], xq.global_scale[:m], (m, k))
        monkeypatch.setattr(gemm, "DECODE_X_MIN_M", None)
        assert not gemm.gemm_config(m, n, k, True)["A_DECODED"]
        packed = [gemm.gemm_triton(rows, w, None, dt) for dt in (torch.float32, torch.bfloat16)]
        monkeypatch.setattr(gemm, "DECODE_X_MIN_M", 1)
        cfg = gemm.gemm_config(m, n, k, True)
        assert cfg["A_DECODED"] and cfg["SWAP_AB"] and cfg["SPLIT"] == (chunks > 1)
        for dt, ref in zip((torch.float32, torch.bfloat16), packed):
            assert torch.equal(gemm.gemm_triton(rows, w, None, dt), ref), (m, dt)
    # two weights in one launch (q/k/v, gate/up) share the one decoded activation
    w2 = _weights(n, k, seed=45)["nvfp4-tensor"]
    assert len(gemm.launch_groups([gemm.gemm_config(17, n, k, True)] * 2, [w, w2], [None, None])) == 1
    rows = nvfp4.NVFP4Tensor(xq.data[:17], xq.scale[:17], xq.global_scale[:17], (17, k))
    for out, ww in zip(gemm.gemm_many_triton(rows, [w, w2], [None, None], torch.float32), (w, w2)):
        monkeypatch.setattr(gemm, "DECODE_X_MIN_M", None)
        ref = gemm.gemm_triton(rows, ww, None, torch.float32)
        monkeypatch.setattr(gemm, "DECODE_X_MIN_M", 1)
        assert torch.equal(out, ref)


@pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter
@pytest.mark.skipif(not HAS_TRITON, reason="triton missing")
@pytest.mark.parametrize("n,k,chunks", INVARIANCE_SHAPES, ids=lambda v: str(v))
def test_wide_tiles_on_a_packed_weight_equal_the_decoded_operands(monkeypatch, n, k, chunks):
    """WIDE_PACKED_MAX_M: the wide tiles (M > SWAP_MAX_M) on a weight without its decoded form (the rollout's) decode
    the weight in the tile, with the activation decoded by its quantize, and launch no `_decode_kernel`: the
    bits of the tile on both operands decoded, with the weight decoded per call or carried (the learner's)."""
    from minite_core.kernels import gemm
    from minite_core.kernels.quantize import quantize_many_triton, quantize_triton

    master = _rand(n, k, seed=46) * 0.05
    gs = nvfp4.global_scale_from_amax(master.abs().amax().reshape(1))
    packed, = quantize_many_triton([master], gs)
    carried, = quantize_many_triton([master], gs, decoded=True)
    w2 = _weights(n, k, seed=47)["nvfp4-tensor"]  # a second weight of the launch (q/k/v, gate/up)
    m = gemm.SWAP_MAX_M + 44  # the wide tiles' rows
    x = _rand(m, k, seed=48) * torch.logspace(-3, 2, m, device=DEVICE).unsqueeze(1)
    xq = quantize_triton(x, None, decoded=True)
    monkeypatch.setattr(gemm, "WIDE_PACKED_MAX_M", None)
    assert gemm.gemm_config(m, n, k, True)["DECODED"]
    refs = {dt: gemm.gemm_many_triton(xq, [packed, w2], [None, None], dt) for dt in (torch.float32, torch.bfloat16)}
    monkeypatch.setattr(gemm, "WIDE_PACKED_MAX_M", m)
    for dt, ref in refs.items():
        got = gemm.gemm_many_triton(xq, [packed, w2], [None, None], dt)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), dt
        assert torch.equal(gemm.gemm_triton(xq, carried, None, dt), ref[0])  # the learner's weight: decoded operands
    if DEVICE == "cpu":  # the launches, counted under the interpreter: one GEMM, no decode; above the bound, a decode
        # (imported here: bench.launches sets TRITON_INTERPRET=1, which on a GPU would make every kernel module
        # imported after it in this process run in the interpreter)
        from bench.launches import Launches

        with Launches() as launches:
            gemm.gemm_many_triton(xq, [packed, w2], [None, None], torch.float32)
        assert "triton _decode_kernel" not in launches.counts and launches.counts["triton _gemm_kernel"] == 1
        monkeypatch.setattr(gemm, "WIDE_PACKED_MAX_M", m - 1)
        with Launches() as launches:
            gemm.gemm_triton(xq, packed, None, torch.float32)
        assert launches.counts["triton _decode_kernel"] == 1


def _nvfp4_abs(t):
    """The same NVFP4 tensor with every sign bit cleared."""
    return nvfp4.NVFP4Tensor(t.data & 0x77, t.scale, t.global_scale, t.shape)


def test_torch_nvfp4_fast_path_equals_the_fixed_tree_order():
    """Block partial sums of NVFP4 operands are exact, so the batched-matmul path must give exactly the
    bits of the elementwise fixed-order path on the same operands."""
    x = nvfp4.quantize(_rand(23, 128, seed=9))
    w = nvfp4.quantize(_rand(31, 128, seed=10), scale_mode="tensor")
    fast = reference.mm_nvfp4(x, w)
    slow = reference.mm_plain(nvfp4.dequantize_unscaled(x), nvfp4.dequantize_unscaled(w))
    assert torch.equal(fast, (slow * x.global_scale.reshape(-1, 1)) * w.global_scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_bias_out_dtype_and_nd_input(backend):
    w = _weights(24, 64)["nvfp4-tensor"]
    bias = _rand(24, seed=11)
    x = _rand(2, 5, 64, seed=12, dtype=torch.bfloat16)
    y = ops.linear(x, w, bias, out_dtype=torch.float32, backend=backend)
    assert y.shape == (2, 5, 24) and y.dtype == torch.float32
    flat = ops.linear(x.reshape(10, 64), w, out_dtype=torch.float32, backend=backend) + bias
    assert torch.allclose(y.reshape(10, 24), flat, rtol=1e-6, atol=1e-6)
    assert ops.linear(x, w, backend=backend).dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_decodes_every_code_and_scale_byte(backend):
    """A weight as a foreign checkpoint may hold it: all 16 codes, and E4M3 block scales over the whole
    range, subnormal ones (0x01..0x07 = k * 2^-9) included. Quantize itself never writes subnormals."""
    n, k = 40, 128
    g = torch.Generator().manual_seed(21)
    data = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(1, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8)  # 0x7F would be NaN
    scale[: n // 2, ::2] = torch.randint(1, 8, (n // 2, k // 32), generator=g, dtype=torch.uint8)
    w = nvfp4.NVFP4Tensor(data.to(DEVICE), scale.view(torch.float8_e4m3fn).to(DEVICE),
                          torch.tensor(0.01, device=DEVICE), (n, k))
    # the expected values, decoded by hand in fp64: sign, e2m1 magnitude, e4m3 scale bits
    codes = nvfp4.unpack_codes(data).long()
    mag = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)[codes & 7] * (1 - 2 * (codes >> 3))
    e, m = (scale >> 3).double(), (scale & 7).double()
    sval = torch.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))
    w64 = (mag.view(n, k // 16, 16) * sval.unsqueeze(-1)).view(n, k) * torch.tensor(0.01).double()
    assert torch.equal(w.dequantize().cpu(), w64.float())  # one rounding of the exact value
    x = _rand(9, k, seed=22)
    y = ops.linear(x, w, backend=backend)
    a = nvfp4.quantize(x).dequantize(torch.float64)
    ref, mag_ref = a @ w64.to(DEVICE).T, a.abs() @ w64.abs().to(DEVICE).T
    assert ((y.double() - ref).abs() / (mag_ref + 1e-30)).max().item() < k * 2**-24


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_takes_non_contiguous_input(backend):
    w = _weights(24, 64)["nvfp4-row"]
    big = _rand(64, 10, seed=23)
    x = big.T  # [10, 64], not contiguous
    assert not x.is_contiguous()
    assert torch.equal(ops.linear(x, w, backend=backend), ops.linear(x.contiguous(), w, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_empty_batch(backend):
    w = _weights(24, 64)["nvfp4-row"]
    assert ops.linear(_rand(0, 64), w, backend=backend).shape == (0, 24)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wkind", ["nvfp4-tensor", "nvfp4-row", "bf16"])
@pytest.mark.parametrize("recipe", ["ste", "fp8"])
def test_linears_equal_separate_linears(backend, wkind, recipe):
    """q/k/v in one call (one activation quantize, one GEMM launch on the triton backend): the bits of three
    `linear` calls, for an M on each tile path; the gradients those calls give (autograd sums the three
    dgrads in some order: to fp32 rounding), by each backward recipe (fp8: x's e4m3 operand encoded once)."""
    k = 96 if DEVICE == "cpu" else 1024
    widths = (40, 24, 24) if DEVICE == "cpu" else (2048, 1024, 1024)
    masters = [_rand(n, k, seed=70 + i) * 0.1 for i, n in enumerate(widths)]
    ws = [_weights(n, k, seed=70 + i)[wkind] for i, n in enumerate(widths)]
    for m in (5, 140):
        x = _rand(m, k, seed=9).to(torch.bfloat16)
        got = ops.linears(x, ws, backend=backend)
        assert [tuple(y.shape) for y in got] == [(m, n) for n in widths]
        for w, y in zip(ws, got):
            assert torch.equal(y, ops.linear(x, w, backend=backend))
    # training: the masters and x receive the gradients of separate linears
    x = _rand(7, k, seed=10).to(torch.bfloat16)
    gs = [_rand(7, n, seed=80 + i).to(torch.bfloat16) for i, n in enumerate(widths)]
    leaves = [[m.clone().requires_grad_(True) for m in masters] for _ in range(2)]
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    plain = not wkind.startswith("nvfp4")
    def args(i, j):  # a plain weight is the master's cast (autograd's path); an NVFP4 one takes it as master
        return (leaves[i][j].to(torch.bfloat16), None) if plain else (ws[j], leaves[i][j])
    outs = ops.linears(xs[0], [args(0, j)[0] for j in range(3)], masters=[args(0, j)[1] for j in range(3)],
                       backend=backend, backward=recipe)
    torch.autograd.backward(outs, gs)
    for j in range(3):
        w, master = args(1, j)
        ops.linear(xs[1], w, master=master, backend=backend, backward=recipe).backward(gs[j])
    for a, b in zip(leaves[0], leaves[1]):
        assert torch.equal(a.grad, b.grad)
    assert torch.allclose(xs[0].grad.float(), xs[1].grad.float(), rtol=2**-7, atol=1e-6)


def test_linears_bad_input_is_named():
    w = _weights(24, 64)
    x = _rand(3, 64)
    with pytest.raises(ValueError, match="all NVFP4 or all of one float dtype"):
        ops.linears(x, [w["nvfp4-tensor"], w["bf16"]])
    with pytest.raises(ValueError, match="one bias and one master"):
        ops.linears(x, [w["bf16"], w["bf16"]], [None])
    with pytest.raises(ValueError, match=r"ws\[1\]"):
        ops.linears(x, [w["bf16"], _weights(24, 32)["bf16"]])
    xq = ops.quantize(x)
    with pytest.raises(ValueError, match="xq must be the per-row NVFP4Tensor of x"):
        ops.linears(x[:2], [w["nvfp4-tensor"]], xq=xq)
    with pytest.raises(ValueError, match="xq is the per-row NVFP4 activation of NVFP4 weights"):
        ops.linears(x, [w["bf16"]], xq=xq)
    with pytest.raises(ValueError, match="xq must be the per-row"):
        ops.linears(x, [w["nvfp4-tensor"]], xq=ops.quantize(x, scale_mode="tensor"))


# ------------------------------------------------------------------------------------------------ autograd


def test_linear_backward_is_straight_through():
    """Default backward: dgrad = g @ deq(W), wgrad = g.T @ deq(Q(x)), operands rounded to bf16."""
    w_hp = _rand(24, 64, seed=13) * 0.1
    wq = nvfp4.quantize(w_hp, scale_mode="tensor")
    x = _rand(6, 64, seed=14).requires_grad_(True)
    bias = _rand(24, seed=15).requires_grad_(True)
    master = w_hp.clone().requires_grad_(True)
    g = _rand(6, 24, seed=16)
    ops.linear(x, wq, bias, master=master).backward(g)
    gb = g.to(torch.bfloat16).double()
    assert torch.allclose(x.grad.double(), gb @ wq.dequantize(torch.bfloat16).double(), rtol=1e-5, atol=1e-5)
    xq = nvfp4.quantize(x.detach()).dequantize(torch.bfloat16).double()
    assert torch.allclose(master.grad.double(), gb.T @ xq, rtol=1e-5, atol=1e-5)
    assert torch.allclose(bias.grad, g.sum(0), rtol=1e-5, atol=1e-6)
    wq_no_master = ops.linear(x.detach().requires_grad_(True), wq)  # no master: no weight gradient, no error
    wq_no_master.sum().backward()


@pytest.mark.parametrize("backward,tol", [("ste", 0.12), ("nvfp4", 0.6), ("fp8", 0.12)])
def test_training_gradients_against_fp32_autograd(backward, tol):
    """Gradients of a W4A4 linear vs fp32 autograd of F.linear on the master weight, relative L2 error.
    STE: 0.12 (measured 0.093: only the forward's quantization of W and x differs). FP8 (the STE products
    on e4m3 operands): 0.12 (measured 0.096 / 0.096). NVIDIA recipe, one
    draw: 0.6 (gradients themselves go to NVFP4 with stochastic rounding; up to 0.45 seen over 64 seeds
    on CPU, 0.38 in one GPU draw); the mean over 64 draws must come much closer, as stochastic rounding
    is unbiased: wgrad 0.1 (measured 0.05), dgrad 0.25 (measured 0.19, the bias of the 2-D weight scales)."""
    m, n, k = 48, 32, 64
    w = (_rand(n, k, seed=17) * 0.1).requires_grad_(True)
    x = _rand(m, k, seed=18).requires_grad_(True)
    g = _rand(m, n, seed=19)
    torch.nn.functional.linear(x, w).backward(g)
    ref_x, ref_w = x.grad.clone(), w.grad.clone()
    wq = nvfp4.quantize(w.detach(), scale_mode="tensor", block_2d=backward == "nvfp4")
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    draws = 64 if backward == "nvfp4" else 1
    mean_x, mean_w = torch.zeros_like(x), torch.zeros_like(w)
    for seed in range(draws):
        torch.manual_seed(seed)
        x.grad = w.grad = None
        ops.linear(x, wq, master=w, backward=backward).backward(g)
        assert rel(x.grad, ref_x) < tol and rel(w.grad, ref_w) < tol, (seed, rel(x.grad, ref_x), rel(w.grad, ref_w))
        mean_x += x.grad / draws
        mean_w += w.grad / draws
    if backward == "nvfp4":
        assert rel(mean_w, ref_w) < 0.1 and rel(mean_x, ref_x) < 0.25, (rel(mean_w, ref_w), rel(mean_x, ref_x))


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_named(backend):
    w = _weights(24, 64)["nvfp4-tensor"]
    x = _rand(3, 64)
    with pytest.raises(ValueError, match="shape mismatch"):
        ops.linear(_rand(3, 48), w, backend=backend)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.linear(_rand(3, 60), torch.randn(5, 60, device=DEVICE), backend=backend)
    with pytest.raises(TypeError, match="w must be"):
        ops.linear(x, torch.ones(24, 64, dtype=torch.int32, device=DEVICE), backend=backend)
    with pytest.raises(TypeError, match="w must be"):
        ops.linear(x, [[1.0]], backend=backend)
    with pytest.raises(ValueError, match="2-D"):
        ops.linear(x, torch.randn(2, 24, 64, device=DEVICE), backend=backend)
    with pytest.raises(ValueError, match="bias"):
        ops.linear(x, w, torch.zeros(5, device=DEVICE), backend=backend)
    with pytest.raises(TypeError, match="x must be"):
        ops.linear(x.to(torch.int64), w, backend=backend)
    bad = x.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ops.linear(bad, w, backend=backend)
    with pytest.raises(ValueError, match="NaN"):
        ops.quantize(bad, backend=backend)
    inf = x.clone()
    inf[0, 0] = float("inf")
    with pytest.raises(ValueError, match="Inf"):
        ops.linear(inf, w, backend=backend)
    with pytest.raises(ValueError, match="scale_mode"):
        ops.linear(x, w, scale_mode="block", backend=backend)
    ops.linear(bad, _weights(24, 64)["bf16"], backend=backend, check_finite=False)  # the scan can be skipped


def test_unknown_backend(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend"):
        ops.linear(_rand(2, 16), torch.randn(3, 16, device=DEVICE), backend="cuda")
    monkeypatch.setenv("MINITE_BACKEND", "tpu")
    with pytest.raises(ValueError, match="MINITE_BACKEND"):
        ops.resolve_backend()
    monkeypatch.setenv("MINITE_BACKEND", "torch")
    assert ops.resolve_backend() == "torch"


def _dequantize_by_definition(t, dtype):
    """code -> E2M1 value by table, times the E4M3 block scale, both exact in fp32; times the global scale
    in fp32 (one rounding); then rounded to dtype."""
    codes = nvfp4.unpack_codes(t.data).long()
    vals = nvfp4.E2M1_VALUES[codes.cpu()].to(t.data.device).view(*t.shape[:-1], t.shape[-1] // 16, 16)
    vals = vals * t.scale.float().unsqueeze(-1)
    gs = t.global_scale.unsqueeze(-1) if t.global_scale.dim() else t.global_scale
    return (vals * gs).reshape(t.shape).to(dtype)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("scale_mode", ["row", "tensor"])
def test_dequantize_is_the_definition_on_both_backends(backend, dtype, scale_mode):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 272, generator=g) * torch.logspace(-6, 3, 24).unsqueeze(1)  # tiny rows: subnormal scales
    x[3, :16] = 0.0  # a zero block
    x[5, 7] = -x[5].abs().max() * 4  # a saturated code in a row
    x3 = torch.randn(2, 5, 48, generator=g)  # leading dimensions, K not a multiple of the kernel's K tile
    for src in (x, x3):
        t = ops.quantize(src.to(DEVICE), scale_mode=scale_mode, backend="torch")
        out = ops.dequantize(t, dtype, backend=backend)
        want = _dequantize_by_definition(t, dtype)
        assert out.dtype == dtype and out.shape == src.shape
        bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
        assert torch.equal(out.view(bits), want.view(bits))


def test_dequantize_refuses_what_is_not_nvfp4():
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        ops.dequantize(torch.ones(2, 16))


def test_torch_backend_bits_do_not_depend_on_how_the_device_divides_by_a_number():
    """The torch backend is the definition the Triton kernels equal bit for bit, on the GPU too: on the CPU
    (where this runs), division by a Python number done as PyTorch's CUDA kernels do it (a multiply by the
    reciprocal, `tests.backends.CudaScalarDivision`) must not change any op's bits. (An `amax / 448` in the
    fp8 operands' definition made the GPU kernel disagree with it.)"""
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = r(9, 96) * torch.logspace(-3, 2, 9).view(9, 1)
    wq, wn, up = nvfp4.quantize(r(40, 96), scale_mode="tensor"), r(96) + 1, r(9, 96)
    q, k, v = r(2, 4, 5, 32), r(2, 2, 5, 32), r(2, 2, 5, 32)
    pos, kv_len = torch.arange(5).expand(2, 5).contiguous(), torch.tensor([5, 5])
    logits, tokens = r(6, 300) * 4, torch.randint(0, 300, (6,), generator=g)

    def run():
        y, yq = ops.rms_norm(x, wn, 1e-6, backend="torch", quantize=True)
        h, hq = ops.silu_mul(x, up, backend="torch", quantize=True)
        xq = ops.quantize(x, backend="torch")
        return {"quantize": xq.data, "scales": xq.scale.view(torch.uint8), "global scales": xq.global_scale,
                "dequantize": ops.dequantize(xq, torch.float32, backend="torch"),
                "tensor-scale quantize": ops.quantize(x, scale_mode="tensor", backend="torch").data,
                "linear": ops.linear(x, wq, backend="torch"), "rms_norm": y, "rms_norm nvfp4": yq.data,
                "silu_mul": h, "silu_mul nvfp4": hq.data,
                "attention": ops.attention(q, k, v, pos, kv_len, backend="torch"),
                "log_softmax": ops.log_softmax(logits, 0.7, backend="torch"),
                "token_logprobs": ops.token_logprobs(logits, tokens, 0.7, backend="torch")}

    want = run()
    with CudaScalarDivision():
        got = run()
    assert [name for name in want if not torch.equal(want[name], got[name])] == []


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_under_no_grad_give_the_grad_mode_bits(backend):
    """With grad mode off (the rollout) the ops run their Functions' forwards without autograd (`ops._call`): the
    bits of the same calls with grad mode on, and nothing recorded."""
    b, t, hq, hkv, d, h = 2, 5, 4, 2, 16, 64
    x = _rand(b, t, h, seed=90).requires_grad_(True)
    delta = _rand(b, t, h, seed=91).requires_grad_(True)
    nw = (1 + _rand(h, seed=92) * 0.1).requires_grad_(True)
    w = _weights(3 * h, h, seed=93)["nvfp4-tensor"]
    q, k = _rand(b, t, hq, d, seed=94), _rand(b, t, hkv, d, seed=95)
    pos = torch.arange(t, device=DEVICE).expand(b, t)
    ang = pos.float().unsqueeze(-1) * torch.rand(d // 2, generator=torch.Generator().manual_seed(96)).to(DEVICE)
    cos, sin = torch.cat((ang, ang), -1).cos().unsqueeze(1), torch.cat((ang, ang), -1).sin().unsqueeze(1)

    def run():
        s, y, yq = ops.add_rms_norm(x, delta, nw, 1e-6, backend=backend, quantize=True)
        g, u = ops.linears(y, [w, w], out_dtype=torch.float32, backend=backend, xq=yq, check_finite=False)
        hm, hq_ = ops.silu_mul(g, u, backend=backend, quantize=True)
        heads = ops.qk_norm_rope(q, k, k, nw[:d], nw[d:2 * d], 1e-6, cos, sin, backend=backend)
        att = ops.attention(heads.q, heads.k, heads.v, pos, torch.full((b,), t, device=DEVICE), backend=backend)
        lp = ops.token_logprobs(g.reshape(b * t, -1), torch.arange(b * t, device=DEVICE) % (3 * h), backend=backend)
        return [s, y, yq.data, yq.scale.view(torch.uint8), g, u, hm, hq_.data, heads.q, heads.k, att, lp]

    with_grad = run()
    assert with_grad[4].grad_fn is not None
    with torch.no_grad():
        without = run()
    assert all(o.grad_fn is None for o in without)
    for i, (a, c) in enumerate(zip(with_grad, without)):
        assert torch.equal(a.detach(), c), i
