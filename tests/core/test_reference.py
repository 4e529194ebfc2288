"""The row-local ops of the torch backend (fixed-order sums, RMSNorm, SiLU*up, log-softmax, attention):
bit-for-bit independent of batch mates and of decode vs prefill, and close to the library versions."""
import torch
import torch.nn.functional as F

from minite_core.reduce import tree_sum
from minite_core.reference import attention, log_softmax, rms_norm, silu_mul


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_tree_sum_ignores_trailing_zeros_and_batch():
    x = _x(7, 37)
    s = tree_sum(x)
    assert torch.equal(tree_sum(torch.cat([x, torch.zeros(7, 27)], 1)), s)
    assert torch.equal(tree_sum(x[3:4]), s[3:4])
    assert torch.allclose(s.double(), x.double().sum(-1), rtol=1e-5, atol=1e-5)


def test_elementwise_composites_are_position_invariant():
    """An element must get the same bits in any position of any tensor (SIMD lane or remainder)."""
    g, u, w = _x(1000, 33, seed=1), _x(1000, 33, seed=2), _x(33, seed=3)
    full_silu = silu_mul(g, u)
    full_lsm = log_softmax(g, 0.7)
    for i in range(0, 1000, 97):
        assert torch.equal(silu_mul(g[i:i + 1, 5:6], u[i:i + 1, 5:6]), full_silu[i:i + 1, 5:6])
        assert torch.equal(silu_mul(g[i:i + 1], u[i:i + 1]), full_silu[i:i + 1])
        assert torch.equal(log_softmax(g[i:i + 1], 0.7), full_lsm[i:i + 1])
    x = _x(500, 64, seed=4)
    full = rms_norm(x, w.repeat(2)[:64], 1e-6)
    assert all(torch.equal(rms_norm(x[i:i + 1], w.repeat(2)[:64], 1e-6), full[i:i + 1]) for i in range(0, 500, 37))


def test_row_ops_match_the_library():
    x, w = _x(9, 64, seed=5), _x(64, seed=6)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(rms_norm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-5)
    g, u = _x(9, 64, seed=7), _x(9, 64, seed=8)
    assert torch.allclose(silu_mul(g, u), F.silu(g) * u, rtol=1e-5, atol=1e-5)
    assert torch.allclose(log_softmax(g, 0.5), torch.log_softmax(g / 0.5, -1), rtol=1e-5, atol=1e-5)
    assert torch.allclose(torch.exp(log_softmax(g)).sum(-1), torch.ones(9), atol=1e-5)


def _qkv(b, hq, hkv, t, d, seed):
    return _x(b, hq, t, d, seed=seed), _x(b, hkv, t, d, seed=seed + 1), _x(b, hkv, t, d, seed=seed + 2)


def test_attention_matches_sdpa_with_gqa():
    q, k, v = _qkv(2, 4, 2, 13, 16, 10)
    pos = torch.arange(13).expand(2, 13)
    out = attention(q, k, v, pos, torch.tensor([13, 13]), 16**-0.5)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_attention_decode_equals_prefill_bitwise():
    """Row t of a causal prefill == a decode step at position t over a KV cache of any capacity,
    whatever the cache holds beyond its valid part, alone or batched with other sequences."""
    t_total, d = 21, 16
    q, k, v = _qkv(1, 4, 2, t_total, d, 20)
    pos = torch.arange(t_total).view(1, -1)
    prefill = attention(q, k, v, pos, torch.tensor([t_total]), d**-0.5)
    for cap in (t_total, 32, 50):
        kc = torch.full((3, 2, cap, d), float("nan"))  # garbage beyond the valid part
        vc = torch.full((3, 2, cap, d), float("nan"))
        kc[0, :, :t_total], vc[0, :, :t_total] = k[0], v[0]
        other_q, other_k, other_v = _qkv(2, 4, 2, cap, d, 30)
        kc[1:], vc[1:] = other_k, other_v
        for t in range(t_total):
            qs = torch.cat([q[:, :, t:t + 1], other_q[:, :, :1]])  # a batch of decode steps
            qpos = torch.tensor([[t], [5], [cap - 1]])
            kv_len = torch.tensor([t + 1, 6, cap])
            out = attention(qs, kc, vc, qpos, kv_len, d**-0.5)
            assert torch.equal(out[0, :, 0], prefill[0, :, t]), (cap, t)
