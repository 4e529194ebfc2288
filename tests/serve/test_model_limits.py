"""Settings and model files that would allocate beyond memory or hang start-up (issue 17, defect 7), on real
`minite rollout` processes: each exits 2 with one line that names the key, the figure or the file, and no
traceback, in seconds (before: OOM-killed with no message, a hang, or a service answering 200 with "abort").

- config.json typos: num_hidden_layers 1e9 / 10**9 / "2", num_attention_heads 0, rms_norm_eps "x" or NaN;
- `--max-seq-len` above the model's context; a KV cache (`--max-slots` x `--max-seq-len`) beyond memory;
- a FIFO where a weights file should be.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minite_core.model.random_init import random_checkpoint
from minite_core.rl.tiny import TINY, write_tokenizer
from tests.service_helpers import free_port, report

ROOT = Path(__file__).resolve().parents[2]


def _rollout(model, *flags, timeout=60) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "MINITE_AUTH_TOKEN"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "minite_core.cli", "rollout", "--model-dir", str(model), "--grpc-port",
                        str(free_port()), "--http-port", str(free_port()), *map(str, flags)], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=ROOT)
    return r, time.monotonic() - t0


def _copy(service_model, dest: Path) -> Path:
    shutil.copytree(service_model, dest)
    return dest


def _refused(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr and all(w in r.stderr for w in words), r.stderr[-2000:]


@pytest.mark.parametrize("key, value, words", [
    ("num_hidden_layers", 1e9, ["num_hidden_layers must be an integer"]),
    ("num_hidden_layers", 10**9, ["num_hidden_layers = 1000000000 is outside"]),
    ("num_hidden_layers", "2", ["num_hidden_layers must be an integer"]),
    ("num_attention_heads", 0, ["num_attention_heads = 0 is outside"]),
    ("rms_norm_eps", "x", ["rms_norm_eps must be a finite positive number"]),
    ("rms_norm_eps", float("nan"), ["rms_norm_eps must be a finite positive number"]),
], ids=["layers-1e9", "layers-10^9", "layers-string", "heads-0", "eps-string", "eps-nan"])
def test_bad_config_json_is_named_at_start(service_model, tmp_path, key, value, words):
    model = _copy(service_model, tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, key: value}))
    r, took = _rollout(model)
    _refused(r, "config.json", *words)
    report("bad_config_json", key=key, value=repr(value), exit_code=r.returncode, seconds=f"{took:.1f}")


def test_max_seq_len_above_the_context_is_refused(service_model):
    r, took = _rollout(service_model, "--max-seq-len", 2_000_000)
    _refused(r, "max_seq_len 2000000 is longer than the model's context")
    report("max_seq_len_above_context", max_seq_len=2_000_000, exit_code=r.returncode, seconds=f"{took:.1f}")


def test_a_kv_cache_beyond_memory_is_refused_with_the_figure(tmp_path):
    """A model with a long context: 4096 slots x 1M tokens asks for ~1 TiB of KV cache."""
    import dataclasses

    model = random_checkpoint(tmp_path / "long", dataclasses.replace(TINY, max_position_embeddings=1 << 20), seed=0)
    write_tokenizer(model)
    r, took = _rollout(model, "--max-slots", 4096, "--max-seq-len", 1 << 20)
    _refused(r, "the KV cache needs", "GiB available", "lower max_slots or max_seq_len")
    report("kv_cache_beyond_memory", slots=4096, seq=1 << 20, message=r.stderr.strip().splitlines()[-1][:120],
           seconds=f"{took:.1f}")


def test_a_fifo_as_weights_file_does_not_hang(service_model, tmp_path):
    model = _copy(service_model, tmp_path / "model")
    for f in model.glob("*.safetensors"):
        f.unlink()
    os.mkfifo(model / "model.safetensors")
    r, took = _rollout(model, timeout=60)
    _refused(r, "model.safetensors is not a regular file")
    report("fifo_weights", exit_code=r.returncode, seconds=f"{took:.1f}")


def test_config_bounds_accept_real_qwen3_shapes():
    """The bounds are no limit for real models: Qwen3-235B-A22B's config passes."""
    from minite_core.model.qwen3 import Qwen3Config

    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
           "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 94, "num_attention_heads": 64,
           "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "max_position_embeddings": 40960, "tie_word_embeddings": False, "attention_bias": False,
           "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": []}
    c = Qwen3Config.from_hf(cfg)
    assert (c.num_hidden_layers, c.num_experts, c.vocab_size) == (94, 128, 151936)
