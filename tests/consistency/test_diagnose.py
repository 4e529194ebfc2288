"""`minite diagnose`: for each misalignment knob in the rollout engine, it names the op where the two
engines first part ways; aligned engines are bitwise identical everywhere; the CLI writes JSON and PNG."""
import json

import pytest

from minite_core.cli import main
from minite_core.consistency.diagnose import diagnose
from minite_core.engine import SamplingParams
from minite_core.model import load_model
from minite_core.model.qwen3 import Qwen3Config
from minite_core.model.random_init import random_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = Qwen3Config(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    return random_checkpoint(tmp_path_factory.mktemp("diag"), cfg, seed=3)


def _report(ckpt, knobs, precision):
    prompts = [list(range(1, 4 + 3 * i)) for i in range(6)]
    return diagnose(load_model(ckpt, precision=precision, knobs=knobs), load_model(ckpt, precision=precision),
                    prompts, SamplingParams(max_tokens=8, seed=0), max_slots=3)


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_aligned_engines_are_identical_at_every_op(ckpt, precision):
    r = _report(ckpt, {}, precision)
    assert r.first_divergent is None and all(d.bitwise_equal and d.max_abs == 0 for d in r.ops)
    assert r.drift.bitwise_equal_ratio == 1.0 and r.drift.token_mismatch_ratio == 0.0
    assert [d.op for d in r.ops][:3] == ["embed", "layers.0.input_norm", "layers.0.q_proj"]


@pytest.mark.parametrize("knob,value,precision,first", [
    ("matmul", "library", "bf16", "layers.0.q_proj"),  # the first linear
    ("act_scale", "tensor", "nvfp4", "layers.0.q_proj"),
    ("attention", "sdpa", "nvfp4", "layers.0.attention"),  # the first attention
    ("kv_cache_dtype", "fp8_e4m3", "bf16", "layers.0.attention"),  # cached keys/values feed attention
])
def test_diagnose_names_the_first_divergent_op(ckpt, knob, value, precision, first):
    r = _report(ckpt, {knob: value}, precision)
    assert r.first_divergent == first
    before = [d for d in r.ops[: [d.op for d in r.ops].index(first)]]
    assert all(d.bitwise_equal for d in before)
    assert r.drift.max_abs_diff > 0 and "first divergent op: " + first in r.table()


def test_cli_writes_json_and_png(tmp_path, ckpt, capsys):
    rc = main(["diagnose", "--model", str(ckpt), "--rollout-knob", "attention=sdpa", "--prompts", "3",
               "--max-tokens", "4", "--out", str(tmp_path)])
    assert rc == 0
    assert "<- first divergent op" in capsys.readouterr().out
    data = json.loads((tmp_path / "diagnose.json").read_text())
    assert data["first_divergent_op"] == "layers.0.attention" and data["drift"]["tokens"] == 12
    assert (tmp_path / "diagnose.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["diagnose", "--model", str(ckpt), "--rollout-knob", "warp=9"]) == 2
    assert "unknown knob" in capsys.readouterr().err
