"""The quantize kernels' E2M1 rounding helper (`kernels.quantize.e2m1_round`, on the fp32 bits) against
the definition (`nvfp4.round_e2m1`, which counts thresholds, of v clamped to [-6, 6]): every threshold, its
fp32 neighbours, the representable values, signed zeros, a dense random sample of [-6, 6] and values
beyond 6 (the kernel saturates them itself), byte for byte. (The whole
quantize kernels are compared with the torch backend in tests/core/test_ops.py.)

On a CPU machine the kernel runs under the Triton interpreter; on a GPU, on the GPU.
"""
import pytest
import torch
from tests.backends import DEVICE, HAS_CUDA, HAS_TRITON

from minite_core import nvfp4

pytestmark = [pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter,
              pytest.mark.skipif(not HAS_TRITON, reason="triton missing")]

if HAS_TRITON:
    import triton
    import triton.language as tl

    from minite_core.kernels.quantize import e2m1_round

    @triton.jit
    def _round_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(v_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + offs, e2m1_round(v), mask=offs < n)


def _round(v: torch.Tensor) -> torch.Tensor:
    out = torch.empty(v.shape, dtype=torch.uint8, device=v.device)
    _round_kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
    return out


def test_every_threshold_and_its_neighbours():
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 1e-30, 2**-126])
    up = torch.nextafter(points, torch.full_like(points, 7.0))
    down = torch.nextafter(points, torch.full_like(points, -1.0)).clamp_min(0.0)
    v = torch.cat([points, up.clamp_max(6.0), down])
    v = torch.cat([v, -v]).to(DEVICE)
    assert torch.equal(_round(v), nvfp4.round_e2m1(v))


def test_dense_random_values():
    g = torch.Generator().manual_seed(0)
    v = (torch.rand(200_000, generator=g) * 12 - 6)
    v = torch.cat([v, v * 1e-3, torch.tensor([-0.0, 6.0, -6.0])]).to(DEVICE)
    assert torch.equal(_round(v), nvfp4.round_e2m1(v))


def test_values_beyond_six_saturate_like_the_clamped_definition():
    v = torch.tensor([6.0, 6.000001, 6.5, 7.0, 12.0, 448.0, 1e30, 3.4e38])
    v = torch.cat([v, -v]).to(DEVICE)
    assert torch.equal(_round(v), nvfp4.round_e2m1(v.clamp(-6.0, 6.0)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_tensors_in_one_launch_have_the_bits_of_one_launch_each(dtype):
    """`quantize_many_triton` (the learner's re-quantize: every weight in one launch) == `quantize_triton` of
    each tensor with the same global scale, and == the torch definition: shapes whose K is one block, not a
    whole chunk (48, 208), more than one chunk (1040 > 64 blocks), 1 .. 17 rows, a 3-D tensor, a zero tensor."""
    from minite_core.kernels.quantize import quantize_many_triton, quantize_triton

    g = torch.Generator().manual_seed(7)
    shapes = [(3, 16), (17, 48), (1, 208), (5, 1040), (2, 3, 64), (4, 32)]
    ts = [(torch.randn(*s, generator=g) * 10.0 ** (i - 3)).to(device=DEVICE, dtype=dtype) for i, s in enumerate(shapes)]
    ts[-1].zero_()
    gs = nvfp4.global_scale_from_amax(torch.stack([t.abs().amax().float() for t in ts]))
    got = quantize_many_triton(ts, gs)
    for i, (t, q) in enumerate(zip(ts, got)):
        for ref in (quantize_triton(t, gs[i]), nvfp4.quantize(t, global_scale=gs[i])):
            assert q.shape == ref.shape and torch.equal(q.data, ref.data), i
            assert torch.equal(q.scale.view(torch.uint8), ref.scale.view(torch.uint8)), i
            assert torch.equal(q.global_scale.reshape(()), ref.global_scale.reshape(())), i
    # decoded=True: the same codes, and each tensor's decoded form == the GEMM's own decode of its codes (rows)
    from minite_core.kernels.gemm import decode_nvfp4, fp4_block_k

    for t, q, d in zip(ts, got, quantize_many_triton(ts, gs, decoded=True)):
        assert torch.equal(q.data, d.data) and torch.equal(q.scale.view(torch.uint8), d.scale.view(torch.uint8))
        k = t.shape[-1]
        rows = nvfp4.NVFP4Tensor(q.data.reshape(-1, k // 2), q.scale.reshape(-1, k // 16), q.global_scale, (t.numel() // k, k))
        ref = decode_nvfp4(rows, fp4_block_k())
        assert d.decoded.shape == ref.shape and torch.equal(d.decoded, ref), tuple(t.shape)
    # dequantized=True: the same codes, and each tensor's bf16 form == the torch dequantize of its codes, bit
    # for bit (the rounding of the global-scale product: values from 10^-3 to 10^2 and a zero tensor)
    for t, q, d in zip(ts, got, quantize_many_triton(ts, gs, decoded=True, dequantized=True)):
        assert torch.equal(q.data, d.data) and torch.equal(q.scale.view(torch.uint8), d.scale.view(torch.uint8))
        ref = nvfp4.dequantize(q, torch.bfloat16)
        assert d.dequantized.dtype == torch.bfloat16 and d.dequantized.shape == t.shape
        assert torch.equal(d.dequantized.view(torch.int16), ref.view(torch.int16)), tuple(t.shape)
        assert d.decoded is not None
    with pytest.raises(ValueError, match="one dtype"):
        quantize_many_triton([ts[0], ts[1].double()], gs[:2])
    with pytest.raises(ValueError, match="contiguous"):
        quantize_many_triton([ts[1].T], gs[:1])


def _checked(t: nvfp4.NVFP4Tensor) -> None:
    """t passes the checks it was built without (`NVFP4Tensor.trusted`): a constructor that validates raises else."""
    nvfp4.NVFP4Tensor(t.data, t.scale, t.global_scale, t.shape, t.decoded, t.dequantized)
    assert isinstance(t.shape, torch.Size)


def test_kernel_outputs_built_unchecked_pass_the_checks():
    """The quantize kernels' NVFP4Tensors (built by `NVFP4Tensor.trusted`, skipping the checks) are what the
    checks accept: each quantizing launcher, with and without its decoded and dequantized forms, on a 3-D input
    whose rows are not a whole tile; and the saved activation (`without_caches`) drops just the two forms."""
    from minite_core import ops
    from minite_core.kernels.quantize import quantize_many_triton, quantize_triton

    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 5, 96, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(40, 96, generator=g).to(DEVICE)
    outs = [quantize_triton(x, None), quantize_triton(x, None, decoded=True),
            *quantize_many_triton([w, w[:8]], nvfp4.global_scale_from_amax(w.abs().amax().repeat(2)),
                                  decoded=True, dequantized=True),
            ops.rms_norm(x, torch.ones(96, device=DEVICE), backend="triton", quantize=True)[1]]
    for t in outs:
        _checked(t)
    assert outs[1].decoded is not None and outs[2].dequantized is not None
    bare = outs[2].without_caches()
    _checked(bare)
    assert bare.decoded is None and bare.dequantized is None and bare.data is outs[2].data
    with pytest.raises(ValueError, match="scale must be"):  # the checks themselves still run on a plain build
        nvfp4.NVFP4Tensor(bare.data, bare.scale.view(torch.uint8), bare.global_scale, bare.shape)


COMPILE_SCRIPT = r"""
import json
import bench.gemm_probe as gp
out = {}
for name, kern, const, cfg, ones, m, *ptrs in gp.sm90_cases():
    if name.startswith(("quantize", "add_rms_norm_quantize", "silu_mul_quantize", "dequantize")):
        ck = gp.compile_sm90(kern, const, cfg["num_warps"], cfg["num_stages"], ones, *ptrs)
        out[name] = gp.ptxas_report(ck.asm["ptx"])["spill_stores"]
print(json.dumps(out))
"""


def test_the_quantize_kernels_compile_for_sm90():
    """Every quantize kernel (activations, the learner's re-quantize with its decoded and bf16 outputs, the
    norms and SiLU*up that quantize) and the dequantize compile for sm_90 without spills: the interpreter
    accepts code that the compiler rejects (a constexpr branch returning another type than the code after
    it did, once, in `scaled_values`)."""
    from tests.sm90 import run_compile_script

    out = run_compile_script(COMPILE_SCRIPT)
    assert {"quantize_row_gs", "quantize_row_gs_one_tile_K2048", "quantize_row_gs_one_tile_K8192", "quantize_many",
            "silu_mul_quantize_one_tile_N3072", "silu_mul_quantize_one_tile_N6144", "dequantize_bf16", "dequantize_fp32"} <= set(out), out
    assert all(v == 0 for v in out.values()), out
