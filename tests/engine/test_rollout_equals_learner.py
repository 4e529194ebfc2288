"""The consistency contract: the rollout engine's logprobs equal the learner's, bit for bit, under
continuous batching (requests joining mid-flight, mixed lengths, >= 16 at once), for bf16 and NVFP4,
dense and MoE; seeded sampling reproducible whatever the batch mates; bad requests rejected."""
import pytest
import torch
from tests.backends import DEVICE, HAS_CUDA, HAS_TRITON
from tests.helpers_hf import save_hf_checkpoint

from minite_core.engine import Learner, RolloutEngine, SamplingParams
from minite_core.model import load_model

pytest.importorskip("transformers")  # the checkpoints are written by HF itself


@pytest.fixture(scope="module", params=["dense", "moe"])
def ckpt(request, tmp_path_factory):
    return save_hf_checkpoint(tmp_path_factory.mktemp(request.param), moe=request.param == "moe")


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 15, 16, 17, 31, 32, 33] + torch.randint(2, 40, (n,), generator=g).tolist()
    return [torch.randint(0, 96, (k,), generator=g).tolist() for k in lengths[:n]]


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_rollout_logprobs_equal_learner_logprobs(ckpt, precision):
    model = load_model(ckpt, precision=precision, device=DEVICE)
    engine = RolloutEngine(model, max_slots=6, max_seq_len=80)  # 18 sequences through 6 slots: joins mid-flight
    prompts = _prompts(18)
    params = [SamplingParams(max_tokens=8 + i % 7, temperature=[1.0, 0.7, 0.0][i % 3], top_k=[0, 20][i % 2],
                             top_p=[1.0, 0.9][i % 2], seed=i) for i in range(18)]
    outs = engine.generate(prompts, params)
    assert [o.request_index for o in outs] == list(range(18))
    learner = Learner(model)
    for o, p in zip(outs, params):
        assert len(o.token_ids) == p.max_tokens and o.finish_reason == "length"
        lp = learner.logprobs(o.prompt_ids, o.token_ids, p.temperature).cpu()  # (completions hold CPU logprobs)
        assert torch.equal(o.logprobs, lp), (o.request_index, (o.logprobs - lp).abs().max())
    # scoring in a batch gives the same bits as scoring alone
    batched = learner.batch_logprobs([o.prompt_ids for o in outs], [o.token_ids for o in outs], 1.0)
    assert all(torch.equal(b, learner.logprobs(o.prompt_ids, o.token_ids, 1.0)) for b, o in zip(batched, outs))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.interpreter
@pytest.mark.gpu
def test_triton_backend_rollout_equals_learner(ckpt):
    """The same contract with the Triton kernels (interpreter on CPU: a small case; the GPU: larger)."""
    model = load_model(ckpt, precision="nvfp4", backend="triton", device=DEVICE)
    engine = RolloutEngine(model, max_slots=2, max_seq_len=48)
    n, steps = (3, 4) if not HAS_CUDA else (24, 16)
    outs = engine.generate(_prompts(n, seed=4), SamplingParams(max_tokens=steps, temperature=1.0, seed=3))
    learner = Learner(model)
    for o in outs:
        assert torch.equal(o.logprobs, learner.logprobs(o.prompt_ids, o.token_ids).cpu()), o.request_index


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.interpreter
@pytest.mark.gpu
def test_prefill_on_wide_tiles_with_packed_weights_equals_the_learner(tmp_path):
    """A prefill of more rows than the narrow tiles take (the wide tiles) on the rollout's packed weights, which
    carry no decoded form, decoded in the tile (up to WIDE_PACKED_MAX_M rows, the default): the logprobs equal
    the learner's scores of each sequence (fewer rows: the narrow tiles). (Above the bound each weight is decoded
    by a launch per call: the same GEMM bits, tests/core/test_ops.py `test_wide_tiles_on_a_packed_weight_...`.)"""
    from minite_core.kernels import gemm

    # (the dense model: the MoE's experts run the grouped GEMM, which this path does not change)
    model = load_model(save_hf_checkpoint(tmp_path), precision="nvfp4", backend="triton", device=DEVICE)
    length = gemm.SWAP_MAX_M // 4 + 3  # four prompts prefilled together: more rows than SWAP_MAX_M
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 96, (length,), generator=g).tolist() for _ in range(4)]
    assert gemm.WIDE_PACKED_MAX_M is not None and gemm.WIDE_PACKED_MAX_M >= 4 * length  # (the default bound)
    engine = RolloutEngine(model, max_slots=4, max_seq_len=length + 4)
    learner = Learner(model)
    for o in engine.generate(prompts, SamplingParams(max_tokens=2, temperature=1.0, seed=5)):
        assert torch.equal(o.logprobs, learner.logprobs(o.prompt_ids, o.token_ids).cpu()), o.request_index


def test_seeded_request_is_reproducible_alone_or_in_a_batch(ckpt):
    model = load_model(ckpt, precision="nvfp4")
    engine = RolloutEngine(model, max_slots=4, max_seq_len=80)
    prompts = _prompts(9, seed=1)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=123, n=2)
    batch = engine.generate(prompts, params)
    assert len(batch) == 18
    alone = engine.generate([prompts[5]], params)
    mine = [o for o in batch if o.request_index == 5]
    for a, b in zip(alone, mine):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
    assert mine[0].token_ids != mine[1].token_ids  # the n samples differ


def test_stop_tokens_and_context_limit(ckpt):
    model = load_model(ckpt, precision="bf16")
    engine = RolloutEngine(model, max_slots=2, max_seq_len=24)
    greedy = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0))[0]
    stop = greedy.token_ids[3]
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop and len(out.token_ids) == greedy.token_ids.index(stop) + 1
    long = engine.generate([list(range(20))], SamplingParams(max_tokens=50, temperature=0))[0]
    assert long.finish_reason == "length" and len(long.prompt_ids) + len(long.token_ids) == 24
    assert out.weight_version == 0


def test_bad_requests_are_rejected(ckpt):
    model = load_model(ckpt, precision="bf16")
    engine = RolloutEngine(model, max_slots=2, max_seq_len=24)
    for bad, match in [
        (dict(max_tokens=0), "max_tokens"), (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"), (dict(n=0), "n "),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.generate([[1, 2]], SamplingParams(**bad))
    with pytest.raises(ValueError, match="non-empty"):
        engine.generate([[]])
    with pytest.raises(ValueError, match="does not fit"):
        engine.generate([list(range(30))])
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([[1, 96]])
    with pytest.raises(ValueError, match="non-empty"):
        Learner(model).logprobs([1, 2], [])


@pytest.mark.parametrize("precision", ["fp32", "nvfp4"])
def test_learner_logprobs_are_differentiable(ckpt, precision):
    """The learner path is the training path: gradients reach the plain weights (and, through the
    straight-through NVFP4 linears, the activations and the bf16 embeddings/norms)."""
    model = load_model(ckpt, precision=precision)
    train = {n: w for n, w in model.w.items() if isinstance(w, torch.Tensor) and w.is_floating_point()}
    for w in train.values():
        w.requires_grad_(True)
    lp = Learner(model).logprobs([3, 4, 5, 6], [7, 8, 9])
    assert lp.shape == (3,) and lp.requires_grad
    lp.sum().backward()
    assert train["model.embed_tokens.weight"].grad is not None
    assert train["model.layers.0.input_layernorm.weight"].grad.abs().sum() > 0
    if precision == "fp32":
        assert train["model.layers.0.self_attn.q_proj.weight"].grad.abs().sum() > 0
