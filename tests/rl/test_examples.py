"""The runnable examples under examples/, run as their run.toml says (shortened by flags): the addition
task as files on the tiny architecture, and reasoning-gym's countdown with its own scorer and a regex
format reward on a random-weight Qwen3 with a BPE tokenizer and chat template (standing in for the user's
local Qwen3). That tokenizer's 600-token vocabulary spells reasoning-gym's long system prompt in ~1000
tokens, which the CPU reference attention takes minutes over, so the run takes the same generator without
the system prompt; the example's own dataset specs are loaded and rendered on their own. Each must train
with drift exactly 0 and log every reward function."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers_hf import save_hf_checkpoint

from tests.helpers_hf import make_bpe_tokenizer_dir, tokenizer_vocab_size, write_generation_config

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--steps", "2", "--prompts-per-step", "2", "--num-generations", "2", "--eval-max-rows", "4"]


def _run(cwd: Path, *args) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "minite_core.cli", "train", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return [json.loads(x) for x in (cwd / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def workdir(tmp_path):
    """A copy of examples/ in a fresh directory, which the run files' relative paths are read from."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("*.jsonl"))
    return tmp_path


def test_addition_example(workdir, service_model):
    subprocess.run([sys.executable, "examples/addition/make_data.py"], cwd=workdir, check=True, capture_output=True)
    assert len((workdir / "examples/addition/train.jsonl").read_text().splitlines()) == 10_000
    rows = _run(workdir, "--config", "examples/addition/run.toml", "--model-dir", service_model, "--run-dir", "run",
                *SHORT)
    assert [m["sampling/sampling_logp_difference/max"] for m in rows] == [0.0, 0.0]
    assert {"rewards/correct/mean", "rewards/short/mean", "eval/reward"} <= set(rows[-1])


def test_countdown_example(workdir, tmp_path):
    pytest.importorskip("reasoning_gym")
    model = make_bpe_tokenizer_dir(tmp_path / "Qwen3-0.6B")
    save_hf_checkpoint(model, vocab_size=tokenizer_vocab_size(model), max_position_embeddings=2048)
    write_generation_config(model)
    from minite_core.rl import data
    from minite_core.rl.config import read_file
    from minite_core.tokenizer import Tokenizer

    cfg = read_file(workdir / "examples/countdown/run.toml")
    tok = Tokenizer.from_dir(model)
    for spec in (cfg["dataset"], cfg["eval_dataset"]):
        rows = data.load_rows(spec)
        assert tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, **cfg["chat_template_kwargs"])
    short = "reasoning_gym:countdown?size=40&seed={}&min_numbers=3&max_numbers=4&system=none"
    rows = _run(workdir, "--config", "examples/countdown/run.toml", "--model-dir", model, "--run-dir", "run",
                "--dataset", short.format(1), "--eval-dataset", short.format(2), "--max-completion-length", "8",
                "--num-generations-eval", "2", *SHORT)
    assert [m["sampling/sampling_logp_difference/max"] for m in rows] == [0.0, 0.0]
    assert {"rewards/reasoning_gym/mean", "rewards/format_regex/mean", "eval/pass@2"} <= set(rows[-1])
