"""A user's own run, end to end and offline, as docs/tasks.md tells it: a random-weight Qwen3 saved by
transformers with a BPE tokenizer and a Qwen3-style chat template, a JSONL of conversational prompts with
`answer` and `data_source` columns, and a reward file with TRL-style functions (one sync, one async that
returns None where it does not apply), all named in one run.toml.

- `minite train --config run.toml`: drift exactly 0 on every step, each reward function gets the columns
  of the rows its completions answer (checked against the dataset, not against our own rendering), the
  completions decode as transformers decodes their ids, eval metrics (greedy and pass@k) appear;
- a reward function that raises mid-run stops the run naming the function and the row, and after the fix
  `--resume` ends with the same bits as the uninterrupted run;
- `minite up --config run.toml`: the same run through the rollout and learner services, drift 0;
- `minite export`: the trained policy loads in transformers with miniTE's logits, and as compressed-tensors
  NVFP4 with finite W4A4 logits;
- bad input of every kind the issue lists: exit 2, one message naming the file, row, column or function,
  no traceback, nothing trained.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers_hf import save_hf_checkpoint
from safetensors.torch import load_file

from tests.helpers_hf import make_bpe_tokenizer_dir, tokenizer_vocab_size, write_generation_config
from tests.service_helpers import free_port

transformers = pytest.importorskip("transformers")

REWARDS = '''
import asyncio, json
from pathlib import Path

HERE = Path(__file__).parent


def correct(prompts, completions, completion_ids, answer, data_source, trainer_state, **kwargs):
    with (HERE / "calls.jsonl").open("a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                            "answer": answer, "data_source": data_source, "trainer_state": trainer_state,
                            "other": sorted(kwargs)}) + "\\n")
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


async def brevity(prompts, completions, completion_ids, data_source, **kwargs):
    await asyncio.sleep(0)
    return [None if d == "sum" else -len(ids) / 16 for ids, d in zip(completion_ids, data_source)]


def flaky(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
    if (HERE / "broken").exists() and trainer_state["step"] >= 2:
        return [float(a) / 0 for a in answer]  # a bug
    return [0.0] * len(completions)
'''

STEPS = 3


def _prompt(a: int, b: int, system: bool) -> list:
    msgs = [{"role": "system", "content": "You add numbers."}] if system else []
    return msgs + [{"role": "user", "content": f"What is {a}+{b}?"}]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The user's folder: model/, train.jsonl, eval.jsonl, rewards.py, run.toml."""
    root = tmp_path_factory.mktemp("user")
    model = make_bpe_tokenizer_dir(root / "model")
    save_hf_checkpoint(model, vocab_size=tokenizer_vocab_size(model), random_norms=True)
    write_generation_config(model)
    pairs = [(a, b) for a in range(1, 5) for b in range(2, 5)]  # 3 + 4 = 7 is among them
    rows = [{"prompt": _prompt(a, b, i % 2 == 0), "answer": str(a + b), "data_source": "add" if i % 3 else "sum"}
            for i, (a, b) in enumerate(pairs)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    (root / "rewards.py").write_text(REWARDS)
    (root / "run.toml").write_text(f"""
model_dir = "{model}"
dataset = "{root / 'train.jsonl'}"
reward = ["{root / 'rewards.py'}:correct", "{root / 'rewards.py'}:brevity", "{root / 'rewards.py'}:flaky"]
reward_weights = [1.0, 0.2, 1.0]
eval_dataset = "{root / 'eval.jsonl'}"
eval_steps = 2
num_generations_eval = 2
steps = {STEPS}
checkpoint_every = 1

[grpo]
prompts_per_step = 3
num_generations = 2
max_completion_length = 8
temperature = 1.0
""")
    return root


def _minite(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "minite_core.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(user):
    """The uninterrupted run: `minite train --config run.toml`."""
    (user / "calls.jsonl").unlink(missing_ok=True)
    r = _minite("train", "--config", user / "run.toml", "--run-dir", user / "run")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    calls = [json.loads(x) for x in (user / "calls.jsonl").read_text().splitlines()]
    return user / "run", calls, r.stdout


def test_train_has_zero_drift_and_logs_every_function(trained):
    run_dir, _, out = trained
    rows = _rows(run_dir)
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    for m in rows:
        assert m["sampling/sampling_logp_difference/max"] == 0.0 and m["drift/bitwise_equal_ratio"] == 1.0
        assert {"rewards/correct/mean", "rewards/brevity/mean", "rewards/flaky/mean"} <= set(m)
        assert 0 < m["completion_length"] <= 8
    assert "max rollout/learner |Δlogp| over the run: 0 (nvfp4)" in out


def test_reward_functions_get_the_rows_columns(trained, user):
    """Every call: prompts as the dataset's message lists, completions as assistant messages whose text is
    transformers' decoding of completion_ids, and each column's value from the row of that prompt."""
    _, calls, _ = trained
    tok = transformers.AutoTokenizer.from_pretrained(user / "model")
    dataset = {json.dumps(r["prompt"]): r for r in map(json.loads, (user / "train.jsonl").read_text().splitlines())}
    eos = set(json.loads((user / "model" / "generation_config.json").read_text())["eos_token_id"])
    train_calls = [c for c in calls if len(c["prompts"]) == 3 * 2]
    assert len(train_calls) == STEPS and [c["trainer_state"]["step"] for c in train_calls] == [1, 2, 3]
    for c in calls:
        assert "answer" not in c["other"] and "data_source" not in c["other"]  # (named parameters, not **kwargs)
        for p, comp, ids, ans, src in zip(c["prompts"], c["completions"], c["completion_ids"], c["answer"],
                                          c["data_source"]):
            row = dataset[json.dumps(p)]
            assert (ans, src) == (row["answer"], row["data_source"])
            assert comp == [{"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)}]
            assert 1 <= len(ids) <= 8 and not (set(ids[:-1]) & eos)  # sampling stopped at the first eos
    versions = [c["trainer_state"]["weight_version"] for c in train_calls]
    assert versions == list(range(versions[0], versions[0] + STEPS))  # one new version per step


def test_eval_metrics_before_during_and_after(trained):
    run_dir, calls, _ = trained
    summary = json.loads((run_dir / "summary.json").read_text())
    for when in ("before", "after"):
        assert {"eval/reward", "eval/rewards/correct/mean", "eval/rewards/brevity/mean", "eval/pass@2",
                "eval/sampled/reward"} <= set(summary[when]), summary[when]
    rows = _rows(run_dir)
    assert "eval/reward" in rows[1] and "eval/reward" in rows[2] and "eval/reward" not in rows[0]  # every 2, last
    assert len([c for c in calls if len(c["prompts"]) == 4]) == 3  # greedy evals: before, step 2, step 3 (= after)


def test_a_reward_bug_mid_run_stops_and_resume_after_the_fix_is_bitwise(trained, user, tmp_path):
    run_dir = tmp_path / "run"
    (user / "broken").touch()
    try:
        r = _minite("train", "--config", user / "run.toml", "--run-dir", run_dir)
    finally:
        (user / "broken").unlink()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "reward function 'flaky' raised ZeroDivisionError" in r.stderr and "dataset row" in r.stderr, r.stderr
    assert [m["step"] for m in _rows(run_dir)] == [1]  # step 2 neither trained nor logged as done
    r = _minite("train", "--config", user / "run.toml", "--run-dir", run_dir, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    ref, got = (load_file(str(d / "checkpoint" / "trainer.safetensors")) for d in (trained[0], run_dir))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    def same(m):  # every metric but the timings
        return {k: v for k, v in m.items() if not k.endswith(("seconds", "_per_s"))}
    assert [same(m) for m in _rows(run_dir)] == [same(m) for m in _rows(trained[0])]


def test_up_runs_the_same_config_through_the_services(user, tmp_path):
    ports = [free_port() for _ in range(4)]
    r = _minite("up", "--config", user / "run.toml", "--run-dir", tmp_path / "up", "--steps", 2, "--no-prometheus",
                "--rollout-grpc-port", ports[0], "--rollout-http-port", ports[1], "--learner-grpc-port", ports[2],
                "--learner-http-port", ports[3], timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "max rollout/learner |Δlogp| over 2 steps: 0" in r.stdout
    rows = _rows(tmp_path / "up" / "learner")
    assert [m["drift/bitwise_equal_ratio"] for m in rows] == [1.0, 1.0]
    assert all("rewards/correct/mean" in m for m in rows)


def test_up_stops_on_a_reward_bug_with_one_line(user, tmp_path):
    (tmp_path / "r.py").write_text("def f(prompts, completions, completion_ids, **kw):\n    raise KeyError('x')\n")
    ports = [free_port() for _ in range(4)]
    r = _minite("up", "--config", user / "run.toml", "--run-dir", tmp_path / "up", "--no-prometheus",
                "--reward", f"{tmp_path / 'r.py'}:f", "--reward-weights", "1",
                "--rollout-grpc-port", ports[0], "--rollout-http-port", ports[1], "--learner-grpc-port", ports[2],
                "--learner-http-port", ports[3], timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "reward function 'f' raised KeyError" in out and "Traceback" not in out, out[-3000:]
    assert "the learner exited with code 1" in r.stderr


def test_export_round_trips_through_transformers(trained, user, tmp_path):
    from minite_core.model import load_model

    run_dir = trained[0]
    for fmt in ("hf", "compressed-tensors"):
        r = _minite("export", run_dir, "--out", tmp_path / fmt, "--format", fmt)
        assert r.returncode == 0, r.stderr[-3000:]
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").apply_chat_template(
        _prompt(3, 4, True), add_generation_prompt=True, return_dict=False)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids).logits[0]
    ours = load_model(tmp_path / "hf", precision="fp32").logits(ids)[0]
    assert (ours - theirs).abs().max().item() < 1e-4
    ct = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "compressed-tensors", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.isfinite(ct(ids).logits).all()


# -- bad input ----------------------------------------------------------------------------------------------

def _bad(user, tmp_path, *flags, words, setup=None):
    run_dir = tmp_path / "bad"
    if setup:
        setup(tmp_path)
    config = [] if "--config" in flags else ["--config", user / "run.toml"]
    r = _minite("train", *config, "--run-dir", run_dir, "--steps", 1, *flags, timeout=120)
    assert r.returncode == 2, r.stdout[-1000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr and all(w in r.stderr for w in words), r.stderr
    assert not (run_dir / "checkpoint").exists()
    assert not (run_dir / "metrics.jsonl").exists() or not _rows(run_dir)


def _write(name, text):
    return lambda tmp: (tmp / name).write_text(text)


BAD = {
    "no prompt column": (["--dataset", "{tmp}/d.jsonl"], _write("d.jsonl", '{"question": "1+1", "answer": "2"}\n'),
                         ["d.jsonl", "row 0", "prompt"]),
    "unknown prompt format": (["--dataset", "{tmp}/d.jsonl"], _write("d.jsonl", '{"prompt": 3, "answer": "2"}\n'),
                              ["d.jsonl", "row 0", "prompt"]),
    "reward not found": (["--reward", "{user}/rewards.py:nope", "--reward-weights", "1"], None,
                         ["rewards.py:nope", "not found", "no 'nope'"]),
    "reward file missing": (["--reward", "{tmp}/none.py:f", "--reward-weights", "1"], None, ["none.py", "not found"]),
    "reward raising": (["--reward", "{tmp}/r.py:f", "--reward-weights", "1"],
                       _write("r.py", "def f(prompts, completions, completion_ids, **kw):\n    raise KeyError('x')\n"),
                       ["reward function 'f' raised KeyError", "sample"]),
    "wrong count": (["--reward", "{tmp}/r.py:f", "--reward-weights", "1"],
                    _write("r.py", "def f(prompts, completions, completion_ids, **kw):\n    return [1.0]\n"),
                    ["'f' returned 1 values for 4 completions"]),  # (in the eval before step 1: 4 rows)
    "NaN": (["--reward", "{tmp}/r.py:f", "--reward-weights", "1"],
            _write("r.py", "def f(prompts, completions, completion_ids, **kw):\n    return [float('nan')] * len(prompts)\n"),
            ["'f' returned nan", "dataset row", "finite"]),
    "not a number": (["--reward", "{tmp}/r.py:f", "--reward-weights", "1"],
                     _write("r.py", "def f(prompts, completions, completion_ids, **kw):\n    return ['1'] * len(prompts)\n"),
                     ["'f' returned str", "expected a float"]),
    "missing column": (["--reward", "{tmp}/r.py:f", "--reward-weights", "1"],
                       _write("r.py", "def f(prompts, completions, completion_ids, solution, **kw):\n    return []\n"),
                       ["'f' needs the column(s) solution", "answer, data_source"]),
    "all prompts too long": (["--max-prompt-length", "4"], None, ["train.jsonl", "every one of its 12 prompts",
                                                                   "longer than 4 tokens"]),
    "beyond float32": (["--reward", "{tmp}/r.py:f", "--reward-weights", "1"],
                       _write("r.py", "def f(prompts, completions, completion_ids, **kw):\n    return [1e39] * len(prompts)\n"),
                       ["'f' returned 1e+39", "float32"]),
    "empty prompt": (["--dataset", "{tmp}/d.jsonl"], _write("d.jsonl", '{"prompt": "", "answer": "2", "data_source": "add"}\n'),
                     ["d.jsonl", "row 0", "the prompt is empty"]),
    "eval prompts all too long": (["--eval-dataset", "{tmp}/e.jsonl"],
                                  _write("e.jsonl", json.dumps({"prompt": [{"role": "user", "content": "9 " * 2000}],
                                                                "answer": "2", "data_source": "add"})),
                                  ["e.jsonl", "every one of its 1 evaluated prompts is longer than"]),
    "eval format differs": (["--eval-dataset", "{tmp}/e.jsonl"],
                            _write("e.jsonl", json.dumps({"prompt": "1+1=", "answer": "2", "data_source": "add"})),
                            ["e.jsonl", "prompts are standard", "conversational"]),
    "empty stop ids": (["--stop-token-ids", "[]"], None, ["stop_token_ids is empty"]),
    "unknown key": (["--config", "{tmp}/c.toml"], None, ["c.toml", "unknown key(s) stepz"]),
    "wrong type": (["--config", "{tmp}/c.toml"], None, ["c.toml", "top_p", "valid number", "'high'"]),
    "unknown flag": (["--num-generation", "4"], None, ["--num-generation"]),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_named(user, tmp_path, case):
    flags, setup, words = BAD[case]
    flags = [f.format(tmp=tmp_path, user=user) for f in flags]
    if "--config" in flags:  # the user's run file with one bad line (a later --config is not read)
        bad = {"unknown key": "stepz = 3", "wrong type": "top_p = 'high'"}[case]
        (tmp_path / "c.toml").write_text(bad + "\n" + (user / "run.toml").read_text())
    _bad(user, tmp_path, *flags, words=words, setup=setup)


def _damaged_model(user, tmp_path, damage):
    model = tmp_path / "model"
    model.mkdir()
    for f in (user / "model").iterdir():
        (model / f.name).symlink_to(f)
    name, text = damage
    (model / name).unlink(missing_ok=True)
    (model / name).write_bytes(text(user / "model" / name))
    return model


DAMAGED = {
    "truncated safetensors": (("model.safetensors", lambda f: f.read_bytes()[:1000]), ["model", "cannot be read"]),
    "config not an object": (("config.json", lambda f: b"[1, 2]"), ["config.json", "expected a JSON object"]),
    "config not JSON": (("config.json", lambda f: b"{'a': 1"), ["config.json", "is not valid JSON"]),
}


@pytest.mark.parametrize("case", DAMAGED, ids=list(DAMAGED))
def test_a_damaged_model_folder_is_named(user, tmp_path, case):
    damage, words = DAMAGED[case]
    _bad(user, tmp_path, "--model-dir", _damaged_model(user, tmp_path, damage), words=words)


def test_a_run_dir_that_is_a_file_is_named(user, tmp_path):
    (tmp_path / "afile").write_text("x")
    r = _minite("train", "--config", user / "run.toml", "--run-dir", tmp_path / "afile", "--steps", 1, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "is a file, not a directory" in r.stderr, r.stderr


def test_template_that_fails_to_render_names_the_row(user, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for f in (user / "model").iterdir():
        (model / f.name).symlink_to(f)
    (model / "chat_template.jinja").unlink()
    (model / "chat_template.jinja").write_text("{% for m in messages %}{% if m.role == 'system' %}"
                                               "{{ raise_exception('system messages are not supported') }}"
                                               "{% endif %}{{ m.content }}{% endfor %}")
    _bad(user, tmp_path, "--model-dir", model, words=["train.jsonl", "row 0", "system messages are not supported"])


def test_tokenizer_without_eos_is_named(user, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for f in (user / "model").iterdir():
        if f.name not in ("generation_config.json", "tokenizer_config.json"):
            (model / f.name).symlink_to(f)
    cfg = json.loads((user / "model" / "tokenizer_config.json").read_text())
    cfg.pop("eos_token", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf_cfg = json.loads((user / "model" / "config.json").read_text())
    hf_cfg.pop("eos_token_id", None)
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(hf_cfg))
    _bad(user, tmp_path, "--model-dir", model, words=["no eos id", "stop_token_ids"])
