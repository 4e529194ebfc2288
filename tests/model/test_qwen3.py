"""The Qwen3 / Qwen3-MoE model: parity with HF transformers on tiny random checkpoints that the tests
build and save themselves, batch invariance of its logits, and loading errors."""
import json

import pytest
import torch
from tests.backends import DEVICE
from tests.helpers_hf import save_hf_checkpoint

from minite_core import ops
from minite_core.model import load_model

transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return save_hf_checkpoint(tmp_path_factory.mktemp("dense"), random_norms=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_hf_checkpoint(tmp_path_factory.mktemp("moe"), moe=True, random_norms=True)


def _hf_logits(path, moe, dtype, ids):
    cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    kw = {"experts_implementation": "eager"} if moe else {}
    hf = cls.from_pretrained(path, dtype=dtype, attn_implementation="eager", **kw).eval()
    with torch.no_grad():
        return hf(ids, use_cache=False).logits.float()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fp32_logits_match_transformers(dense_dir, moe_dir, moe):
    path = moe_dir if moe else dense_dir
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    ours = load_model(path, precision="fp32").logits(ids)
    ref = _hf_logits(path, moe, torch.float32, ids)
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_bf16_logits_match_transformers_within_bf16_noise(dense_dir, moe_dir, moe):
    path = moe_dir if moe else dense_dir
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(2))
    ours = load_model(path, precision="bf16").logits(ids)
    ref = _hf_logits(path, moe, torch.bfloat16, ids)
    ref32 = _hf_logits(path, moe, torch.float32, ids)
    # bf16 noise: our bf16 logits sit about as far from fp32 as HF's bf16 logits do
    assert (ours - ref32).abs().max() <= 2 * (ref - ref32).abs().max() + 1e-2


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logits_are_batch_invariant(dense_dir, moe_dir, moe, precision):
    model = load_model(moe_dir if moe else dense_dir, precision=precision, device=DEVICE)
    ids = torch.randint(0, 96, (6, 13), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    full = model.logits(ids)
    for i in range(6):
        assert torch.equal(model.logits(ids[i:i + 1]), full[i:i + 1]), i
    assert torch.equal(model.logits(ids[:, :7]), full[:, :7])  # causal: a prefix gives the prefix's rows


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_observing_inputs_sees_every_linear_once(dense_dir, moe_dir, moe):
    model = load_model(moe_dir if moe else dense_dir, precision="bf16")
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    seen, captured = [], {}
    with model.observing_inputs(lambda x, names: seen.append((names, x.clone()))):
        model.forward(ids, capture=lambda name, v: captured.setdefault(name, v.clone()))
    calls = {names: x for names, x in seen}
    assert len(calls) == len(seen)  # once each per forward
    cfg = model.cfg
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = tuple(p + f"self_attn.{z}_proj" for z in "qkv")
        assert torch.equal(calls[qkv], captured[f"layers.{i}.input_norm"])  # one call for q/k/v
        assert torch.equal(calls[(p + "self_attn.o_proj",)], captured[f"layers.{i}.attention"])
        if cfg.is_moe_layer(i):  # every expert sees the tokens routed to it: top-k rows per token in all
            rows = sum(x.shape[0] for names, x in seen if names[0].startswith(p + "mlp.experts.")
                       and names[0].endswith("gate_proj"))
            assert rows == ids.numel() * cfg.num_experts_per_tok
        else:
            assert torch.equal(calls[(p + "mlp.gate_proj", p + "mlp.up_proj")], captured[f"layers.{i}.post_norm"])
            assert (p + "mlp.down_proj",) in calls
    head = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    assert torch.equal(calls[(head,)], captured["final_norm"])
    before = len(seen)
    model.forward(ids)  # outside the block nothing is observed
    assert len(seen) == before


def test_nvfp4_quantizes_the_linear_layers_only(dense_dir):
    model = load_model(dense_dir, precision="nvfp4", keep_bf16=[-1])
    from minite_core.nvfp4 import NVFP4Tensor

    quantized = {n for n, w in model.w.items() if isinstance(w, NVFP4Tensor)}
    assert "model.layers.0.self_attn.q_proj.weight" in quantized and "model.layers.0.mlp.down_proj.weight" in quantized
    assert not any(n.startswith("model.layers.1.") for n in quantized)  # the last block is kept in bf16
    assert "model.embed_tokens.weight" not in quantized and "lm_head.weight" not in quantized
    fp32 = load_model(dense_dir, precision="fp32").logits(torch.arange(10).view(1, -1))
    q = model.logits(torch.arange(10).view(1, -1))
    assert ((q - fp32).norm() / fp32.norm()).item() < 0.2


def test_sharded_checkpoint_and_tokenizer(tmp_path, dense_dir):
    from tokenizers import Tokenizer, models

    hf = transformers.Qwen3ForCausalLM.from_pretrained(dense_dir)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = torch.arange(12).view(2, 6)
    assert torch.equal(load_model(tmp_path, precision="fp32")(ids), load_model(dense_dir, precision="fp32")(ids))
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(90)}, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    assert load_model(tmp_path).tokenizer.vocab_size == 90
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(200)}, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="tokenizer has 200 tokens"):
        load_model(tmp_path)


def test_bad_input_ids(dense_dir):
    model = load_model(dense_dir)
    with pytest.raises(ValueError, match="token ids"):
        model(torch.tensor([[1, 96]]))
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.zeros(2, 3))


def test_loading_errors(tmp_path, dense_dir):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(dense_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama")))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(bad)
    (bad / "config.json").write_text(json.dumps(dict(cfg, hidden_size=32)))
    with pytest.raises(ValueError, match="shape"):
        load_model(bad)
    (bad / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
    with pytest.raises(ValueError, match="missing"):
        load_model(bad)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="precision"):
        load_model(dense_dir, precision="int8")
    with pytest.raises(ValueError, match="backend"):
        ops.resolve_backend("jax")
