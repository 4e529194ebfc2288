"""Tests of minite_core.nvfp4, the NVFP4 format in plain PyTorch.

Checks, against independent references (torchao's nvfp4_quantize / to_blocked, hand-written code
tables and bit patterns, float64 math):
- quantize is bit-exact with torchao (global scale, block scales, packed codes) for per-tensor,
  per-row and explicit global scales, fp32 / bf16 / fp16 inputs, 2-D and [B, T, K] shapes;
- E2M1 round-to-nearest-even ties, signed zeros, saturation, zero blocks / rows / tensors;
- E4M3 block scales: the 2^-6 lower clamp on quantize, decoding of subnormal scale bytes;
- round trips, nibble packing order, stochastic rounding (unbiased, seeded, grid-stable);
- 16x16 2-D block scaling, four-over-six block scaling, the random Hadamard transform;
- the 128x4 swizzled scale layout, and input validation.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("torchao", reason="torchao (a test dependency, installed by .ci/run) is the reference")
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    from torchao.prototype.mx_formats.utils import to_blocked as ao_to_blocked

from minite_core.nvfp4 import (
    NVFP4Tensor,
    check_float_input,
    dequantize,
    dequantize_unscaled,
    from_blocked,
    global_scale_from_amax,
    hadamard_matrix,
    pack_codes,
    quantize,
    rht,
    round_e2m1,
    round_e2m1_stochastic,
    to_blocked,
    unpack_codes,
)

# E2M1 code -> value, written out by hand (bit 3 = sign).
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
GRID = torch.tensor(E2M1[:8], dtype=torch.float64)
E4M3_448 = 0x7E  # 0 1111 110
E4M3_2M6 = 0x08  # 0 0001 000 = 2^-6, smallest normal


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    a, b = u8(a), u8(b)
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        raise AssertionError(f"{bad.shape[0]} of {a.numel()} differ, first at {bad[:5].tolist()}: "
                             f"{a[tuple(bad[0])].item()} vs {b[tuple(bad[0])].item()}")


def varied(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """randn with per-row magnitudes 10^U(-3, 3) and a few 50x outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 10 ** (torch.rand(rows, 1, generator=g) * 6 - 3)
    idx = torch.randint(0, rows * k, (max(2, rows * k // 150),), generator=g)
    x.view(-1)[idx] *= 50
    return x.to(dtype)


def ref_codes(v: torch.Tensor) -> torch.Tensor:
    """Independent E2M1 RNE: nearest grid point by distance, ties to the even code."""
    a = v.double().abs().clamp(max=6.0)
    d = (a.unsqueeze(-1) - GRID).abs()
    tie = d == d.amin(-1, keepdim=True)
    even = (torch.arange(8) % 2 == 0).to(torch.float64)
    idx = (tie.to(torch.float64) * (1 + even)).argmax(-1)
    return idx.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def decode64(t: NVFP4Tensor) -> torch.Tensor:
    """Independent float64 decode: E2M1 table * e4m3 scale * global scale."""
    codes = unpack_codes(t.data).long()
    vals = torch.tensor(E2M1, dtype=torch.float64)[codes]
    k = t.shape[-1]
    vals = vals.view(*t.shape[:-1], k // 16, 16) * t.scale.double().unsqueeze(-1)
    gs = t.global_scale.double()
    gs = gs.unsqueeze(-1) if gs.dim() else gs
    return (vals * gs).reshape(t.shape)


# ------------------------------------------------------------------------------------ 1. torchao bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k", [(37, 16), (129, 48), (37, 304), (1, 48)])
@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_matches_torchao(dtype, rows, k, mode):
    x = varied(rows, k, dtype, seed=rows * 1000 + k)
    q = quantize(x, scale_mode=mode)
    amax = x.float().abs()
    if mode == "tensor":
        ref_gs = per_tensor_amax_to_scale(amax.amax())
        assert q.global_scale.shape == ()
    else:
        ref_gs = amax.amax(-1, keepdim=True) / 2688.0
        assert q.global_scale.shape == (rows, 1)
    assert q.global_scale.dtype == torch.float32
    assert torch.equal(q.global_scale, ref_gs)
    ref_scale, ref_data = nvfp4_quantize(x, 16, ref_gs)
    assert_bits_equal(q.scale, ref_scale)
    assert_bits_equal(q.data, ref_data)
    assert q.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torchao_explicit_global_scale(dtype):
    x = varied(37, 48, dtype, seed=7)
    amax = x.float().abs().amax()
    # a scalar smaller than amax/2688 (forces some saturation) and a per-row one
    gs = torch.tensor(0.37 * amax.item() / 2688.0, dtype=torch.float32)
    q = quantize(x, global_scale=gs)
    assert torch.equal(q.global_scale, gs)
    s, d = nvfp4_quantize(x, 16, gs)
    assert_bits_equal(q.scale, s)
    assert_bits_equal(q.data, d)
    assert (unpack_codes(q.data) & 7 == 7).any()  # saturated somewhere

    g = torch.Generator().manual_seed(3)
    gs_rows = (torch.rand(37, 1, generator=g) + 0.1) * x.float().abs().amax(-1, keepdim=True) / 2688.0
    for mode in ("row", "tensor"):  # explicit scale overrides scale_mode
        q = quantize(x, global_scale=gs_rows, scale_mode=mode)
        assert torch.equal(q.global_scale, gs_rows)
        s, d = nvfp4_quantize(x, 16, gs_rows)
        assert_bits_equal(q.scale, s)
        assert_bits_equal(q.data, d)


def test_python_float_global_scale():
    x = varied(8, 32, torch.float32, seed=11)
    gs = 0.0123
    q = quantize(x, global_scale=gs)
    ref = torch.tensor(gs, dtype=torch.float32)
    assert torch.equal(q.global_scale, ref)
    s, d = nvfp4_quantize(x, 16, ref)
    assert_bits_equal(q.scale, s)
    assert_bits_equal(q.data, d)


def test_float16_input_matches_torchao_on_fp32():
    x = varied(33, 64, torch.float32, seed=5).clamp(-6e4, 6e4).half()
    q = quantize(x, scale_mode="row")
    gs = x.float().abs().amax(-1, keepdim=True) / 2688.0
    s, d = nvfp4_quantize(x.float(), 16, gs)  # fp16 -> fp32 is exact
    assert_bits_equal(q.scale, s)
    assert_bits_equal(q.data, d)


@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_three_dim_row_and_tensor(mode):
    x = varied(2 * 5, 48, torch.float32, seed=9).view(2, 5, 48)
    q = quantize(x, scale_mode=mode)
    x2 = x.reshape(10, 48)
    if mode == "row":
        assert q.global_scale.shape == (2, 5, 1)
        ref_gs = x2.abs().amax(-1, keepdim=True) / 2688.0
        assert torch.equal(q.global_scale.reshape(10, 1), ref_gs)
    else:
        ref_gs = per_tensor_amax_to_scale(x.abs().amax())
        assert torch.equal(q.global_scale, ref_gs)
    assert q.data.shape == (2, 5, 24) and q.scale.shape == (2, 5, 3)
    s, d = nvfp4_quantize(x2, 16, ref_gs)
    assert_bits_equal(q.scale.reshape(10, 3), s)
    assert_bits_equal(q.data.reshape(10, 24), d)
    # explicit [B, T, 1] global scale
    gs3 = torch.full((2, 5, 1), 0.01)
    q = quantize(x, global_scale=gs3)
    assert q.global_scale.shape == (2, 5, 1)
    s, d = nvfp4_quantize(x2, 16, gs3.reshape(10, 1))
    assert_bits_equal(q.scale.reshape(10, 3), s)
    assert_bits_equal(q.data.reshape(10, 24), d)


@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_rows_are_the_same_codes_as_a_2d_tensor(mode):
    """`NVFP4Tensor.rows()`: a [B, T, K] tensor as [B * T, K], each row's codes, scales and global scale those of
    quantizing that row alone; also for a strided slice of the positions (copied where a view cannot do)."""
    x = varied(2 * 5, 48, torch.float32, seed=10).view(2, 5, 48)
    q = quantize(x, scale_mode=mode)
    r = q.rows()
    NVFP4Tensor(r.data, r.scale, r.global_scale, r.shape)  # the constructor's checks hold
    assert r.shape == (10, 48) and r.rows() is r
    assert torch.equal(r.dequantize(), q.dequantize().reshape(10, 48))
    part = NVFP4Tensor(q.data[:, 1:4:2], q.scale[:, 1:4:2],
                       q.global_scale if mode == "tensor" else q.global_scale[:, 1:4:2], (2, 2, 48))
    assert torch.equal(part.rows().dequantize(), q.dequantize()[:, 1:4:2].reshape(4, 48))


def test_non_contiguous_input():
    w = varied(48, 64, torch.float32, seed=13)
    wt = w.T  # [64, 48], non-contiguous
    for mode in ("tensor", "row"):
        q = quantize(wt, scale_mode=mode)
        gs = per_tensor_amax_to_scale(w.abs().amax()) if mode == "tensor" else wt.abs().amax(-1, keepdim=True) / 2688.0
        s, d = nvfp4_quantize(wt.contiguous(), 16, gs)
        assert_bits_equal(q.scale, s)
        assert_bits_equal(q.data, d)


def test_global_scale_from_amax():
    amax = torch.tensor([0.0, 1.0, 2688.0, 1e30, 3e38])
    gs = global_scale_from_amax(amax)
    assert gs[0].item() == 2.0**-100  # floor, finite and positive
    assert torch.equal(gs[1:], amax[1:] / 2688.0)
    gs4 = global_scale_from_amax(amax, four_over_six=True)
    assert torch.equal(gs4[1:], amax[1:] / 1792.0)
    assert torch.isfinite(1.0 / gs).all()


# ------------------------------------------------------------------------------------ 2. E2M1 ties


def _nx(v: float, up: bool) -> float:
    return torch.nextafter(torch.tensor(v), torch.tensor(math.inf if up else -math.inf)).item()


# (value, expected code) for |v|, gs such that block scale is exactly 1
TIE_CASES = [
    (0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6), (6.0, 7),
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
    (_nx(0.25, True), 1), (_nx(0.25, False), 0),
    (_nx(0.75, True), 2), (_nx(0.75, False), 1),
    (_nx(1.25, True), 3), (_nx(1.25, False), 2),
    (_nx(1.75, True), 4), (_nx(1.75, False), 3),
    (_nx(2.5, True), 5), (_nx(2.5, False), 4),
    (_nx(3.5, True), 6), (_nx(3.5, False), 5),
    (_nx(5.0, True), 7), (_nx(5.0, False), 6),
    (0.1, 0), (0.3, 1), (5.9, 7), (2.7, 5), (1e-30, 0),
]


def test_round_e2m1_table():
    v = torch.tensor([c[0] for c in TIE_CASES], dtype=torch.float32)
    exp = torch.tensor([c[1] for c in TIE_CASES], dtype=torch.uint8)
    assert torch.equal(round_e2m1(v), exp)
    assert torch.equal(round_e2m1(-v), exp | 8)  # -0.0 and tiny negatives keep the sign: code 8
    assert torch.equal(ref_codes(v), exp)  # the test's own reference agrees with the table


@pytest.mark.parametrize("gs_exp", [0, -5, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_ties_exact(gs_exp, dtype):
    # every block holds one +-6 * 2^e and gs = 2^e: block_scale = e4m3(6 * 2^e / 6 / 2^e) = 1 and the
    # multiplier (1 / gs) / 1 = 2^-e are exact, so the codes see the raw tie values.
    vals = [c[0] for c in TIE_CASES]
    codes = [c[1] for c in TIE_CASES]
    if dtype == torch.bfloat16:  # keep only the cases exact in bf16
        keep = [i for i, v in enumerate(vals) if torch.tensor(v).bfloat16().float().item() == v]
        vals, codes = [vals[i] for i in keep], [codes[i] for i in keep]
    vals = vals + [-v for v in vals]
    codes = codes + [c | 8 for c in codes]
    n_blocks = -(-len(vals) // 15)
    x = torch.zeros(n_blocks, 16)
    exp = torch.zeros(n_blocks, 16, dtype=torch.uint8)
    x[:, 0] = torch.where(torch.arange(n_blocks) % 2 == 0, 6.0, -6.0)
    exp[:, 0] = torch.where(torch.arange(n_blocks) % 2 == 0, 7, 15).to(torch.uint8)
    flat_x = x[:, 1:].reshape(-1)
    flat_e = exp[:, 1:].reshape(-1)
    flat_x[: len(vals)] = torch.tensor(vals)
    flat_e[: len(vals)] = torch.tensor(codes, dtype=torch.uint8)
    x[:, 1:] = flat_x.view(n_blocks, 15)
    exp[:, 1:] = flat_e.view(n_blocks, 15)
    x = (x.reshape(1, -1) * 2.0**gs_exp).to(dtype)
    exp = exp.reshape(1, -1)
    gs = torch.tensor(2.0**gs_exp)
    q = quantize(x, global_scale=gs)
    assert torch.equal(q.global_scale, gs)
    assert torch.equal(u8(q.scale), torch.full((1, n_blocks), 0x38, dtype=torch.uint8))  # 1.0
    assert torch.equal(unpack_codes(q.data), exp)
    deq = dequantize(q)
    exp_deq = torch.tensor(E2M1)[exp.long()] * 2.0**gs_exp
    assert torch.equal(deq, exp_deq)  # -0.0 == 0.0 for torch.equal too
    assert not torch.isnan(deq).any()


def test_auto_scale_on_grid_values():
    # blocks of on-grid values with amax 6: the automatic scales give block scale 448 (0x7E) and every
    # value keeps its own code (a 1-ulp error in the fp32 multiplier cannot move an on-grid value).
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4, 64), generator=g, dtype=torch.uint8)
    codes[:, ::16] = 7
    x = torch.tensor(E2M1)[codes.long()] * 3.0
    for mode in ("tensor", "row"):
        q = quantize(x, scale_mode=mode)
        assert torch.equal(u8(q.scale), torch.full((4, 4), E4M3_448, dtype=torch.uint8))
        assert torch.equal(unpack_codes(q.data), codes)


def test_dequantize_all_codes():
    codes = torch.arange(16, dtype=torch.uint8).view(1, 16)
    data = pack_codes(codes)
    t = NVFP4Tensor(data, torch.ones(1, 1).to(torch.float8_e4m3fn), torch.tensor(1.0), (1, 16))
    out = dequantize(t)
    assert torch.equal(out, torch.tensor([E2M1]))
    assert out[0, 8].item() == 0.0  # code 8 decodes to (-)0
    assert torch.equal(t.dequantize(torch.bfloat16), torch.tensor([E2M1], dtype=torch.bfloat16))
    assert torch.equal(dequantize_unscaled(t), torch.tensor([E2M1]))


def test_negative_zero_and_tiny_negatives_keep_sign():
    x = torch.zeros(1, 16)
    x[0, 0] = 6.0
    x[0, 1] = -0.0
    x[0, 2] = -1e-6
    x[0, 3] = -0.25
    x[0, 4] = 0.0
    x[0, 5] = -1e-30
    q = quantize(x, global_scale=1.0)
    c = unpack_codes(q.data)[0]
    assert c[:6].tolist() == [7, 8, 8, 8, 0, 8]
    d = dequantize(q)[0]
    assert (d[1:6] == 0).all() and not torch.isnan(d).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saturation(dtype):
    gs = 0.01
    lim = 6 * 448 * gs  # 26.88
    x = torch.tensor([[1000.0, 30.0, -1000.0, -27.0, 10.0, 0.0] + [1.0] * 10,
                      [1e6] * 16], dtype=dtype)
    q = quantize(x, global_scale=gs)
    assert torch.equal(u8(q.scale), torch.full((2, 1), E4M3_448, dtype=torch.uint8))
    c = unpack_codes(q.data)
    assert c[0, :4].tolist() == [7, 7, 15, 15]
    # 10 / (gs * 448) = 2.23 -> 2.0 (code 4); 1 / 4.48 = 0.223 -> 0
    assert c[0, 4].item() == 4 and c[0, 6].item() == 0
    assert (c[1] == 7).all()
    d = dequantize(q)
    assert d[0, 0].item() == pytest.approx(lim, rel=1e-6)
    assert d[0, 2].item() == pytest.approx(-lim, rel=1e-6)
    assert torch.isfinite(d).all()


@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_block_inside_nonzero_row(mode, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g)
    x[:, 16:32] = 0.0
    x[1, 48:64] = -0.0
    x = x.to(dtype)
    q = quantize(x, scale_mode=mode)
    sb = u8(q.scale)
    assert (sb[:, 1] == E4M3_2M6).all()
    assert (sb[1, 3] == E4M3_2M6)
    c = unpack_codes(q.data)
    assert (c[:, 16:32] == 0).all()
    assert (c[1, 48:64] == 8).all()
    d = dequantize(q)
    assert (d[:, 16:32] == 0).all() and (d[1, 48:64] == 0).all()
    assert torch.isfinite(d).all()
    s, dd = nvfp4_quantize(x, 16, q.global_scale)
    assert_bits_equal(q.scale, s)
    assert_bits_equal(q.data, dd)


@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("four_over_six", [False, True])
def test_all_zero_rows_and_tensors(mode, dtype, four_over_six):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 32, generator=g)
    x[1] = 0.0
    x[3] = -0.0
    for t in (x.to(dtype), torch.zeros(5, 48, dtype=dtype), torch.zeros(2, 3, 16, dtype=dtype)):
        q = quantize(t, scale_mode=mode, four_over_six=four_over_six)
        gs = q.global_scale
        assert torch.isfinite(gs).all() and (gs > 0).all()
        assert not torch.isnan(q.scale.float()).any()
        zero_rows = (t == 0).all(-1)
        assert (u8(q.scale)[zero_rows] == E4M3_2M6).all()
        d = dequantize(q)
        assert not torch.isnan(d).any()
        assert torch.equal(d[zero_rows], torch.zeros_like(d[zero_rows]))
        assert ((unpack_codes(q.data)[zero_rows] & 7) == 0).all()
    q = quantize(torch.zeros(5, 48), scale_mode=mode)
    assert torch.equal(dequantize(q), torch.zeros(5, 48))


# ------------------------------------------------------------------------------------ 3. E4M3 scales


def test_small_block_scales_clamped_like_torchao():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 160, generator=g) * 1e-3
    x[0, :16] = torch.randn(16, generator=g) * 1000  # one huge block
    x[5, 32:48] *= 1e-3  # and some tinier ones
    q = quantize(x, scale_mode="tensor")
    gs = per_tensor_amax_to_scale(x.abs().amax())
    unclamped = x.view(8, 10, 16).abs().amax(-1) / 6 / gs
    assert (unclamped < 2.0**-6).sum() > 50  # the clamp is exercised
    sb = u8(q.scale)
    assert (sb >= E4M3_2M6).all()  # never a subnormal byte
    assert (sb[unclamped < 2.0**-6 * 0.9] == E4M3_2M6).all()
    s, d = nvfp4_quantize(x, 16, gs)
    assert_bits_equal(q.scale, s)
    assert_bits_equal(q.data, d)


@pytest.mark.parametrize("per_row", [False, True])
def test_dequantize_subnormal_scales(per_row):
    g = torch.Generator().manual_seed(5)
    rows, k = 7, 64
    codes = torch.randint(0, 16, (rows, k), generator=g, dtype=torch.uint8)
    sbytes = torch.randint(1, 8, (rows, k // 16), generator=g, dtype=torch.uint8)  # 0x01..0x07
    sbytes[0, 0] = 1
    sbytes[-1, -1] = 7
    if per_row:
        gs = (torch.rand(rows, 1, generator=g) * 3 + 0.01).float()
    else:
        gs = torch.tensor(0.3712345, dtype=torch.float32)
    t = NVFP4Tensor(pack_codes(codes), sbytes.view(torch.float8_e4m3fn), gs, (rows, k))
    kk = sbytes.double().repeat_interleave(16, dim=1)
    vals = torch.tensor(E2M1, dtype=torch.float64)[codes.long()]
    unscaled = vals * kk * 2.0**-9
    gs64 = gs.double() if per_row else gs.double().item()
    expected = (unscaled * gs64).float()
    assert torch.equal(dequantize(t), expected)
    assert torch.equal(dequantize_unscaled(t), unscaled.float())
    assert torch.equal(dequantize(t, torch.bfloat16), (unscaled * gs64).bfloat16())


# ------------------------------------------------------------------------------------ 4. round trip


@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error(mode, dtype):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 256, generator=g).to(dtype)
    q = quantize(x, scale_mode=mode)
    d = dequantize(q)
    xf = x.double()
    rel = (d.double() - xf).norm() / xf.norm()
    assert rel < 0.15
    # every value within one local grid step of its input
    unit = (q.scale.double() * (q.global_scale.double() if mode == "row" else q.global_scale.double().item()))
    unit = unit.repeat_interleave(16, dim=1)
    v = xf.abs() / unit
    step = torch.where(v < 2, 0.5, torch.where(v < 4, 1.0, 2.0))
    assert ((d.double() - xf).abs() <= step * unit * (1 + 1e-6)).all()
    # and the decoded value has the input's sign (or is zero)
    assert ((d.double() * xf) >= 0).all()
    assert torch.allclose(d.double(), decode64(q), rtol=1e-6, atol=0)


def test_pack_unpack_inverse():
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (3, 5, 32), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.shape == (3, 5, 16) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed), codes)
    raw = torch.randint(0, 256, (4, 24), generator=g, dtype=torch.uint8)
    assert torch.equal(pack_codes(unpack_codes(raw)), raw)


def test_nibble_order():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0, 7, 8]], dtype=torch.uint8)
    assert pack_codes(codes).tolist() == [[0x21, 0x43, 0x0F, 0x87]]
    assert unpack_codes(torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)).tolist() == [[1, 2, 0, 15]]
    # quantize puts element 0 in the low nibble: [6, 1, -0.5, 3, ...] -> 0x27, 0x59
    x = torch.zeros(1, 16)
    x[0, :4] = torch.tensor([6.0, 1.0, -0.5, 3.0])
    q = quantize(x, global_scale=1.0)
    assert q.data[0, :2].tolist() == [0x27, 0x59]
    assert (q.data[0, 2:] == 0).all()


# ------------------------------------------------------------------------------------ 5. stochastic


def _sr_input(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(1, 64, generator=g) * 12 - 6
    base[0, ::16] = 6.0  # block scale exactly 1 with gs = 1: no clamping bias
    return base.expand(rows, 64).contiguous()


def test_stochastic_unbiased():
    n = 4000
    x = _sr_input(n, seed=8)
    gen = torch.Generator().manual_seed(1234)
    q = quantize(x, global_scale=1.0, rounding="stochastic", generator=gen)
    assert torch.equal(u8(q.scale), torch.full((n, 4), 0x38, dtype=torch.uint8))
    d = dequantize(q).double()
    xr = x[0].double()
    # each draw is one of the two neighbouring grid points
    a = xr.abs()
    lo = GRID[(torch.searchsorted(GRID, a, right=True) - 1).clamp(0, 7)]
    hi = GRID[torch.searchsorted(GRID, a, right=False).clamp(0, 7)]
    da = d.abs()
    assert ((da == lo) | (da == hi)).all()
    p = (a - lo) / torch.where(hi > lo, hi - lo, torch.ones_like(a))
    se = (hi - lo) * torch.sqrt(p * (1 - p) / n)
    err = (d.mean(0) - xr).abs()
    assert (err <= 5 * se + 1e-12).all(), (err / (se + 1e-30)).max()
    # power check: RNE is biased far beyond that tolerance for some elements
    d_rne = dequantize(quantize(x, global_scale=1.0)).double()
    assert ((d_rne.mean(0) - xr).abs() > 5 * se + 1e-12).any()


def test_stochastic_direct_unbiased():
    n = 20000
    g = torch.Generator().manual_seed(9)
    v = torch.tensor([0.1, 0.26, 0.8, 1.3, 2.2, 2.9, 3.3, 4.5, 5.5, -0.4, -1.1, -5.0, -2.75])
    vv = v.repeat(n, 1)
    codes = round_e2m1_stochastic(vv, g)
    vals = torch.tensor(E2M1, dtype=torch.float64)[codes.long()]
    a = v.double().abs()
    lo = GRID[torch.searchsorted(GRID, a, right=True) - 1]
    hi = GRID[torch.searchsorted(GRID, a, right=False)]
    p = (a - lo) / (hi - lo)
    se = (hi - lo) * torch.sqrt(p * (1 - p) / n)
    assert ((vals.mean(0) - v.double()).abs() <= 5 * se).all()
    assert torch.equal(codes >> 3, torch.signbit(vv).to(torch.uint8))


def test_stochastic_reproducible_and_seed_dependent():
    x = varied(16, 64, torch.float32, seed=10)
    a = quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(42))
    b = quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(42))
    c = quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(43))
    assert torch.equal(a.data, b.data) and torch.equal(u8(a.scale), u8(b.scale))
    assert not torch.equal(a.data, c.data)
    # scales do not depend on the rounding
    r = quantize(x)
    assert torch.equal(u8(a.scale), u8(r.scale)) and torch.equal(a.global_scale, r.global_scale)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stochastic_on_grid_never_moves(seed):
    g = torch.Generator().manual_seed(100 + seed)
    codes = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.uint8)
    codes[:, ::16] = 7  # a 6.0 in every block: scale 1
    x = torch.tensor(E2M1)[codes.long()] * 0.125
    q = quantize(x, global_scale=0.125, rounding="stochastic", generator=torch.Generator().manual_seed(seed))
    assert torch.equal(dequantize(q), x)
    assert torch.equal(unpack_codes(q.data), codes)
    v = torch.tensor(E2M1[:8] + E2M1[9:])  # all nonzero-signed grid values
    assert torch.equal(round_e2m1_stochastic(v.repeat(100, 1), torch.Generator().manual_seed(seed)),
                       torch.tensor(list(range(8)) + list(range(9, 16)), dtype=torch.uint8).repeat(100, 1))


# ------------------------------------------------------------------------------------ 6. 2-D blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_2d_tiles_share_scale(dtype):
    w = varied(64, 96, dtype, seed=12)
    q = quantize(w, block_2d=True, scale_mode="tensor")
    sb = u8(q.scale).view(4, 16, 6)
    assert torch.equal(sb, sb[:, :1].expand_as(sb))
    # independent tile scale: e4m3(clamp(tile_amax / 6 / gs, 2^-6, 448))
    gs = per_tensor_amax_to_scale(w.float().abs().amax())
    assert torch.equal(q.global_scale, gs)
    tile_amax = w.float().abs().view(4, 16, 6, 16).amax(dim=(1, 3))
    exp = (tile_amax / 6 / gs).clamp(2.0**-6, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(sb[:, 0], u8(exp))
    # codes: x * ((1/gs) / scale), RNE
    recip = (1.0 / gs) / exp.float()
    v = (w.float().view(4, 16, 6, 16) * recip[:, None, :, None]).clamp(-6, 6).view(64, 96)
    assert torch.equal(unpack_codes(q.data), ref_codes(v))


def test_block_2d_partial_tile():
    w = varied(40, 32, torch.float32, seed=14)
    q = quantize(w, block_2d=True, scale_mode="tensor")
    sb = u8(q.scale)
    gs = q.global_scale
    for r0 in (0, 16, 32):
        tile = w[r0:r0 + 16]
        exp = (tile.abs().view(-1, 2, 16).amax(dim=(0, 2)) / 6 / gs).clamp(2.0**-6, 448.0).to(torch.float8_e4m3fn)
        assert torch.equal(sb[r0:r0 + 16], u8(exp).expand(tile.shape[0], 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_2d_transpose_invariant(dtype):
    w = varied(64, 96, dtype, seed=15)
    a = dequantize(quantize(w, block_2d=True, scale_mode="tensor"))
    b = dequantize(quantize(w.T.contiguous(), block_2d=True, scale_mode="tensor")).T
    assert torch.equal(a, b)
    c = dequantize(quantize(w.T, block_2d=True, global_scale=0.003)).T  # non-contiguous + explicit
    assert torch.equal(c, dequantize(quantize(w, block_2d=True, global_scale=0.003)))
    # sanity: 1-D blocks do not have this property on this data
    a1 = dequantize(quantize(w, scale_mode="tensor"))
    b1 = dequantize(quantize(w.T.contiguous(), scale_mode="tensor")).T
    assert not torch.equal(a1, b1)


def test_block_2d_row_mode_raises():
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError):
        quantize(w, block_2d=True, scale_mode="row")
    with pytest.raises(ValueError):
        quantize(w, block_2d=True, global_scale=torch.full((32, 1), 0.01))


# ------------------------------------------------------------------------------------ 7. 4 over 6


def _candidate(x: torch.Tensor, gs: torch.Tensor, target: float):
    """Independent per-block quantization scaling the block max to `target`; float64 error per block."""
    r, k = x.shape
    blocks = x.float().view(r, k // 16, 16)
    amax = blocks.abs().amax(-1)
    scale = ((amax / target) / gs).clamp(2.0**-6, 448.0).to(torch.float8_e4m3fn)
    recip = (1.0 / gs) / scale.float()
    v = (blocks * recip.unsqueeze(-1)).clamp(-6, 6)
    codes = ref_codes(v)
    gs64 = gs.double().unsqueeze(-1) if gs.dim() else gs.double()
    deq = torch.tensor(E2M1, dtype=torch.float64)[codes.long()] * scale.double().unsqueeze(-1) * gs64
    err = (deq - blocks.double()).square().sum(-1)
    return u8(scale), codes.view(r, k), err


@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_four_over_six(mode, dtype):
    g = torch.Generator().manual_seed(16)
    x = (torch.randn(256, 64, generator=g) * 10 ** (torch.rand(256, 1, generator=g) * 2 - 1)).to(dtype)
    xf = x.float()
    q = quantize(x, scale_mode=mode, four_over_six=True)
    amax = xf.abs().amax() if mode == "tensor" else xf.abs().amax(-1, keepdim=True)
    gs = amax / 1792.0
    assert torch.equal(q.global_scale, gs)
    s6, c6, e6 = _candidate(xf, gs, 6.0)
    s4, c4, e4 = _candidate(xf, gs, 4.0)
    sb = u8(q.scale)
    codes = unpack_codes(q.data)
    cb = codes.view(256, 4, 16)
    is6 = (sb == s6) & (cb == c6.view(256, 4, 16)).all(-1)
    is4 = (sb == s4) & (cb == c4.view(256, 4, 16)).all(-1)
    assert (is6 | is4).all()  # every block is one of the two candidates
    err = (decode64(q) - xf.double()).view(256, 4, 16).square().sum(-1)
    assert (err <= torch.minimum(e4, e6) * (1 + 1e-6) + 1e-300).all()
    picked4 = is4 & ~is6
    assert picked4.sum() > 10  # some blocks do pick scale-to-4
    assert picked4.sum() < picked4.numel()
    assert ((cb & 7).amax(-1)[picked4] < 7).all()  # their max is 4 (code 6), never 6
    assert (q.scale.float() <= 448).all() and torch.isfinite(q.scale.float()).all()
    d = dequantize(q)
    assert torch.isfinite(d).all()
    # total error no worse than the plain 6-scaling
    plain = dequantize(quantize(x, scale_mode=mode)).double()
    assert (d.double() - xf.double()).square().sum() <= (plain - xf.double()).square().sum()


def test_four_over_six_explicit_scale_and_stochastic():
    x = varied(16, 64, torch.float32, seed=17)
    q = quantize(x, four_over_six=True, global_scale=0.5 * x.abs().amax() / 1792, scale_mode="tensor")
    assert (q.scale.float() <= 448).all() and torch.isfinite(dequantize(q)).all()
    q = quantize(x, four_over_six=True, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    d = dequantize(q)
    assert torch.isfinite(d).all()
    assert (d - x).norm() / x.norm() < 0.3


# ------------------------------------------------------------------------------------ 8. RHT


def _sylvester16() -> torch.Tensor:
    i = torch.arange(16)
    pc = torch.tensor([bin(int(a) & int(b)).count("1") for a in i for b in i]).view(16, 16)
    return (1 - 2 * (pc % 2)).float()


def test_hadamard_matrix():
    q = hadamard_matrix(0)
    assert q.shape == (16, 16) and q.dtype == torch.float32
    assert (q.abs() == 0.25).all()
    assert torch.allclose(q @ q.T, torch.eye(16), atol=1e-6, rtol=0)
    assert torch.allclose(q.T @ q, torch.eye(16), atol=1e-6, rtol=0)
    # Q = diag(signs) @ H16 / 4
    ratio = 4 * q / _sylvester16()
    assert torch.equal(ratio, ratio[:, :1].expand(16, 16))
    assert set(ratio[:, 0].tolist()) <= {1.0, -1.0}
    assert torch.equal(hadamard_matrix(0), q)
    assert torch.equal(hadamard_matrix(3), hadamard_matrix(3))
    signs = {tuple((4 * hadamard_matrix(s) / _sylvester16())[:, 0].tolist()) for s in range(5)}
    assert len(signs) > 1


@pytest.mark.parametrize("seed", [0, 7])
def test_rht_cancels_in_product(seed):
    g = torch.Generator().manual_seed(18)
    a = torch.randn(8, 64, generator=g)
    b = torch.randn(12, 64, generator=g)
    ra, rb = rht(a, seed), rht(b, seed)
    assert not torch.allclose(ra, a)
    ref = (a.double() @ b.double().T)
    assert torch.allclose((ra.double() @ rb.double().T), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(rht(ra, seed, inverse=True), a, rtol=1e-5, atol=1e-6)
    # per-block rotation: norms of each 16-block are preserved
    assert torch.allclose(ra.view(8, 4, 16).norm(dim=-1), a.view(8, 4, 16).norm(dim=-1), rtol=1e-5)
    # each block is x_blk @ Q
    qm = hadamard_matrix(seed).double()
    assert torch.allclose(ra.double().view(8, 4, 16), a.double().view(8, 4, 16) @ qm, atol=1e-6)


def test_rht_dtype_and_shape():
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(19)).bfloat16()
    y = rht(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.allclose(rht(y, inverse=True).float(), x.float(), rtol=0.02, atol=0.02)
    with pytest.raises(ValueError):
        rht(torch.randn(4, 20))


# ------------------------------------------------------------------------------------ 9. swizzle


@pytest.mark.parametrize("shape", [(128, 4), (300, 37), (1, 1), (129, 5), (256, 8)])
@pytest.mark.parametrize("fp8", [False, True])
def test_to_blocked_matches_torchao(shape, fp8):
    g = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    s = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if fp8:
        s = s.view(torch.float8_e4m3fn)
    ours = to_blocked(s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ao_to_blocked(s)
    assert ours.dtype == s.dtype
    assert_bits_equal(ours.reshape(-1), ref.reshape(-1))
    back = from_blocked(ours, *shape)
    assert back.dtype == s.dtype
    assert_bits_equal(back, s)


def test_blocked_layout_hand_positions():
    s = torch.zeros(128, 4, dtype=torch.uint8)
    s[0, 1] = 1
    s[32, 0] = 2
    s[1, 0] = 3
    s[127, 3] = 4
    b = to_blocked(s)
    assert b.numel() == 512
    assert b[1] == 1 and b[4] == 2 and b[16] == 3 and b[31 * 16 + 3 * 4 + 3] == 4


def test_blocked_errors():
    with pytest.raises(ValueError):
        to_blocked(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError):
        from_blocked(torch.zeros(100, dtype=torch.uint8), 128, 4)


# ------------------------------------------------------------------------------------ 10. bad input


def test_bad_last_dim():
    with pytest.raises(ValueError, match=r"\bx\b"):
        quantize(torch.randn(4, 20))
    with pytest.raises(ValueError, match=r"\bweight\b"):
        check_float_input(torch.randn(3, 8), "weight")
    with pytest.raises(ValueError):
        quantize(torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.int64, torch.float64, torch.bool])
def test_bad_dtype(dtype):
    with pytest.raises(TypeError, match=r"\bx\b"):
        quantize(torch.zeros(2, 16, dtype=dtype))


def test_not_a_tensor():
    with pytest.raises(TypeError):
        check_float_input([1.0] * 16, "x")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_inf_rejected(bad, dtype):
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(20))
    x[1, 7] = bad
    x = x.to(dtype)
    with pytest.raises(ValueError, match="NaN"):
        quantize(x)
    with pytest.raises(ValueError, match="NaN"):
        check_float_input(x, "x")
    check_float_input(x, "x", check_finite=False)  # no scan, no error
    quantize(x, check_finite=False, global_scale=1.0)  # no error either


def test_bad_options():
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(21))
    with pytest.raises(ValueError):
        quantize(x, scale_mode="block")
    with pytest.raises(ValueError):
        quantize(x, rounding="nearest")


@pytest.mark.parametrize("gs", [0.0, -1.0, math.nan, math.inf, torch.tensor(-0.5), torch.tensor([[0.1], [0.0]])])
def test_bad_global_scale_value(gs):
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(22))
    with pytest.raises(ValueError):
        quantize(x, global_scale=gs)


@pytest.mark.parametrize("shape", [(2,), (3, 1), (1, 2), (2, 2), (2, 1, 1)])
def test_bad_global_scale_shape(shape):
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(23))
    with pytest.raises(ValueError):
        quantize(x, global_scale=torch.full(shape, 0.01))


def test_nvfp4tensor_validation():
    data = torch.zeros(3, 16, dtype=torch.uint8)
    scale = torch.ones(3, 2).to(torch.float8_e4m3fn)
    gs = torch.tensor(1.0)
    NVFP4Tensor(data, scale, gs, (3, 32))  # valid
    NVFP4Tensor(data, scale, torch.ones(3, 1), (3, 32))  # valid per-row
    with pytest.raises(ValueError):
        NVFP4Tensor(data.to(torch.int8), scale, gs, (3, 32))
    with pytest.raises(ValueError):
        NVFP4Tensor(torch.zeros(3, 32, dtype=torch.uint8), scale, gs, (3, 32))
    with pytest.raises(ValueError):
        NVFP4Tensor(data, scale.float(), gs, (3, 32))
    with pytest.raises(ValueError):
        NVFP4Tensor(data, torch.ones(3, 4).to(torch.float8_e4m3fn), gs, (3, 32))
    with pytest.raises(ValueError):
        NVFP4Tensor(data, scale, gs.double(), (3, 32))
    with pytest.raises(ValueError):
        NVFP4Tensor(data, scale, torch.ones(3), (3, 32))
    with pytest.raises(ValueError):
        NVFP4Tensor(data, scale, gs, (4, 32))


def test_nvfp4tensor_rejects_k_not_multiple_of_16():
    # BUG (nvfp4.py): NVFP4Tensor.__post_init__ only checks data/scale shapes against K//2 and K//16,
    # so a logical K that is not a multiple of 16 is accepted and dequantize later fails with an
    # unrelated RuntimeError from .view().
    for k, dk, sk in ((20, 10, 1), (15, 7, 0)):
        data = torch.zeros(3, dk, dtype=torch.uint8)
        scale = torch.ones(3, sk).to(torch.float8_e4m3fn)
        try:
            NVFP4Tensor(data, scale, torch.tensor(1.0), (3, k))
        except ValueError:
            continue
        raise AssertionError(f"NVFP4Tensor accepted logical shape (3, {k}) with K % 16 != 0")


@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_empty_last_dim(mode):
    # BUG (nvfp4.py): check_float_input accepts K == 0 (0 % 16 == 0), but quantize then crashes with
    # a RuntimeError from reshape(-1, 0). Either a clean ValueError or an empty result is acceptable.
    x = torch.zeros(4, 0)
    try:
        q = quantize(x, scale_mode=mode)
    except ValueError:
        return
    except RuntimeError as e:
        raise AssertionError(f"quantize of a [4, 0] tensor raised RuntimeError instead of ValueError: {e}")
    assert q.data.shape == (4, 0) and q.scale.shape == (4, 0)
    assert dequantize(q).shape == (4, 0)

