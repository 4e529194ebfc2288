"""The FP8 backward's operand kernel (`kernels.fp8.e4m3_rows_triton`) against its definition
(`backward.e4m3_rows`, torch): the same e4m3 bytes and scales, bit for bit, on odd shapes, transposed views,
wide dynamic ranges (subnormal codes), zero rows, exact ties, and the sign of values that round to zero;
and the fp8 recipe's gradients equal with either.

On a CPU machine the kernel runs under the Triton interpreter; on a GPU, on the GPU.
"""
import pytest
import torch
from tests.backends import DEVICE, HAS_CUDA, HAS_TRITON

from minite_core import backward

pytestmark = [pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter,
              pytest.mark.skipif(not HAS_TRITON, reason="triton missing")]

if HAS_TRITON:
    from minite_core.kernels.fp8 import e4m3_rows_triton


def _rand(*shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g) * 3)
    return x.to(dtype).to(DEVICE)


def _same(a, b):
    (qa, sa), (qb, sb) = a, b
    assert qa.shape == qb.shape and qa.dtype == qb.dtype == torch.float8_e4m3fn
    assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))
    assert torch.equal(sa, sb)


@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (16, 16), (37, 100), (130, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_the_definition(shape, dtype):
    a = _rand(*shape, seed=sum(shape), dtype=dtype)
    _same(e4m3_rows_triton(a), backward.e4m3_rows(a))


@pytest.mark.parametrize("shape", [(9, 40), (64, 17)])
def test_transposed_views_without_a_copy(shape):
    a = _rand(*shape, seed=3)
    _same(e4m3_rows_triton(a.T), backward.e4m3_rows(a.T.contiguous()))


def test_zero_rows_wide_range_and_sign_of_zero():
    a = _rand(6, 40, seed=5, dtype=torch.float32)
    a[1] = 0.0  # scale 1, all bytes 0
    a[2, 1::2], a[2, 2::2] = 1e-5, 1e-7  # ~2^-17 and ~2^-23 of the row's amax: subnormal codes and zeros
    a[2, 0] = 1.0
    a[3, :] = -1e-12  # rounds to -0 (0x80) next to a large value
    a[3, 5] = 3.0
    a[4] = -a[4].abs()
    q, s = e4m3_rows_triton(a)
    _same((q, s), backward.e4m3_rows(a))
    assert s[1].item() == 1.0 and not q[1].view(torch.uint8).any()
    assert set(q[2].view(torch.uint8)[1:40].tolist()) == {0, 2}  # 1e-5 * 448: 2 * 2^-9; 1e-7: 0
    assert (q[3].view(torch.uint8)[:40] == 0x80).sum() == 39  # the sign survives rounding to zero
    assert q.shape == (16, 48) and not q[6:].view(torch.uint8).any()  # padding rows and columns: zeros


def test_ties_round_to_even():
    # amax 448: the scale is exactly 1, so each value is encoded as it is; each is halfway between two codes
    ties = [1.0625, 1.1875, 3.0 * 2**-10, 2**-10, 5 * 2**-10, 0.5 + 2**-5, 240.0 - 8.0, 416.0 + 16.0]
    want = [1.0, 1.25, 2**-8, 0.0, 2**-8, 0.5, 224.0, 448.0]
    a = torch.tensor([[448.0] + ties], dtype=torch.float32, device=DEVICE)
    q, s = e4m3_rows_triton(a)
    _same((q, s), backward.e4m3_rows(a))
    assert s[0].item() == 1.0
    assert q[0, 1:1 + len(ties)].float().tolist() == want


@pytest.mark.parametrize("plain", [False, True])
def test_fp8_recipe_gradients_equal_with_the_kernel(plain):
    from minite_core import nvfp4

    m, n, k = 21, 40, 64
    g = _rand(m, n, seed=11)
    x = _rand(m, k, seed=12)
    w = _rand(n, k, seed=13) * 0.1
    if plain:
        wq, xq = w, None
    else:
        wq, xq = nvfp4.quantize(w.float(), scale_mode="tensor"), nvfp4.quantize(x.float())
    ref = backward.fp8_recipe(g, x, wq, xq, True, True)
    got = backward.fp8_recipe(g, x, wq, xq, True, True, rows=e4m3_rows_triton)
    for r, o in zip(ref, got):
        assert torch.equal(r, o)


def test_the_definition_writes_row_major_operands_from_views():
    a = _rand(32, 48, seed=7)
    q, _ = backward.e4m3_rows(a.T)  # no padding needed: the cast would keep the view's column-major strides
    assert q.is_contiguous()


def test_the_gpu_encodes_with_the_hardware_conversion():
    """On sm_90 the kernel's loop is one multiply and the hardware's fp32 -> e4m3 conversion a value (the
    interpreter's bit-level encoding, `e4m3_code`, took the loop from 362 to 779 SASS instructions, and the
    per-element division it replaced to 1,176). Compiled on the CPU for sm_90, in a subprocess (the compiler
    cannot run under TRITON_INTERPRET)."""
    from tests.sm90 import run_compile_script

    out = run_compile_script(r'''
import json
import bench.gemm_probe as gp
for name, kern, const, cfg, ones, m, *ptrs in gp.sm90_cases():
    if name == "e4m3_rows":
        ck = gp.compile_sm90(kern, const, cfg["num_warps"], cfg["num_stages"], ones, *ptrs)
        loop = gp.main_loop(gp.sass_of(ck.asm["cubin"]))
        print(json.dumps(dict(cvt="cvt.rn.satfinite.e4m3x2.f32" in ck.asm["ptx"], loop=len(loop),
                              f2fp=sum(op.startswith("F2FP") for _, op in loop))))
''')
    assert out["cvt"] and out["f2fp"] > 0 and out["loop"] <= 450, out
