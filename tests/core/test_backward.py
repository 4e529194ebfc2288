"""The learner's fast paths: the GPU straight-through backward (bf16 operands, transposed views, no fp32
round trips), the batched re-quantize of the masters, the optimizer.

CPU tests check the gradients of `ops.linear` against plain fp32 autograd on the dequantized operands, and
run the GPU backward's code path with CPU matmuls; the CUDA tests (skipped without a GPU) check the
real GPU path against the same references.
"""
import pytest
import torch
from tests.backends import HAS_CUDA, HAS_TRITON, CudaScalarDivision

from minite_core import backward, nvfp4, ops
from minite_core.nvfp4 import NVFP4Tensor
from minite_core.rl import step as rl_step

BF16 = torch.bfloat16
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def _rand(*shape, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _reference_grads(x, w, g, quantized: bool, scale_mode="row"):
    """fp32 autograd of F.linear on the operands the straight-through backward multiplies: bf16-rounded
    deq(Q(x)) and deq(W) for NVFP4 weights, the bf16-rounded plain operands otherwise; g rounded to bf16."""
    if quantized:
        xd = nvfp4.quantize(x.detach().float(), scale_mode=scale_mode).dequantize(BF16).float()
        wd = w.dequantize(BF16).float()
    else:
        xd, wd = x.detach().to(w.dtype).float(), w.detach().float()
    xd.requires_grad_(True)
    wd.requires_grad_(True)
    torch.nn.functional.linear(xd, wd).backward(g.to(BF16).float())
    return xd.grad, wd.grad


def _close(actual, expected, dtype):
    tol = {torch.float32: (2e-5, 2e-5), BF16: (1.6e-2, 1e-2)}[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol[0], atol=tol[1])


# ------------------------------------------------------------------------------------ linear backward


@pytest.mark.parametrize("x_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_nvfp4_ste_gradients_vs_fp32_autograd(x_dtype, with_bias):
    m, n, k = 10, 48, 64
    master = (_rand(n, k, seed=3) * 0.1).requires_grad_(True)
    wq = nvfp4.quantize(master.detach(), scale_mode="tensor")
    x = _rand(m, k, seed=4, dtype=x_dtype).requires_grad_(True)
    bias = _rand(n, seed=5).requires_grad_(True) if with_bias else None
    g = _rand(m, n, seed=6)
    ops.linear(x, wq, bias, master=master, out_dtype=torch.float32).backward(g)
    rx, rw = _reference_grads(x, wq, g, quantized=True)
    assert x.grad.dtype == x_dtype and master.grad.dtype == torch.float32
    _close(x.grad, rx, x_dtype)
    _close(master.grad, rw, torch.float32)
    if with_bias:
        _close(bias.grad, g.sum(0), torch.float32)  # the bias gradient sums g itself, not its bf16 rounding


def test_bf16_plain_gradients_vs_fp32_autograd():
    m, n, k = 12, 40, 32
    w = (_rand(n, k, seed=7) * 0.1).to(BF16).requires_grad_(True)
    x = _rand(m, k, seed=8, dtype=BF16).requires_grad_(True)
    g = _rand(m, n, seed=9).to(BF16)
    ops.linear(x, w).backward(g)
    rx, rw = _reference_grads(x, w, g, quantized=False)
    assert x.grad.dtype == BF16 and w.grad.dtype == BF16
    _close(x.grad, rx, BF16)
    _close(w.grad, rw, BF16)


def test_unneeded_gradients_are_skipped():
    master = (_rand(32, 64, seed=10) * 0.1).requires_grad_(True)
    wq = nvfp4.quantize(master.detach(), scale_mode="tensor")
    x = _rand(4, 64, seed=11)  # no grad: dgrad not needed
    ops.linear(x, wq, master=master).sum().backward()
    assert master.grad is not None and x.grad is None
    x = x.clone().requires_grad_(True)
    ops.linear(x, wq).sum().backward()  # no master: wgrad not needed
    assert x.grad is not None


@pytest.mark.parametrize("kind", ["nvfp4", "bf16", "fp32"])
def test_gpu_backward_code_path_matches_cpu_backward(kind):
    """`backward.ste_cuda` (run here with its CPU matmul stand-in) == the CPU `backward.ste_cpu` up to
    fp32 summation order, and its bf16 outputs are the fp32 results rounded once."""
    m, n, k = 20, 48, 64
    g = _rand(m, n, seed=12).to(BF16)
    if kind == "nvfp4":
        w = nvfp4.quantize(_rand(n, k, seed=13) * 0.1, scale_mode="tensor")
        x2 = _rand(m, k, seed=14, dtype=BF16)
        xq = nvfp4.quantize(x2)
        x_dtype, w_dtype = BF16, torch.float32
    else:
        dt = BF16 if kind == "bf16" else torch.float32
        w, x2, xq = (_rand(n, k, seed=13) * 0.1).to(dt), _rand(m, k, seed=14, dtype=dt), None
        x_dtype = w_dtype = dt
    ref_x, ref_w = backward.ste_cpu(g.float(), x2, w, xq)
    gx, gw = backward.ste_cuda(g, x2, w, xq, x_dtype, w_dtype)
    assert gx.shape == (m, k) and gw.shape == (n, k)
    _close(gx, ref_x.to(x_dtype), x_dtype)
    _close(gw, ref_w.to(w_dtype), w_dtype)
    assert backward.ste_cuda(g, x2, w, xq, None, w_dtype)[0] is None
    assert backward.ste_cuda(g, x2, w, xq, x_dtype, None)[1] is None


@cuda_only
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))])
@pytest.mark.parametrize("x_dtype", [torch.float32, BF16])
def test_cuda_nvfp4_gradients_vs_fp32_autograd_and_cpu(backend, x_dtype):
    m, n, k = 300, 256, 512
    master_cpu = _rand(n, k, seed=15) * 0.1
    x_cpu = _rand(m, k, seed=16, dtype=x_dtype)
    g_cpu = _rand(m, n, seed=17).to(BF16)
    grads = {}
    for dev in ("cpu", "cuda"):
        master = master_cpu.to(dev).detach().requires_grad_(True)  # (a leaf on each device)
        x = x_cpu.to(dev).detach().requires_grad_(True)
        wq = ops.quantize(master.detach(), scale_mode="tensor", backend=backend if dev == "cuda" else "torch")
        out = ops.linear(x, wq, master=master, out_dtype=BF16, backend=backend if dev == "cuda" else "torch")
        out.backward(g_cpu.to(dev))
        grads[dev] = (x.grad.cpu(), master.grad.cpu())
        if dev == "cuda":
            rx, rw = _reference_grads(x.cpu(), wq.to("cpu"), g_cpu, quantized=True)
    assert grads["cuda"][0].dtype == x_dtype and grads["cuda"][1].dtype == torch.float32
    for got in grads.values():
        _close(got[0], rx, x_dtype)
        _close(got[1], rw, torch.float32)


@cuda_only
def test_cuda_bf16_plain_gradients_vs_fp32_autograd():
    m, n, k = 300, 256, 512
    w = (_rand(n, k, seed=18) * 0.1).to("cuda", BF16).requires_grad_(True)
    x = _rand(m, k, seed=19, device="cuda", dtype=BF16).requires_grad_(True)
    g = _rand(m, n, seed=20, device="cuda").to(BF16)
    ops.linear(x, w).backward(g)
    rx, rw = _reference_grads(x.cpu(), w.cpu(), g.cpu(), quantized=False)
    _close(x.grad.cpu(), rx, BF16)
    _close(w.grad.cpu(), rw, BF16)


# ------------------------------------------------------------------------------ re-quantize, optimizer


def _same(a: NVFP4Tensor, b: NVFP4Tensor) -> bool:
    return (torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
            and torch.equal(a.global_scale.reshape(()), b.global_scale.reshape(())))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))])
def test_quantize_weights_same_bits_as_one_at_a_time(backend):
    dev = "cuda" if HAS_CUDA else "cpu"
    ws = [_rand(16, 32, seed=22, device=dev) * 3, _rand(8, 64, seed=23, device=dev) * 1e-3,
          torch.zeros(16, 16, device=dev)]
    got = ops.quantize_weights(ws, backend=backend)
    for w, q in zip(ws, got):
        assert _same(q, ops.quantize(w, scale_mode="tensor", backend=backend))
        assert _same(q, nvfp4.quantize(w, scale_mode="tensor"))
    bad = ws[1].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        ops.quantize_weights([ws[0], bad], backend=backend)
    if backend == "triton":  # one launch for all: the tensors must agree, and each row be whole blocks
        with pytest.raises(ValueError, match="one dtype"):
            ops.quantize_weights([ws[0], ws[1].to(torch.bfloat16)], backend=backend)
        with pytest.raises(ValueError, match=r"tensors\[1\] has shape \(4, 24\)"):
            ops.quantize_weights([ws[0], _rand(4, 24, seed=24, device=dev)], backend=backend)


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_a_weight_that_carries_its_bf16_values_has_the_gradients_of_one_dequantized_in_the_backward():
    """The learner's re-quantize hands each weight its bf16 values (`quantize_weights(dequantized=True)`,
    `NVFP4Tensor.dequantized`), which the straight-through backward reads instead of dequantizing the weight:
    the gradients are those of the weight without it, bit for bit; and it is what the backward reads (a
    weight whose bf16 form is altered gets another grad_x)."""
    import dataclasses

    dev = "cuda" if HAS_CUDA else "cpu"
    m, n, k = 40, 48, 96
    master = (_rand(n, k, seed=31, device=dev) * 0.1).requires_grad_(True)
    x0 = _rand(m, k, seed=32, device=dev, dtype=BF16)
    g = _rand(m, n, seed=33, device=dev).to(BF16)
    cached, = ops.quantize_weights([master.detach()], backend="triton", dequantized=True)
    assert cached.dequantized is not None and cached.dequantized.dtype == BF16 and cached.dequantized.shape == (n, k)
    assert torch.equal(cached.dequantized.view(torch.int16), nvfp4.dequantize(cached, BF16).view(torch.int16))

    def grads(w):
        x = x0.clone().requires_grad_(True)
        master.grad = None
        ops.linear(x, w, master=master, backend="triton").backward(g)
        return x.grad, master.grad

    plain = dataclasses.replace(cached, dequantized=None)
    (gx, gw), (rx, rw) = grads(cached), grads(plain)
    assert torch.equal(gx, rx) and torch.equal(gw, rw)
    altered = dataclasses.replace(cached, dequantized=cached.dequantized * 2)
    assert not torch.equal(grads(altered)[0], rx)
    with pytest.raises(ValueError, match="dequantized must be bfloat16"):
        dataclasses.replace(cached, dequantized=cached.dequantized.float())


def test_optimizer_and_clip():
    p = torch.nn.Parameter(torch.ones(4))
    opt = rl_step.make_optimizer([p], lr=0.1)
    assert opt.defaults["foreach"] is True and not opt.defaults.get("fused")
    p.grad = torch.full((4,), 3.0)
    norm = rl_step.clip_grad_norm([p], 1.0)
    assert torch.isclose(norm, torch.tensor(6.0)) and torch.isclose(p.grad.norm(), torch.tensor(1.0), atol=1e-5)
    opt.step()
    if HAS_CUDA:
        q = torch.nn.Parameter(torch.ones(4, device="cuda"))
        assert rl_step.make_optimizer([q], lr=0.1).defaults["fused"] is True


def test_plain_weight_with_fp32_master_gets_fp32_gradient():
    """A bf16 weight with its fp32 master: the gradient lands on the master in fp32 (not rounded to bf16)."""
    m, n, k = 12, 40, 32
    master = (_rand(n, k, seed=24) * 0.1).requires_grad_(True)
    w = master.detach().to(BF16)
    x = _rand(m, k, seed=25, dtype=BF16).requires_grad_(True)
    g = _rand(m, n, seed=26).to(BF16)
    ops.linear(x, w, master=master).backward(g)
    rx, rw = _reference_grads(x, w, g, quantized=False)
    assert master.grad.dtype == torch.float32
    _close(master.grad, rw, torch.float32)
    _close(x.grad, rx, BF16)
    w2 = master.detach().to(BF16).requires_grad_(True)  # the old way: cast in the graph, bf16 gradient
    ops.linear(x.detach(), w2).backward(g)
    _close(w2.grad, master.grad, BF16)


# ------------------------------------------------------------------------------------------ fp8 backward


def test_fp8_products_are_the_e4m3_rounded_operands_multiplied():
    """`_fp8_mm`: each operand row scaled by amax / 448 and rounded to e4m3 (here rebuilt by hand, with
    torch's own e4m3 cast), the product of those values in fp64 matches to fp32 accumulation; odd shapes
    are padded, zero rows stay zero."""
    a = _rand(37, 50, seed=3) * torch.logspace(-3, 3, 37).unsqueeze(1)
    b = _rand(21, 50, seed=4)
    a[5] = 0.0
    got = backward._fp8_mm(a, b)

    def by_hand(t):
        s = t.abs().amax(1, keepdim=True) / 448.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        return (t / s).to(torch.float8_e4m3fn).double() * s.double()
    want = by_hand(a) @ by_hand(b).T
    assert got.shape == (37, 21) and got.dtype == torch.float32 and not got[5].any()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    exact = a.double() @ b.double().T  # e4m3 keeps 3 mantissa bits: a few percent off the exact product
    err = ((got.double() - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 0.06, err


def test_fp8_gradients_are_the_ste_gradients_up_to_e4m3():
    w = _rand(40, 64, seed=5) * 0.1
    x = _rand(30, 64, seed=6, dtype=BF16)
    g = _rand(30, 40, seed=7)
    wq = nvfp4.quantize(w, scale_mode="tensor")
    grads = {}
    for recipe in ("ste", "fp8"):
        xr, m = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ops.linear(xr, wq, master=m, backward=recipe).backward(g.to(BF16))
        grads[recipe] = (xr.grad.float(), m.grad)
        assert xr.grad.dtype == BF16 and m.grad.dtype == torch.float32
    for a, b in zip(grads["fp8"], grads["ste"]):
        rel = ((a - b).norm() / b.norm()).item()
        assert 1e-3 < rel < 0.06, rel


def test_fp8_grad_x_comes_in_bf16_for_bf16_activations_with_one_rounding():
    """The GEMM writes bf16 on the GPU: for bf16 activations grad_x is that output itself (no fp32 copy and
    cast back), the same values as the fp32 result rounded once; grad_w stays fp32 for the masters."""
    dev = "cuda" if HAS_CUDA else "cpu"
    w = _rand(48, 64, seed=11, device=dev) * 0.1
    x = _rand(33, 64, seed=12, device=dev, dtype=BF16)
    g = _rand(33, 48, seed=13, device=dev, dtype=BF16)
    wq, xq = nvfp4.quantize(w, scale_mode="tensor"), nvfp4.quantize(x)
    gx32, gw32 = backward.fp8_recipe(g, x, wq, xq, True, True)
    gx, gw = backward.fp8_recipe(g, x, wq, xq, True, True, x_dtype=BF16)
    assert gx32.dtype == gw32.dtype == gw.dtype == torch.float32 and gx.dtype == BF16
    assert torch.equal(gx, gx32.to(BF16)) and torch.equal(gw, gw32)


@cuda_only
def test_cuda_fp8_gradients_match_the_cpu_recipe():
    """The GPU's row-scaled e4m3 GEMM (torch._scaled_mm, bf16 out) against the CPU path on the same operands."""
    w = _rand(96, 128, seed=8) * 0.1
    x = _rand(70, 128, seed=9, dtype=BF16)
    g = _rand(70, 96, seed=10)
    wq = nvfp4.quantize(w, scale_mode="tensor")
    out = {}
    for dev in ("cpu", "cuda"):
        xr, m = x.detach().to(dev).requires_grad_(True), w.detach().to(dev).requires_grad_(True)
        ops.linear(xr, wq.to(dev) if dev == "cuda" else wq, master=m, backward="fp8").backward(g.to(dev, BF16))
        out[dev] = (xr.grad.float().cpu(), m.grad.cpu())
    for a, b in zip(out["cuda"], out["cpu"]):
        assert ((a - b).norm() / b.norm()).item() < 0.01


def test_e4m3_rows_divides_truly_on_every_device():
    """The fp8 operands' definition must be the kernel's arithmetic (`div_rn`) on the GPU too: with division by
    a number done as CUDA does it, its scales and bytes stay the same (amax / 448 as a multiply by 1/448 differs
    in the last bit for some rows; it made the GPU kernel disagree with its definition)."""
    a = _rand(64, 48, seed=41) * torch.exp(_rand(64, 1, seed=42) * 3)
    want_q, want_s = backward.e4m3_rows(a)
    with CudaScalarDivision():
        got_q, got_s = backward.e4m3_rows(a)
        amax = a.abs().amax(dim=1, keepdim=True)
        assert not torch.equal(amax / nvfp4.E4M3_MAX, nvfp4.div(amax, nvfp4.E4M3_MAX))  # the mode bites
    assert torch.equal(got_s, want_s) and torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
