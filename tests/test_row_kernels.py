"""The Triton attention and log-sum-exp kernels (on the CPU under TRITON_INTERPRET=1, on the GPU when
there is one): decode over a KV cache == prefill, bit for bit; independent of batch mates; close to the
torch reference, SDPA and torch.log_softmax; gradients close to the fp32 autograd ones."""
import pytest
import torch

from minite_core import ops

pytestmark = pytest.mark.skipif(pytest.importorskip("triton") is None, reason="triton")


def _rand(*shape, seed, device, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 1.5).to(device=device, dtype=dtype)


def _cfg():
    from minite_core.kernels.attention import attention_config

    return attention_config()


@pytest.mark.interpreter
@pytest.mark.parametrize("t", [5, 37])
def test_decode_equals_prefill_bitwise(device, t):
    bm, bn = _cfg()
    b, hq, hkv, d = 2, 4, 2, 16
    q = _rand(b, hq, t, d, seed=1, device=device)
    k = _rand(b, hkv, t, d, seed=2, device=device)
    v = _rand(b, hkv, t, d, seed=3, device=device)
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    full = ops.attention(q, k, v, pos, torch.full((b,), t, device=device), backend="triton")
    cap = t + 2 * bn + 3  # a cache longer than the valid part, stale values beyond it
    kc = _rand(b, hkv, cap, d, seed=4, device=device)
    vc = _rand(b, hkv, cap, d, seed=5, device=device)
    kc[:, :, :t], vc[:, :, :t] = k, v
    for p in sorted({0, 1, t // 2, t - 1}):
        one = ops.attention(q[:, :, p:p + 1], kc, vc, torch.full((b, 1), p, device=device),
                            torch.full((b,), p + 1, device=device), backend="triton")
        assert torch.equal(one, full[:, :, p:p + 1]), p


@pytest.mark.interpreter
def test_batch_invariant_and_close_to_reference(device):
    b, hq, hkv, t, d = 3, 4, 1, 21, 16
    q, k, v = (_rand(b, h, t, d, seed=s, device=device) for s, h in ((6, hq), (7, hkv), (8, hkv)))
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    lens = torch.tensor([t, 9, 14], device=device)  # right-padded batch mates
    got = ops.attention(q, k, v, pos, lens, backend="triton")
    alone = ops.attention(q[1:2, :, :9], k[1:2, :, :9], v[1:2, :, :9], pos[1:2, :9], lens[1:2], backend="triton")
    assert torch.equal(alone, got[1:2, :, :9])
    ref = ops.attention(q.float(), k.float(), v.float(), pos, lens, backend="torch")
    # bf16 probabilities in p@v on the GPU; fp32 throughout under the interpreter
    tol = 2e-2 if device == "cuda" else 1e-5
    for i, n in enumerate(lens.tolist()):
        assert torch.allclose(got[i, :, :n], ref[i, :, :n], rtol=tol, atol=tol), (got[i, :, :n] - ref[i, :, :n]).abs().max()


@pytest.mark.interpreter
def test_gradient_close_to_fp32_autograd(device):
    b, hq, hkv, t, d = 1, 2, 1, 11, 16
    q, k, v = (_rand(b, h, t, d, seed=s, device=device, dtype=torch.float32).requires_grad_(True)
               for s, h in ((9, hq), (10, hkv), (11, hkv)))
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    lens = torch.full((b,), t, device=device)
    g = _rand(b, hq, t, d, seed=12, device=device, dtype=torch.float32)
    got = torch.autograd.grad(ops.attention(q, k, v, pos, lens, backend="triton"), (q, k, v), g)
    ref = torch.autograd.grad(ops.attention(q, k, v, pos, lens, backend="torch"), (q, k, v), g)
    for a, r in zip(got, ref):
        assert torch.allclose(a, r, rtol=1e-4, atol=1e-4), (a - r).abs().max()


@pytest.mark.interpreter
def test_bad_head_dim(device):
    q = torch.zeros(1, 1, 2, 24, device=device)
    with pytest.raises(ValueError, match="head_dim"):
        ops.attention(q, q, q, torch.zeros(1, 2, dtype=torch.long, device=device), torch.ones(1, dtype=torch.long, device=device),
                      backend="triton")


@pytest.mark.interpreter
@pytest.mark.parametrize("t", [1.0, 0.7])
def test_logsoftmax_kernel_invariant_fused_equal_and_close(device, t):
    """The Triton log-sum-exp: one row alone == that row in a batch; the fused token logprob == the full
    log-softmax at the token (what rollout and learner compare); close to torch; gradient close."""
    v = 301  # not a multiple of the block
    x = _rand(9, v, seed=13, device=device, dtype=torch.float32) * 4
    tok = torch.randint(0, v, (9,), generator=torch.Generator().manual_seed(0)).to(device)
    full = ops.log_softmax(x, t, backend="triton")
    assert torch.equal(ops.log_softmax(x[4:5], t, backend="triton"), full[4:5])
    fused = ops.token_logprobs(x, tok, t, backend="triton")
    assert torch.equal(fused, full.gather(-1, tok.unsqueeze(-1)).squeeze(-1))
    assert torch.equal(ops.token_logprobs(x[2:3], tok[2:3], t, backend="triton"), fused[2:3])
    assert torch.allclose(full, torch.log_softmax(x / t, -1), rtol=1e-5, atol=1e-5)
    xr = x.clone().requires_grad_(True)
    g = _rand(9, seed=14, device=device, dtype=torch.float32)
    (got,) = torch.autograd.grad(ops.token_logprobs(xr, tok, t, backend="triton"), xr, g)
    (ref,) = torch.autograd.grad(torch.log_softmax(xr / t, -1).gather(-1, tok.unsqueeze(-1)).squeeze(-1), xr, g)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
