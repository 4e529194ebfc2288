"""Batched sampling: the Triton kernel against the torch reference, the distribution it draws from, and
its independence from the batch."""
import math

import pytest
import torch

from minite_core.engine.sampler import mix32, noise_key, sample_batch, sample_reference, seed_key, uniform_reference

from tests.backends import backend_params


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_mix32_matches_uint32_arithmetic():
    # lowbias32 written with wrapping uint32 arithmetic in plain Python, against the int64-safe version
    def ref(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    g = torch.Generator().manual_seed(0)
    xs = torch.randint(0, 2**32, (1000,), generator=g, dtype=torch.int64)
    xs = torch.cat([xs, torch.tensor([0, 1, 2**31, 2**32 - 1])])
    assert mix32(xs).tolist() == [ref(int(x)) for x in xs]
    assert noise_key(seed_key(5), 3) != noise_key(seed_key(5), 4) != noise_key(seed_key(6), 3)
    assert seed_key(2**62 + 1) != seed_key(1)


def test_kernel_uniforms_equal_reference_bitwise():
    from minite_core.kernels.sample import uniform_triton

    keys = torch.tensor([noise_key(seed_key(s), i) for s in (0, 1, 2**62 + 7) for i in (0, 1, 1000)], device=_device())
    u = uniform_triton(keys, 333)
    ref = uniform_reference(keys, 333)
    assert torch.equal(u, ref)
    assert float(u.min()) > 0 and float(u.max()) < 1


def _rows(n, temp=1.0, top_k=0, top_p=1.0, seed=0):
    return [(temp, top_k, top_p, seed_key(seed + i), 7) for i in range(n)]


def test_kernel_tokens_equal_reference():
    from minite_core.kernels.sample import sample_triton

    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 301, generator=g) * 3).to(_device())
    keys = torch.tensor([seed_key(i) for i in range(9)], device=_device())
    counters = torch.arange(9, device=_device()) * 3
    temp = torch.tensor([1.0, 0.7, 2.0] * 3, device=_device())
    thr = torch.full((9,), float("-inf"), device=_device())
    thr[4] = float(logits[4].sort(descending=True).values[5] / 0.7)  # top-6 on row 4
    greedy = torch.tensor([False] * 8 + [True], device=_device())
    a = sample_triton(logits, keys, counters, temp, thr, greedy)
    b = sample_reference(logits, keys, counters, temp, thr, greedy)
    assert torch.equal(a, b)
    assert int(a[8]) == int(torch.argmax(logits[8]))
    assert float(logits[4, a[4]] / 0.7) >= float(thr[4])


@pytest.mark.parametrize("backend", backend_params())
def test_draws_follow_the_softmax(backend):
    # 4000 draws (one per seed) from one small distribution: frequencies within 5 sigma of softmax(z / T)
    z = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, 1.5, -3.0, 0.25] + [-1.0] * 56, device=_device())
    n, t = 4000 if backend == "torch" else 1000, 0.8
    logits = z.expand(n, -1).contiguous()
    tokens, lps = sample_batch(logits, _rows(n, temp=t), backend)
    p = torch.softmax(z.double() / t, 0).cpu()
    counts = torch.bincount(tokens.cpu(), minlength=z.numel()).double()
    sigma = torch.sqrt(n * p * (1 - p))
    assert bool(((counts - n * p).abs() <= 5 * sigma + 1).all()), (counts[:8], n * p[:8])
    # the reported logprob is log_softmax(z / T) at the token
    expect = torch.log_softmax(z.double() / t, 0).cpu()[tokens.cpu()]
    assert torch.allclose(lps.double().cpu(), expect, atol=1e-5)


@pytest.mark.parametrize("backend", backend_params())
def test_a_row_does_not_depend_on_its_batch(backend):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(13, 211, generator=g) * 2).to(_device())
    rows = [(t, k, p, seed_key(i), 3) for i, (t, k, p) in enumerate(
        [(1.0, 0, 1.0), (0.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 20, 0.9)] * 2 + [(1.0, 0, 1.0)] * 3)]
    tok_all, lp_all = sample_batch(logits, rows, backend)
    for i in (0, 1, 2, 3, 4, 12):
        tok, lp = sample_batch(logits[i:i + 1], rows[i:i + 1], backend)
        assert torch.equal(tok, tok_all[i:i + 1]) and torch.equal(lp, lp_all[i:i + 1])
    # same seed and position, same token; another position, (almost surely) other draws
    again, _ = sample_batch(logits, rows, backend)
    assert torch.equal(again, tok_all)


@pytest.mark.parametrize("backend", backend_params())
def test_top_k_and_top_p_restrict_the_draw(backend):
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(150, generator=g) * 2).to(_device())
    n = 400 if backend == "torch" else 120
    logits = z.expand(n, -1).contiguous()
    tok_k, _ = sample_batch(logits, _rows(n, top_k=4), backend)
    assert set(tok_k.tolist()) <= set(torch.topk(z, 4).indices.tolist())
    tok_p, lps = sample_batch(logits, _rows(n, top_p=0.5), backend)
    p = torch.softmax(z.double(), 0)
    order = torch.argsort(p, descending=True)
    need = int((torch.cumsum(p[order], 0) < 0.5).sum()) + 1  # the nucleus: smallest prefix with mass >= 0.5
    assert set(tok_p.tolist()) <= set(order[:need].tolist())
    assert len(set(tok_p.tolist())) > 1
    # logprobs stay those of the full distribution
    assert torch.allclose(lps.double(), torch.log(p)[tok_p], atol=1e-5)


@pytest.mark.parametrize("backend", backend_params())
def test_greedy_ties_take_the_smallest_id(backend):
    logits = torch.zeros(3, 100, device=_device())
    logits[:, [17, 40, 99]] = 5.0
    tok, lp = sample_batch(logits, [(0.0, 0, 1.0, 1, 0), (0.0, 0, 1.0, 2, 0), (0.0, 0, 1.0, 3, 0)], backend)
    assert tok.tolist() == [17, 17, 17]
    assert math.isclose(float(lp[0]), 5.0 - math.log(3 * math.exp(5.0) + 97), abs_tol=1e-5)


@pytest.mark.parametrize("backend", backend_params())
def test_top_alternatives_of_mixed_requests_equal_one_row_at_a_time(backend, monkeypatch):
    """`top_alternatives` groups the rows by (count, temperature) and scores a group in one call, a few rows at a
    time: each row's alternatives are its own most likely tokens (ties: the smaller id first) with the logprob
    `ops.token_logprobs` gives that token alone on that row, bit for bit."""
    from types import SimpleNamespace

    from minite_core import ops
    from minite_core.engine import sampler

    monkeypatch.setattr(sampler, "ALTERNATIVES_ELEMENTS", 3 * 4 * 50)  # groups in parts of 3 rows (k = 4)
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(9, 50, generator=g) * 3).to(torch.bfloat16).to(_device())
    logits[4, 7] = logits[4, 9] = logits[4].max() + 1  # a tie at the top: 7 before 9
    params = [SimpleNamespace(logprobs=k, temperature=t) for k, t in
              [(4, 1.0), (2, 0.7), (4, 1.0), (0, 1.0), (4, 0.0), (4, 1.0), (4, 1.0), (20, 1.3), (4, 1.0)]]
    rows = [8, 0, 1, 2, 4, 5, 6, 7, 3]
    got = sampler.top_alternatives(logits, rows, params, backend)
    for r, p, alts in zip(rows, params, got):
        t = p.temperature if p.temperature > 0 else 1.0
        order = sorted(range(50), key=lambda i: (-logits[r, i].item(), i))[:p.logprobs]
        assert [i for i, _ in alts] == order, r
        for i, lp in alts:
            one = ops.token_logprobs(logits[r:r + 1], torch.tensor([i], device=logits.device), t, backend=backend)
            assert lp == one.item(), (r, i)
    assert [i for i, _ in got[4]][:2] == [7, 9] and got[3] == []
