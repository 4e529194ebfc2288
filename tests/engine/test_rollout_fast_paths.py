"""The rollout engine's fast paths change no bit: batched prefill (right-padded, mixed prompt lengths)
and CUDA-graph decode (padded batch buckets, weights copied in place on a sync, each step launched before
the host reads the last one's tokens) give the tokens and logprobs of the plain path, and those equal the
learner's."""
import pytest
import torch
from tests.backends import DEVICE, HAS_CUDA, HAS_TRITON
from tests.helpers_hf import save_hf_checkpoint

from minite_core.engine import Learner, RolloutEngine, SamplingParams
from minite_core.engine.graphs import buckets, clone_weights, copy_weights_, graph_capturable, length_bucket, pad_prefill
from minite_core.model import load_model
from minite_core.model.qwen3 import KVCache

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf_checkpoint(tmp_path_factory.mktemp("dense"))


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (k,), generator=g).tolist() for k in torch.randint(1, 30, (n,), generator=g).tolist()]


def _key(outs):
    return [(o.token_ids, o.logprobs.tolist()) for o in outs]


def test_batched_prefill_equals_one_at_a_time(ckpt):
    model = load_model(ckpt, precision="nvfp4", device=DEVICE)
    prompts = _prompts(7)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=11)
    together = RolloutEngine(model, max_slots=7, max_seq_len=48, cuda_graphs=False).generate(prompts, params)
    alone = [RolloutEngine(model, max_slots=1, max_seq_len=48, cuda_graphs=False).generate([p], params)[0] for p in prompts]
    for a, b in zip(together, alone):  # the seed of request r is derived from (seed, sample index), not r
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
    # a prefill chunked by the token budget gives the same bits too
    small = RolloutEngine(model, max_slots=7, max_seq_len=48, cuda_graphs=False)
    small.PREFILL_TOKENS = 40
    assert _key(small.generate(prompts, params)) == _key(together)


def test_graph_weight_copy_checks_the_layout(ckpt):
    model = load_model(ckpt, precision="nvfp4", device=DEVICE)
    w = clone_weights(model.w)
    assert all(w[n] is not model.w[n] for n in w)
    copy_weights_(w, model.w)
    missing = dict(model.w)
    missing.pop("model.norm.weight")
    with pytest.raises(ValueError, match="names"):
        copy_weights_(w, missing)
    plain = load_model(ckpt, precision="bf16", device=DEVICE)
    with pytest.raises(ValueError, match="format or shape"):
        copy_weights_(w, plain.w)
    assert buckets(1) == [1] and buckets(6) == [1, 2, 4, 6] and buckets(8) == [1, 2, 4, 8]


def test_length_buckets_pad_at_most_15_positions_or_a_quarter():
    for t in range(1, 3000):
        n = length_bucket(t, 4096)
        assert t <= n <= max(t + 15, t + t // 4) and n % 16 == 0, (t, n)
    assert length_bucket(100, 4096) == 112 and length_bucket(129, 4096) == 160 and length_bucket(1000, 4096) == 1024
    assert length_bucket(40, 45) == 45  # (never past the cache's positions)
    assert len({length_bucket(t, 4096) for t in range(129, 257)}) == 4


def test_a_padded_prefill_changes_no_bit_of_its_rows(ckpt):
    """What a prefill graph runs: the group padded to more rows (token 0 into the scratch cache row) and more
    positions (token 0 past every prompt) gives each real row the logits at its last prompt position and the cache
    entries of its prompt, bit for bit."""
    model = load_model(ckpt, precision="nvfp4", device=DEVICE)
    lengths = [5, 9, 13]
    g = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.cat([torch.randint(0, 96, (n,), generator=g), torch.zeros(13 - n, dtype=torch.long)])
                       for n in lengths]).to(DEVICE)
    slots = torch.tensor([2, 0, 3], device=DEVICE)
    last = torch.tensor([n - 1 for n in lengths], device=DEVICE)
    caches = [KVCache(model.cfg, 6, 40, model.dtype, DEVICE) for _ in range(2)]
    with torch.no_grad():
        plain = model(ids, torch.arange(13, device=DEVICE).expand(3, 13), caches[0], slots, check_ids=False,
                      logits_at=last, logits_dtype=model.dtype)[:, 0]
        p_ids, p_pos, p_slots, p_last = pad_prefill(ids, slots, last, 4, length_bucket(13, 40), scratch=5)
        assert p_ids.shape == (4, 16) and p_slots.tolist() == [2, 0, 3, 5] and p_last.tolist() == [4, 8, 12, 0]
        padded = model(p_ids, p_pos, caches[1], p_slots, check_ids=False, logits_at=p_last, logits_dtype=model.dtype)
    assert torch.equal(padded[:3, 0], plain)
    for layer in range(model.cfg.num_hidden_layers):
        for kv in ("k", "v"):
            a, b = getattr(caches[0], kv)[layer], getattr(caches[1], kv)[layer]
            for slot, n in zip(slots.tolist(), lengths):
                assert torch.equal(a[slot, :, :n], b[slot, :, :n])


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU error")
def test_cuda_graphs_need_cuda(ckpt):
    with pytest.raises(ValueError, match="CUDA"):
        RolloutEngine(load_model(ckpt, precision="nvfp4"), cuda_graphs=True)
    with pytest.raises(ValueError, match="prefill_graphs needs the decode's CUDA graphs"):
        RolloutEngine(load_model(ckpt, precision="nvfp4"), prefill_graphs=True)


def test_moe_graphs_only_on_the_grouped_path(tmp_path, ckpt):
    """The per-expert MoE loop sizes its work on the host: not capturable, so no graphs by default (and a
    clear error when asked for); the dense model and the grouped (Triton, NVFP4) MoE path are capturable."""
    moe = save_hf_checkpoint(tmp_path / "moe", moe=True)
    assert graph_capturable(load_model(ckpt, precision="bf16"))
    assert not graph_capturable(load_model(moe, precision="bf16"))
    assert not graph_capturable(load_model(moe, precision="nvfp4", backend="torch"))
    if HAS_TRITON:
        assert graph_capturable(load_model(moe, precision="nvfp4", backend="triton"))
    if HAS_CUDA:
        model = load_model(moe, precision="bf16", device="cuda")
        assert RolloutEngine(model, max_slots=2).graphs is None
        with pytest.raises(ValueError, match="per-expert loop"):
            RolloutEngine(model, max_slots=2, cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_graph_decode_equals_eager_and_survives_a_weight_sync(ckpt, precision):
    model = load_model(ckpt, precision=precision, backend="triton", device="cuda")
    prompts = _prompts(11, seed=3)
    params = [SamplingParams(max_tokens=4 + i % 9, temperature=[1.0, 0.0, 0.7][i % 3], seed=i) for i in range(11)]
    eager = RolloutEngine(model, max_slots=6, max_seq_len=48, cuda_graphs=False, overlap=False).generate(prompts, params)
    graphed_engine = RolloutEngine(model, max_slots=6, max_seq_len=48, cuda_graphs=True)  # (overlapped: the default)
    assert graphed_engine.overlap
    graphed = graphed_engine.generate(prompts, params)  # batches of 6, 5, 3, ... run in buckets 6, 4, ...
    assert _key(graphed) == _key(eager)
    assert len(graphed_engine.graphs.graphs) >= 2

    # a new version: different weights, copied into the captured buffers; a request submitted before the
    # sync keeps its version (eager), the ones after use the graphs with the new values
    old_w, new_w = model.w, dict(model.w)
    for name in new_w:
        if name.endswith("norm.weight"):
            new_w[name] = new_w[name] * 1.01
    old_req = graphed_engine.submit(prompts[0], SamplingParams(max_tokens=12, seed=5))
    graphed_engine.step()
    graphed_engine.set_weights(new_w, version=1)
    new_reqs = [graphed_engine.submit(p, SamplingParams(max_tokens=6, seed=7)) for p in prompts[:4]]
    while graphed_engine.busy:
        graphed_engine.step()
    old_model = load_model(ckpt, precision=precision, backend="triton", device="cuda")
    old_model.w = old_w
    old = Learner(old_model)
    assert torch.equal(old_req.completions()[0].logprobs, old.logprobs(prompts[0], old_req.seqs[0].tokens).cpu())
    new_model = load_model(ckpt, precision=precision, backend="triton", device="cuda")
    new_model.w = new_w
    learner = Learner(new_model)
    for r in new_reqs:
        c = r.completions()[0]
        assert c.weight_version == 1
        assert torch.equal(c.logprobs, learner.logprobs(c.prompt_ids, c.token_ids).cpu())
        assert not torch.equal(c.logprobs, old.logprobs(c.prompt_ids, c.token_ids).cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_prefill_graphs_equal_the_eager_prefill(ckpt, precision):
    """Prefills replayed from the graphs of their (rows, length) buckets: the tokens and logprobs of eager
    prefills, and the learner's; groups of several sizes and lengths, so several buckets."""
    model = load_model(ckpt, precision=precision, backend="triton", device="cuda")
    prompts = _prompts(13, seed=5)
    params = [SamplingParams(max_tokens=3 + i % 5, temperature=[1.0, 0.0][i % 2], seed=i) for i in range(13)]
    eager = RolloutEngine(model, max_slots=5, max_seq_len=48, prefill_graphs=False).generate(prompts, params)
    engine = RolloutEngine(model, max_slots=5, max_seq_len=48, prefill_graphs=True)
    graphed = engine.generate(prompts, params)
    assert _key(graphed) == _key(eager)
    assert len(engine.graphs.prefills) >= 2
    learner = Learner(model)
    for c in graphed:
        assert torch.equal(c.logprobs, learner.logprobs(c.prompt_ids, c.token_ids).cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="CUDA graphs need a GPU")
def test_prefills_beyond_the_graph_bound_run_eagerly(ckpt, monkeypatch):
    """rollout.PREFILL_GRAPH_TOKENS: a prefill whose bucket holds more padded tokens runs eagerly (no graph kept for
    it), the others replay graphs; the tokens and logprobs of eager prefills either way."""
    from minite_core.engine import rollout

    model = load_model(ckpt, precision="nvfp4", backend="triton", device="cuda")
    prompts = _prompts(13, seed=5)
    params = [SamplingParams(max_tokens=3 + i % 5, temperature=1.0, seed=i) for i in range(13)]
    eager = RolloutEngine(model, max_slots=5, max_seq_len=48, prefill_graphs=False).generate(prompts, params)
    monkeypatch.setattr(rollout, "PREFILL_GRAPH_TOKENS", 32)
    engine = RolloutEngine(model, max_slots=5, max_seq_len=48, prefill_graphs=True)
    assert _key(engine.generate(prompts, params)) == _key(eager)
    assert all(rows * length <= 32 for rows, length in engine.graphs.prefills), engine.graphs.prefills
