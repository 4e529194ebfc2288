"""The q/k RMSNorm + RoPE (+ KV-cache write) kernel (`kernels/qk_norm_rope.py`), on the CPU under
TRITON_INTERPRET=1 and on the GPU when there is one: the norm and rope ops in sequence (bit for bit under
the interpreter, within a bf16 rounding on the GPU), batch-invariant, the cache rows written and nothing
else, gradients those of the two ops."""
import pytest
import torch
from tests.backends import HAS_CUDA

from minite_core import ops

pytestmark = [pytest.mark.skipif(pytest.importorskip("triton") is None, reason="triton"),
              pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter]


def _rand(*shape, seed, device, dtype=torch.float32, scale=1.5, shift=0.0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale + shift
    return x.to(device=device, dtype=dtype)


def _cos_sin(positions, d, dtype):
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d))
    emb = torch.cat((positions.float().unsqueeze(-1) * inv,) * 2, dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def _heads_case(device, b=2, t=5, hq=4, hkv=2, d=16, seed=60):
    q = _rand(b, t, hq, d, seed=seed, device=device, dtype=torch.bfloat16, scale=3.0)
    k = _rand(b, t, hkv, d, seed=seed + 1, device=device, dtype=torch.bfloat16)
    v = _rand(b, t, hkv, d, seed=seed + 2, device=device, dtype=torch.bfloat16)
    wq = _rand(d, seed=seed + 3, device=device, dtype=torch.bfloat16, shift=1.0)
    wk = _rand(d, seed=seed + 4, device=device, dtype=torch.bfloat16, shift=1.0)
    pos = torch.arange(3, 3 + t, device=device).expand(b, t).contiguous()
    cos, sin = _cos_sin(pos, d, torch.bfloat16)
    return q, k, v, wq, wk, pos, cos, sin


def _same(a, b):
    """Bit for bit under the interpreter (the same arithmetic as the norm and rope kernels); on the GPU the
    sum of squares may take another order in the fused kernel: within a rounding or two of bf16."""
    if HAS_CUDA:
        return torch.allclose(a.float(), b.float(), rtol=2.0**-6, atol=1e-3)
    return torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_qk_norm_rope_is_the_norm_then_rope(device, backend):
    q, k, v, wq, wk, pos, cos, sin = _heads_case(device)
    out = ops.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin, backend=backend, norm_out=True)
    qn, kn = ops.rms_norm(q, wq, backend=backend), ops.rms_norm(k, wk, backend=backend)
    qr, kr = ops.rope(qn.transpose(1, 2), cos, sin, backend=backend), ops.rope(kn.transpose(1, 2), cos, sin, backend=backend)
    for got, want in ((out.q_norm, qn), (out.k_norm, kn), (out.q, qr), (out.k, kr)):
        assert got.shape == want.shape and _same(got, want)
    assert torch.equal(out.v, v.transpose(1, 2))
    assert out.q.transpose(1, 2).is_contiguous()  # [B, T, H, D] buffers seen as [B, H, T, D]
    # batch-invariant: one token alone, and a slice of tokens, give the bits of the whole batch
    for lo, hi, tt in ((1, 2, slice(2, 3)), (0, 2, slice(1, 4))):
        part = ops.qk_norm_rope(q[lo:hi, tt], k[lo:hi, tt], v[lo:hi, tt], wq, wk, 1e-6, cos[lo:hi, :, tt], sin[lo:hi, :, tt],
                                backend=backend)
        assert torch.equal(part.q, out.q[lo:hi, :, tt]) and torch.equal(part.k, out.k[lo:hi, :, tt])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_qk_norm_rope_writes_the_kv_cache_rows(device, backend):
    """Into a slot cache: k' and v at (slot of each sequence, its positions); every other cache entry untouched;
    q as without the cache."""
    q, k, v, wq, wk, pos, cos, sin = _heads_case(device, seed=70)
    b, t, hkv, d = k.shape
    kc = _rand(4, hkv, 12, d, seed=75, device=device, dtype=torch.bfloat16)
    vc = _rand(4, hkv, 12, d, seed=76, device=device, dtype=torch.bfloat16)
    k0, v0 = kc.clone(), vc.clone()
    slots = torch.tensor([3, 1], device=device)
    ref = ops.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin, backend=backend)
    out = ops.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin, backend=backend, cache=(kc, vc, slots, pos))
    assert out.k is None and out.v is None and torch.equal(out.q, ref.q)
    rows = slots.view(-1, 1).expand(b, t)
    assert torch.equal(kc[rows, :, pos], ref.k.transpose(1, 2)) and torch.equal(vc[rows, :, pos], v)
    kc[rows, :, pos], vc[rows, :, pos] = k0[rows, :, pos], v0[rows, :, pos]
    assert torch.equal(kc, k0) and torch.equal(vc, v0)


def test_qk_norm_rope_gradient_is_the_norm_and_rope_gradient(device):
    q, k, v, wq, wk, pos, cos, sin = _heads_case(device, seed=80)
    leaves = [z.float().requires_grad_(True) for z in (q, k, wq, wk)]
    gq = _rand(*q.transpose(1, 2).shape, seed=85, device=device)
    gk = _rand(*k.transpose(1, 2).shape, seed=86, device=device)
    out = ops.qk_norm_rope(leaves[0], leaves[1], v.float(), leaves[2], leaves[3], 1e-6, cos.float(), sin.float(), backend="triton")
    fused = torch.autograd.grad((out.q, out.k), leaves, (gq, gk))
    qr = ops.rope(ops.rms_norm(leaves[0], leaves[2], backend="triton").transpose(1, 2), cos.float(), sin.float(), backend="triton")
    kr = ops.rope(ops.rms_norm(leaves[1], leaves[3], backend="triton").transpose(1, 2), cos.float(), sin.float(), backend="triton")
    plain = torch.autograd.grad((qr, kr), leaves, (gq, gk))
    for a, r in zip(fused, plain):
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-5), (a - r).abs().max()
    with pytest.raises(ValueError, match="inference"):
        kc = torch.zeros(2, 2, 12, 16, device=device)
        ops.qk_norm_rope(leaves[0], leaves[1], v.float(), leaves[2], leaves[3], 1e-6, cos.float(), sin.float(),
                         backend="triton", cache=(kc, kc.clone(), torch.tensor([0, 1], device=device), pos))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_qk_norm_rope_refuses_shapes_it_would_read_past(device, backend):
    q, k, v, wq, wk, pos, cos, sin = _heads_case(device, seed=90)
    kc = torch.zeros(4, 2, 12, 16, device=device, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1], device=device)
    bad = [dict(cos=cos[..., :8]), dict(sin=sin[:, :, :2]), dict(cache=(kc[:, :1], kc[:, :1], slots, pos)),
           dict(cache=(kc, kc, slots[:1], pos)), dict(cache=(kc, kc, slots, pos[:, :2]))]
    for change in bad:
        args = dict(cos=cos, sin=sin, cache=None) | change
        with pytest.raises(ValueError, match="qk_norm_rope"):
            ops.qk_norm_rope(q, k, v, wq, wk, 1e-6, args["cos"], args["sin"], backend=backend, cache=args["cache"])
