"""The Triton row kernels (RMSNorm, SiLU * up, RoPE) and the fused token-logprob backward, on the CPU under
TRITON_INTERPRET=1 and on the GPU when there is one: close to the torch backend (within a rounding of
the output dtype), gradients close to fp32 autograd through the reference, and batch-invariant bit for
bit (a row alone == that row in a batch, wherever it sits)."""
import pytest
import torch
from tests.backends import HAS_CUDA

from minite_core import ops, reference

pytestmark = [pytest.mark.skipif(pytest.importorskip("triton") is None, reason="triton"),
              pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter]

BF16_TOL = 2.0**-6  # a rounding or two of bf16 (8 significant bits)


def _rand(*shape, seed, device, dtype=torch.float32, scale=1.5, shift=0.0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale + shift
    return x.to(device=device, dtype=dtype)


def _close(a, b, dtype):
    a, b = a.float(), b.float()
    if dtype == torch.bfloat16:
        return torch.allclose(a, b, rtol=BF16_TOL, atol=1e-3)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _invariant(f, x, *rest):
    """f on one row alone, on an odd-sized slice starting mid-tile, and on the whole batch: same bits."""
    full = f(x, *rest)
    assert torch.equal(f(x[:1], *(r[:1] for r in rest)), full[:1])
    assert torch.equal(f(x[3:4], *(r[3:4] for r in rest)), full[3:4])
    assert torch.equal(f(x[2:7], *(r[2:7] for r in rest)), full[2:7])


# ------------------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("n", [48, 80])
@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32)])
def test_rms_norm_close_and_batch_invariant(device, n, dtype, wdtype):
    x = _rand(9, n, seed=1, device=device, dtype=dtype, shift=0.3)
    w = _rand(n, seed=2, device=device, dtype=wdtype, scale=0.3, shift=1.0)
    got = ops.rms_norm(x, w, 1e-6, backend="triton")
    ref = ops.rms_norm(x, w, 1e-6, backend="torch")
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert _close(got, ref, dtype), (got.float() - ref.float()).abs().max()
    _invariant(lambda t: ops.rms_norm(t, w, 1e-6, backend="triton"), x)
    # leading dimensions and a strided row view (the model's per-head q/k norm)
    x3 = _rand(3, 5, 2 * n, seed=3, device=device, dtype=dtype)[..., :n]
    assert torch.equal(ops.rms_norm(x3, w, backend="triton"), ops.rms_norm(x3.contiguous(), w, backend="triton"))


def test_rms_norm_gradient_close_to_fp32_autograd(device):
    n = 64
    x = _rand(2, 7, n, seed=4, device=device).requires_grad_(True)
    w = _rand(n, seed=5, device=device, scale=0.3, shift=1.0).requires_grad_(True)
    g = _rand(2, 7, n, seed=6, device=device)
    got = torch.autograd.grad(ops.rms_norm(x, w, 1e-6, backend="triton"), (x, w), g)
    ref = torch.autograd.grad(reference.rms_norm(x, w, 1e-6), (x, w), g)
    for a, r in zip(got, ref):
        assert a.dtype == r.dtype and torch.allclose(a, r, rtol=1e-4, atol=1e-5), (a - r).abs().max()
    # bf16 model: gradient dtypes follow the inputs, values close to the fp32 gradient
    xb, wb = x.detach().bfloat16().requires_grad_(True), w.detach().bfloat16().requires_grad_(True)
    gx, gw = torch.autograd.grad(ops.rms_norm(xb, wb, 1e-6, backend="triton"), (xb, wb), g.bfloat16())
    assert gx.dtype == gw.dtype == torch.bfloat16
    assert torch.allclose(gx.float(), ref[0], rtol=0.05, atol=0.02) and torch.allclose(gw.float(), ref[1], rtol=0.05, atol=0.05)


# ------------------------------------------------------------------------------------------ SiLU * up
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_close_and_batch_invariant(device, dtype):
    gate = _rand(9, 37, seed=7, device=device, dtype=dtype, scale=3.0)
    up = _rand(9, 37, seed=8, device=device, dtype=dtype)
    got = ops.silu_mul(gate, up, backend="triton")
    ref = ops.silu_mul(gate, up, backend="torch")
    assert got.dtype == ref.dtype and _close(got, ref, dtype), (got.float() - ref.float()).abs().max()
    _invariant(lambda a, b: ops.silu_mul(a, b, backend="triton"), gate, up)


def test_silu_mul_gradient_close_to_fp32_autograd(device):
    gate = _rand(5, 300, seed=9, device=device, scale=4.0).requires_grad_(True)
    up = _rand(5, 300, seed=10, device=device).requires_grad_(True)
    g = _rand(5, 300, seed=11, device=device)
    got = torch.autograd.grad(ops.silu_mul(gate, up, backend="triton"), (gate, up), g)
    ref = torch.autograd.grad(reference.silu_mul(gate, up), (gate, up), g)
    for a, r in zip(got, ref):
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-5), (a - r).abs().max()


# ------------------------------------------------------------------- the row ops that also quantize
def _same_nvfp4(a, b):
    return (torch.equal(a.data, b.data) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
            and torch.equal(a.global_scale, b.global_scale) and a.shape == b.shape)


@pytest.mark.parametrize("backend,tile", [("torch", "-"), ("triton", "whole row"), ("triton", "walk")])
@pytest.mark.parametrize("n", [64, 208])  # (interpreter: 64 is whole quantize chunks, 208 is not)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_ops_that_quantize_their_output(device, monkeypatch, backend, tile, n, dtype):
    """rms_norm / silu_mul with quantize=True: the op's own output (bits), and quantize() of it (bits), from
    one kernel on the triton backend; batch-invariant; rows past the program's tile and odd row counts. The
    triton SiLU*up and quantize take the whole row in one tile for these few rows, or (walk) the chunk walk
    that many rows take (`quantize.one_tile`)."""
    if tile == "walk":
        from minite_core.kernels import quantize as qk

        monkeypatch.setattr(qk, "ONE_TILE_MAX_ROWS", 0)
    x = _rand(2, 7, n, seed=20, device=device, dtype=dtype) * torch.logspace(-3, 1, 7, device=device).view(1, 7, 1).to(dtype)
    w = _rand(n, seed=21, device=device, dtype=dtype, shift=1.0)
    up = _rand(2, 7, n, seed=22, device=device, dtype=dtype)
    for name, op, args in (("rms_norm", lambda *a, **k: ops.rms_norm(*a, 1e-6, **k), (x, w)), ("silu_mul", ops.silu_mul, (x, up))):
        y, yq = op(*args, backend=backend, quantize=True)
        plain = op(*args, backend=backend)
        assert torch.equal(y, plain), f"{name}: output with quantize=True != without ({(y != plain).sum()} values)"
        q = ops.quantize(y, backend=backend)
        assert _same_nvfp4(yq, q) and yq.shape == x.shape, (
            f"{name}: fused NVFP4 != quantize(output): bytes {(yq.data != q.data).sum()}, scale bytes "
            f"{(yq.scale.view(torch.uint8) != q.scale.view(torch.uint8)).sum()}, global scales "
            f"{(yq.global_scale != q.global_scale).sum()}")
        flat = [a.reshape(-1, n) if a.dim() == 3 else a for a in args]
        full = op(*flat, backend=backend, quantize=True)[1]
        for lo, hi in ((0, 1), (3, 4), (5, 14)):
            part = op(flat[0][lo:hi], *(a[lo:hi] if a.dim() == 2 else a for a in flat[1:]), backend=backend, quantize=True)[1]
            assert torch.equal(part.data, full.data[lo:hi]) and torch.equal(part.global_scale, full.global_scale[lo:hi]), (
                f"{name}: rows {lo}:{hi} alone != the same rows in the batch")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm(device, backend, dtype):
    """The residual add fused into the next norm: s == x + delta, y == rms_norm(s), its quantize == quantize(y),
    bit for bit; gradients as through `x + delta` and `rms_norm`."""
    x = _rand(3, 5, 64, seed=30, device=device, dtype=dtype)
    delta = _rand(3, 5, 64, seed=31, device=device, dtype=dtype, scale=0.3)
    w = _rand(64, seed=32, device=device, dtype=dtype, shift=1.0)
    for quantize in (False, True):
        s, y, yq = ops.add_rms_norm(x, delta, w, 1e-6, backend=backend, quantize=quantize)
        assert torch.equal(s, x + delta) and torch.equal(y, ops.rms_norm(x + delta, w, 1e-6, backend=backend))
        assert (yq is None) != quantize and (not quantize or _same_nvfp4(yq, ops.quantize(y, backend=backend)))
    if backend == "triton":
        leaves = [z.float().requires_grad_(True) for z in (x, delta, w)]
        gy, gs = _rand(3, 5, 64, seed=33, device=device), _rand(3, 5, 64, seed=34, device=device)
        s, y, _ = ops.add_rms_norm(*leaves[:2], leaves[2], 1e-6, backend=backend)
        fused = torch.autograd.grad((y, s), leaves, (gy, gs))
        s2 = leaves[0] + leaves[1]
        plain = torch.autograd.grad((ops.rms_norm(s2, leaves[2], 1e-6, backend=backend), s2), leaves, (gy, gs))
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(fused, plain))
    with pytest.raises(ValueError, match="must match"):
        ops.add_rms_norm(x, delta[:, :2], w, backend=backend)


def test_row_ops_that_quantize_pass_the_gradient_of_their_output(device):
    x = _rand(6, 64, seed=23, device=device).requires_grad_(True)
    w = _rand(64, seed=24, device=device, shift=1.0).requires_grad_(True)
    up = _rand(6, 64, seed=25, device=device).requires_grad_(True)
    g = _rand(6, 64, seed=26, device=device)
    for op, args in ((lambda *a, **k: ops.rms_norm(*a, 1e-6, **k), (x, w)), (ops.silu_mul, (x, up))):
        fused = torch.autograd.grad(op(*args, backend="triton", quantize=True)[0], args, g)
        plain = torch.autograd.grad(op(*args, backend="triton"), args, g)
        assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.rms_norm(x[:, :40], w[:40], backend="triton", quantize=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.silu_mul(x[:, :40], up[:, :40], backend="torch", quantize=True)


# ---------------------------------------------------------------------------------------------- RoPE
def _cos_sin(positions, d, dtype):
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d))
    freqs = positions.float().unsqueeze(-1) * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_close_and_batch_invariant(device, dtype):
    b, t, h, d = 9, 5, 3, 16
    x = _rand(b, t, h, d, seed=12, device=device, dtype=dtype).transpose(1, 2)  # the model's q/k: a [B, T, H, D] buffer
    pos = (torch.arange(t, device=device) + 7 * torch.arange(b, device=device).view(-1, 1))
    cos, sin = _cos_sin(pos, d, dtype)
    got = ops.rope(x, cos, sin, backend="triton")
    ref = ops.rope(x, cos, sin, backend="torch")
    assert got.dtype == dtype and got.shape == ref.shape
    # the torch backend rounds both products and the sum: errors of a rounding of the inputs' size
    tol = 2.0**-6 * float(x.abs().max()) if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.float(), ref.float(), rtol=0, atol=tol), (got.float() - ref.float()).abs().max()
    once = reference.rope(x.float(), cos.float(), sin.float()).to(dtype)  # fp32, rounded once
    assert torch.allclose(got.float(), once.float(), rtol=2.0**-8 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    assert torch.equal(ops.rope(x.contiguous(), cos, sin, backend="triton"), got)
    _invariant(lambda a, c, s: ops.rope(a, c, s, backend="triton"), x, cos, sin)
    # one position alone (a decode step) == that position of the prefill
    assert torch.equal(ops.rope(x[:, :, 2:3], cos[:, :, 2:3], sin[:, :, 2:3], backend="triton"), got[:, :, 2:3])
    # cos/sin shared by the batch
    c1, s1 = _cos_sin(pos[:1], d, dtype)
    assert torch.equal(ops.rope(x, c1, s1, backend="triton"),
                       ops.rope(x, c1.expand(b, -1, -1, -1), s1.expand(b, -1, -1, -1), backend="triton"))


def test_rope_gradient_close_to_fp32_autograd(device):
    b, t, h, d = 2, 6, 3, 20  # half of D not a power of two
    x = _rand(b, h, t, d, seed=13, device=device).requires_grad_(True)
    cos, sin = _cos_sin(torch.arange(t, device=device).expand(b, t) + 3, d, torch.float32)
    g = _rand(b, h, t, d, seed=14, device=device)
    (got,) = torch.autograd.grad(ops.rope(x, cos, sin, backend="triton"), x, g)
    (ref,) = torch.autograd.grad(reference.rope(x, cos, sin), x, g)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6), (got - ref).abs().max()


# --------------------------------------------------------------------------- token-logprob backward
def _old_backward(g, logits, tokens, temperature):
    """The torch formula the kernel replaced."""
    z = logits.float()
    if temperature != 1.0:
        z = z / torch.full_like(z, temperature)
    lse = torch.logsumexp(z, -1)
    grad = -g.unsqueeze(-1) * torch.exp(z - lse.unsqueeze(-1))
    grad.scatter_add_(-1, tokens.unsqueeze(-1), g.unsqueeze(-1))
    if temperature != 1.0:
        grad = grad / temperature
    return grad


@pytest.mark.parametrize("t", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprob_backward_kernel(device, t, dtype):
    r, v = 7, 301
    x = _rand(r, v, seed=15, device=device, dtype=dtype, scale=4.0)
    tok = torch.randint(0, v, (r,), generator=torch.Generator().manual_seed(1)).to(device)
    # bf16 logits in: the bits of their fp32 copy (the learner need not make one)
    lp = ops.token_logprobs(x, tok, t, backend="triton")
    assert torch.equal(lp, ops.token_logprobs(x.float(), tok, t, backend="triton"))
    assert torch.equal(ops.token_logprobs(x[3:4], tok[3:4], t, backend="triton"), lp[3:4])
    xr = x.clone().requires_grad_(True)
    g = _rand(r, seed=16, device=device)
    (got,) = torch.autograd.grad(ops.token_logprobs(xr, tok, t, backend="triton"), xr, g)
    assert got.dtype == dtype
    old = _old_backward(g, x, tok, t)
    if dtype == torch.float32:
        assert torch.allclose(got, old, rtol=1e-5, atol=1e-6), (got - old).abs().max()
    else:
        assert torch.equal(got, old.to(dtype)) or torch.allclose(got.float(), old, rtol=BF16_TOL, atol=1e-6)
    # batch-invariant too
    (one,) = torch.autograd.grad(ops.token_logprobs(xr[3:4], tok[3:4], t, backend="triton"), xr, g[3:4])
    assert torch.equal(one[3:4], got[3:4])


# ---------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise(device):
    x = _rand(3, 16, seed=17, device=device)
    with pytest.raises(ValueError, match="rms_norm weight"):
        ops.rms_norm(x, torch.ones(8, device=device), backend="triton")
    with pytest.raises(ValueError, match="differ in shape"):
        ops.silu_mul(x, x[:, :8], backend="triton")
    q = _rand(1, 2, 3, 16, seed=18, device=device)
    cos, sin = _cos_sin(torch.arange(3, device=device).view(1, 3), 16, torch.float32)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="even D"):
            ops.rope(q[..., :15], cos[..., :15], sin[..., :15], backend=backend)
        with pytest.raises(ValueError, match="rope cos"):
            ops.rope(q, cos[:, :, :2], sin, backend=backend)
        with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
            ops.rope(q[0], cos, sin, backend=backend)


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors without the interpreter")
def test_triton_backend_refuses_cpu_tensors_without_interpreter(monkeypatch):
    from minite_core.kernels import gemm

    monkeypatch.setattr(gemm, "_INTERPRET", False)  # (TRITON_INTERPRET is read once, at import)
    x = torch.ones(2, 16)
    cos = torch.ones(1, 1, 2, 16)
    with pytest.raises(ValueError, match="CUDA"):
        ops.rms_norm(x, torch.ones(16), backend="triton")
    with pytest.raises(ValueError, match="CUDA"):
        ops.silu_mul(x, x, backend="triton")
    with pytest.raises(ValueError, match="CUDA"):
        ops.rope(x.view(1, 1, 2, 16), cos, cos, backend="triton")


# -------------------------------------------------------------------------------------------- model
def _tiny_model(device, backend):
    from minite_core.model.qwen3 import Qwen3, Qwen3Config

    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=80, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)
    w = {}
    for name, shape in cfg.expected_shapes().items():
        t = 1.0 + 0.1 * torch.randn(shape, generator=g) if name.endswith("norm.weight") else 0.1 * torch.randn(shape, generator=g)
        w[name] = t.to(device=device, dtype=torch.bfloat16)
    return Qwen3(cfg, w, dtype=torch.bfloat16, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_model_logits_dtype_and_check_ids(device, backend):
    model = _tiny_model(device, backend)
    ids = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(2)).to(device)
    full = model.forward(ids)
    low = model.forward(ids, logits_dtype=torch.bfloat16, check_ids=False)
    assert full.dtype == torch.float32 and low.dtype == torch.bfloat16
    assert torch.equal(low.float(), full)
    tok = ids.roll(-1, 1)
    assert torch.equal(ops.token_logprobs(low, tok, 0.9, backend=backend), ops.token_logprobs(full, tok, 0.9, backend=backend))
    with pytest.raises(ValueError, match="token ids"):
        model.forward(ids + 300)
    # a row alone == that row in the batch, through the whole model
    assert torch.equal(model.forward(ids[1:2]), full[1:2])

