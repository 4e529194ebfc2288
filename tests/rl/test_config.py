"""One run configuration (rl/config.py) read the same way by `minite train`, `minite learner` and `minite up`:
precedence default < --config file < MINITE_* env < flags, sections of the file merged, TRL's names, and
errors that say which key is wrong and where its value came from."""
import json

import pytest

from minite_core.rl.config import ConfigError, RunConfig, load
from services.common.settings import LearnerSettings
from services.up import UpSettings

RUN_TOML = """
dataset = "prompts.jsonl"
reward = ["rewards.py:correct", "exact_match"]
reward_weights = [1.0, 0.5]
chat_template_kwargs = {enable_thinking = false}
steps = 7

[grpo]
num_generations = 4
beta = 0.04
loss_type = "dapo"
learning_rate = 1e-6
"""


@pytest.fixture
def run_toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(RUN_TOML)
    return path


def test_precedence_file_env_flags(run_toml, monkeypatch):
    monkeypatch.setenv("MINITE_STEPS", "9")
    monkeypatch.setenv("MINITE_BETA", "0.1")
    cfg = load(RunConfig, ["--config", str(run_toml), "--beta", "0.2", "--seed", "3"], "minite train")
    assert (cfg.steps, cfg.beta, cfg.seed) == (9, 0.2, 3)  # env over file, flag over env
    assert (cfg.num_generations, cfg.loss_type, cfg.learning_rate) == (4, "dapo", 1e-6)  # from the [grpo] section
    assert cfg.reward == ["rewards.py:correct", "exact_match"] and cfg.reward_weights == [1.0, 0.5]
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    assert (cfg.temperature, cfg.max_prompt_length, cfg.epsilon) == (1.0, 512, 0.2)  # defaults (TRL's)


def test_json_file_and_list_flags(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"dataset": "d.jsonl", "reward": ["a.py:f"], "stop-token-ids": [5]}))
    cfg = load(RunConfig, ["--config", str(path), "--reward", "a.py:f", "--reward", "b.py:g",
                           "--reward-weights", "1,0.5", "--stop", "</answer>"], "minite train")
    assert cfg.reward == ["a.py:f", "b.py:g"] and cfg.reward_weights == [1.0, 0.5]
    assert cfg.stop_token_ids == [5] and cfg.stop == ["</answer>"]


@pytest.mark.parametrize("cls", [RunConfig, LearnerSettings, UpSettings], ids=["train", "learner", "up"])
def test_every_command_reads_the_same_file(cls, run_toml):
    """The learner service and `minite up` take every run setting (backward, beta, knobs included)."""
    cfg = load(cls, ["--config", str(run_toml), "--backward", "nvfp4", "--rollout-knobs", '{"matmul": "library"}'],
               "minite")
    assert (cfg.steps, cfg.beta, cfg.backward, cfg.rollout_knobs) == (7, 0.04, "nvfp4", {"matmul": "library"})
    assert cfg.run_fields()["reward"] == ["rewards.py:correct", "exact_match"]


def test_the_run_file_of_minite_up_round_trips(run_toml, tmp_path):
    """`minite up` hands the learner its run as a JSON file of RunConfig fields: the same settings come back."""
    up = load(UpSettings, ["--config", str(run_toml), "--replicas", "2"], "minite up")
    path = tmp_path / "run.json"
    path.write_text(json.dumps(up.run_fields()))
    learner = load(LearnerSettings, ["--config", str(path)], "minite learner")
    assert learner.run_fields() == up.run_fields()


@pytest.mark.parametrize("argv, env, words", [
    (["--config", "{f}"], {}, ["{f}", "unknown key(s) stepz"]),
    (["--temperature", "hot"], {}, ["temperature (flag --temperature)", "valid number", "'hot'"]),
    ([], {"MINITE_TOP_P": "2"}, ["top_p (MINITE_TOP_P)", "less than or equal to 1"]),
    (["--learning-rate", "nan"], {}, ["learning_rate (flag --learning-rate)", "'nan'"]),
    (["--beta", "inf"], {}, ["beta must be a finite number"]),
    (["--loss-type", "bnpo"], {}, ["loss_type must be grpo, dapo or dr_grpo"]),
    (["--reward", "a.py:f", "--reward-weights", "1,2"], {}, ["reward_weights has 2 values for 1 reward functions"]),
    (["--task", "nocolon"], {}, ["package.module:factory"]),
    (["--num-generation", "4"], {}, ["--num-generation"]),
    (["--config", "{missing}"], {}, ["does not exist"]),
    (["--config", "{f}", "--config", "{f}"], {}, ["give one --config file"]),
])
def test_errors_name_the_key_and_its_origin(tmp_path, monkeypatch, argv, env, words):
    bad = tmp_path / "bad.toml"
    bad.write_text("stepz = 3\n")
    fmt = {"f": str(bad), "missing": str(tmp_path / "none.toml")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        load(RunConfig, [a.format(**fmt) for a in argv], "minite train")
    assert all(w.format(**fmt) in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("given, read", [("group", "group"), ("batch", "batch"), ("none", "none"), ("true", "group"),
                                         ("false", "none")])
def test_scale_rewards_takes_trls_values(given, read, tmp_path):
    assert load(RunConfig, ["--scale-rewards", given], "minite train").scale_rewards == read
    f = tmp_path / "run.toml"
    f.write_text(f"scale_rewards = {given if given in ('true', 'false') else json.dumps(given)}\n")  # (true: a TOML bool)
    assert load(RunConfig, ["--config", str(f)], "minite train").scale_rewards == read
    with pytest.raises(ConfigError, match="scale_rewards must be group, batch or none"):
        load(RunConfig, ["--scale-rewards", "std"], "minite train")


def test_a_key_set_in_two_sections_is_an_error(tmp_path):
    f = tmp_path / "twice.toml"
    f.write_text("steps = 1\n[grpo]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"twice.toml: steps is set twice, at the top level and in \[grpo\]"):
        load(RunConfig, ["--config", str(f)], "minite train")


@pytest.mark.parametrize("device, words", [("bogus", "is not a torch device"), ("mps", "only cpu and cuda"),
                                           ("cuda:99", "CUDA device")])
def test_a_device_this_machine_lacks_is_named(device, words):
    for cls, prog in ((RunConfig, "minite train"), (LearnerSettings, "minite learner")):
        with pytest.raises(ConfigError) as e:
            load(cls, ["--device", device], prog)
        assert "device (flag --device)" in str(e.value) and words in str(e.value), str(e.value)


def test_a_bad_toml_file_is_named(tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text("steps = = 3\n")
    with pytest.raises(ConfigError, match="broken.toml"):
        load(RunConfig, ["--config", str(bad)], "minite train")


def _help(cmd: str) -> str:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "minite_core.cli", cmd, "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("cmd", ["train", "up", "learner", "rollout"])
def test_help_is_readable_and_describes_every_flag(cmd):
    """--help names what a flag takes in words (no Python types such as {Path,null} or list[str]), and every
    flag has a description beyond its default."""
    import re

    out = _help(cmd)
    assert not re.search(r"\{[A-Za-z]+,|null\}|list\[|dict\[|SecretStr", out), out
    undescribed = []
    for entry in re.split(r"\n  (?=--)", out.split("options:", 1)[1]):
        entry = " ".join(entry.split())
        if not entry.startswith("--"):
            continue
        text = re.sub(r"^--\S+(?:,? --\S+)*(?: [A-Z.]+(?: \.\.\.)?)?", "", entry)
        if not re.sub(r"\(default: .*?\)|\(required\)", "", text).strip():
            undescribed.append(entry.split()[0])
    assert not undescribed, f"flags without a description in `minite {cmd} --help`: {undescribed}"


def test_version():
    import subprocess
    import sys
    from importlib.metadata import version

    r = subprocess.run([sys.executable, "-m", "minite_core.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"minite {version('minite')}", (r.stdout, r.stderr)
