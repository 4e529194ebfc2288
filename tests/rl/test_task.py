"""The Task door (rl/task.py): the rows of a step are a function of (seed, step, index) alone, every row once
per epoch, too-long prompts skipped and counted (never cut), stop strings cut a completion where its text
completes one; and a user's own Task named by `--task package.module:factory` trains like a dataset does."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minite_core.engine import Completion
from minite_core.rl.config import RunConfig
from minite_core.rl.task import DatasetTask, TaskError, cut_at_stop, make_task
from minite_core.rl.tiny import write_tokenizer
from minite_core.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
N = 10


@pytest.fixture
def setup(tmp_path):
    write_tokenizer(tmp_path / "model")
    rows = [{"prompt": f"<bos>{i}+{i}=", "answer": str(2 * i)} for i in range(N - 1)] + \
        [{"prompt": "<bos>" + "1+" * 40 + "1=", "answer": "41"}]  # longer than max_prompt_length below
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = Tokenizer.from_dir(tmp_path / "model")
    return tmp_path, tok


def _task(tmp_path, tok, **kw) -> DatasetTask:
    cfg = RunConfig(model_dir=tmp_path / "model", dataset=str(tmp_path / "d.jsonl"), reward=["exact_match"],
                    max_prompt_length=16, max_completion_length=4, **kw)
    return DatasetTask(cfg, tok, context=64)


def test_rows_depend_on_seed_step_and_index_only(setup, caplog):
    tmp_path, tok = setup
    with caplog.at_level(logging.WARNING, logger="minite.task"):
        task = _task(tmp_path, tok)
    assert task.skipped == 1 and "skipped 1 of 10 prompts longer than 16 tokens" in caplog.text
    kept = N - 1
    again = _task(tmp_path, tok)
    steps = [[s.row for s in task.draw(step, 3)] for step in range(1, 7)]  # 18 draws = 2 epochs of 9 rows
    assert steps == [[s.row for s in again.draw(step, 3)] for step in range(1, 7)]
    assert [s.row for s in task.draw(4, 3)] == steps[3]  # a retried step draws the same rows, in any order
    flat = sum(steps, [])
    assert sorted(flat[:kept]) == sorted(flat[kept:]) == list(range(kept))  # each kept row once per epoch
    assert flat[:kept] != flat[kept:]  # reshuffled each epoch
    other = _task(tmp_path, tok, seed=1)
    assert [s.row for s in other.draw(1, kept)] != flat[:kept]
    s = task.draw(1, 1)[0]
    assert s.prompt_ids == tok.encode(s.prompt, add_special_tokens=False) and s.columns == {"answer": s.columns["answer"]}


def test_stop_strings_cut_the_completion_where_the_text_completes_one(setup):
    _, tok = setup
    ids = tok.encode("12+34", add_special_tokens=False)
    c = Completion(prompt_ids=[1], token_ids=ids, logprobs=torch.arange(len(ids), dtype=torch.float32) / -10,
                   finish_reason="length", weight_version=1, request_index=0)
    cut = cut_at_stop(c, tok, ["2+"])
    assert tok.decode(cut.token_ids) == "12+" and torch.equal(cut.logprobs, c.logprobs[:3])
    assert cut.finish_reason == "stop" and cut_at_stop(c, tok, ["9"]) is c


def test_bad_task_factories_are_named(setup, monkeypatch):
    tmp_path, tok = setup
    (tmp_path / "half_task.py").write_text("def make(cfg, tokenizer):\n    return object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskError, match="not found"):
        make_task(RunConfig(task="no_such_module_xyz:make"), tok, 64)
    with pytest.raises(TaskError, match="not found"):
        make_task(RunConfig(task="half_task:nope"), tok, 64)
    with pytest.raises(TaskError, match="returned object, which has no 'draw'"):
        make_task(RunConfig(task="half_task:make"), tok, 64)


MY_TASK = '''
"""A Task that no file describes: prompts are the tokens of random additions, the reward is 1 when the first
completed token is the eos id."""
import torch

from minite_core.rl.task import Sample, Scores


class EosTask:
    max_completion_length = 3

    def __init__(self, cfg, tokenizer):
        self.tok, self.seed = tokenizer, cfg.seed
        self.stop_token_ids = tuple(tokenizer.eos_token_ids)
        self.calls = []

    def draw(self, step, count):
        g = torch.Generator().manual_seed(self.seed * 1000 + step)
        out = []
        for i in range(count):
            a, b = torch.randint(0, 50, (2,), generator=g).tolist()
            text = f"<bos>{a}+{b}="
            out.append(Sample(prompt=text, prompt_ids=self.tok.encode(text, add_special_tokens=False), columns={}, row=i))
        return out

    def score(self, samples, completions, *, step, version):
        r = [1.0 if c.token_ids[:1] == [self.stop_token_ids[0]] else 0.0 for c in completions]
        with open("scored.jsonl", "a") as f:
            f.write(__import__("json").dumps({"step": step, "n": len(completions)}) + "\\n")
        return Scores(total=torch.tensor(r), per_function={"eos_first": r})

    def eval_samples(self):
        return self.draw(0, 3)


def make(cfg, tokenizer):
    return EosTask(cfg, tokenizer)
'''


def test_a_users_own_task_trains_with_zero_drift(service_model, tmp_path):
    (tmp_path / "my_task.py").write_text(MY_TASK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    r = subprocess.run([sys.executable, "-m", "minite_core.cli", "train", "--task", "my_task:make", "--model-dir",
                        str(service_model), "--run-dir", "run", "--steps", "2", "--prompts-per-step", "2",
                        "--num-generations", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["sampling/sampling_logp_difference/max"] for m in rows] == [0.0, 0.0]
    assert all("rewards/eos_first/mean" in m for m in rows) and "eval/reward" in rows[-1]
    scored = [json.loads(x) for x in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert [s["step"] for s in scored if s["n"] == 2 * 2] == [1, 2]  # (evaluations score 3)


@pytest.mark.parametrize("name, source, words", [
    ("bad_task_a", "def make():\n    return None\n", r"task factory 'bad_task_a:make' raised TypeError.*factory\(cfg, tokenizer\)"),
    ("bad_task_b", "def make(cfg, tokenizer):\n    raise KeyError('split')\n", r"raised KeyError: 'split'"),
    ("bad_task_c", "def make(cfg, tokenizer)\n    pass\n", r"importing the task 'bad_task_c:make' failed: SyntaxError"),
])
def test_a_task_that_fails_is_named(tmp_path, monkeypatch, name, source, words):
    """A user's factory that cannot be imported or called is a TaskError naming it (`minite train`: one line)."""
    from minite_core.rl.config import RunConfig
    from minite_core.rl.task import TaskError, make_task

    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskError, match=words):
        make_task(RunConfig(task=f"{name}:make", run_dir=str(tmp_path / "r")), tokenizer=None, context=64)
