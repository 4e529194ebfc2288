"""Reward functions as TRL runs them: loading by file / module / built-in name, the call (columns as keyword
lists, trainer_state, async functions concurrently), None and weights combined as TRL's nansum, every bad
function named with its sample, the built-ins on both completion formats, and the addition reward equal to
the pre-dataset formula."""
import asyncio
import random
import time

import pytest
import torch

from minite_core.rl.rewards import RewardError, RewardFunction, check_columns, compute_rewards, load_rewards
from minite_core.rl.addition import EOS, SPECIALS, VOCAB, addition, build_tokenizer

REWARDS_PY = '''
import asyncio
calls = []

def correct(prompts, completions, completion_ids, answer, **kwargs):
    calls.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer, **kwargs))
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def only_answer(completions, answer, **kwargs):
    return [float(len(a)) for a in answer]

def named_only(prompts, completions, completion_ids, answer):
    return [0.0 for _ in answer]

def needs_column(prompts, completions, completion_ids, solution, **kwargs):
    return [0.0 for _ in completions]

def not_applicable(prompts, completions, completion_ids, data_source, **kwargs):
    return [1.0 if d == "math" else None for d in data_source]

def wrong_length(completions, **kwargs):
    return [1.0]

def scalar(completions, **kwargs):
    return 1.0

def text_value(completions, **kwargs):
    return [0.0, "high", 0.0, 0.0][:len(completions)]

def nan_value(completions, **kwargs):
    return [0.0, 0.0, float("nan"), 0.0][:len(completions)]

def inf_value(completions, **kwargs):
    return [float("inf")] * len(completions)

def beyond_f32(completions, **kwargs):
    return [0.0, 1e39, 0.0, 0.0][:len(completions)]

def huge_int(completions, **kwargs):
    return [0, 0, 0, 10 ** 400][:len(completions)]

def large(completions, **kwargs):
    return [3e38] * len(completions)

def raising(completions, answer, **kwargs):
    return [1.0 / int(a) for a in answer]

def wrong_signature(text):
    return [0.0]

async def slow_a(completions, **kwargs):
    await asyncio.sleep(0.3)
    return [0.25] * len(completions)

async def slow_b(completions, **kwargs):
    await asyncio.sleep(0.3)
    return [0.5] * len(completions)

async def async_raising(completions, answer, **kwargs):
    await asyncio.sleep(0)
    return [1.0 / int(a) for a in answer]

NOT_A_FUNCTION = 3
'''

BATCH = dict(prompts=["1+1=", "2+2=", "0+0=", "3+3="], completions=[" 2", "5", "0 ", "6"],
             completion_ids=[[5, 2], [8], [3, 2], [9, 2]],
             columns={"answer": ["2", "4", "0", "6"], "data_source": ["math", "code", "math", "code"]},
             trainer_state={"step": 3, "weight_version": 7})


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_PY)
    return path


def test_file_spec_gets_every_column_as_a_keyword_list(rewards_file):
    fns = load_rewards([f"{rewards_file}:correct"])
    assert [(f.name, f.weight, f.is_async) for f in fns] == [("correct", 1.0, False)]
    total, per = compute_rewards(fns, **BATCH)
    assert per == {"correct": [1.0, 0.0, 1.0, 1.0]}
    assert total.dtype == torch.float32 and total.tolist() == [1.0, 0.0, 1.0, 1.0]
    (call,) = fns[0].fn.__globals__["calls"]
    assert call == dict(prompts=BATCH["prompts"], completions=BATCH["completions"],
                        completion_ids=BATCH["completion_ids"], **BATCH["columns"], trainer_state=BATCH["trainer_state"])


def test_relative_path_and_module_specs(rewards_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (fn,) = load_rewards(["my_rewards.py:only_answer"])
    assert compute_rewards([fn], **BATCH)[1] == {"only_answer": [1.0] * 4}
    # one file named twice is imported once: the two functions share its module state
    a, b = load_rewards(["my_rewards.py:correct", f"{rewards_file}:correct"])
    assert a.fn is b.fn and [a.name, b.name] == ["correct", "correct_2"]
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(REWARDS_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    (fn,) = load_rewards(["mypkg.scoring:correct"])
    assert fn.fn.__module__ == "mypkg.scoring" and compute_rewards([fn], **BATCH)[1]["correct"] == [1.0, 0.0, 1.0, 1.0]


def test_function_without_kwargs_gets_the_columns_it_names(rewards_file):
    fns = load_rewards([f"{rewards_file}:named_only"])
    assert compute_rewards(fns, **BATCH)[1] == {"named_only": [0.0] * 4}


def test_none_means_does_not_apply_and_weights_combine_like_trl(rewards_file):
    fns = load_rewards([f"{rewards_file}:correct", f"{rewards_file}:not_applicable", "length_penalty=1"],
                       weights=[2.0, 0.5, 1.0])
    total, per = compute_rewards(fns, **BATCH)
    assert per["not_applicable"] == [1.0, None, 1.0, None]
    # TRL's GRPOTrainer: None -> NaN, then (rewards_per_func * weights).nansum(dim=1)
    table = torch.tensor([[torch.nan if v is None else v for v in per[f.name]] for f in fns], dtype=torch.float32).T
    assert torch.equal(total, (table * torch.tensor([2.0, 0.5, 1.0])).nansum(dim=1))
    assert total.tolist() == [1.5, 0.0, 1.5, 1.0]  # 2*correct + 0.5*not_applicable - (tokens - 1)
    # a sample no function applies to counts 0
    (fn,) = load_rewards([f"{rewards_file}:not_applicable"])
    assert compute_rewards([fn], **BATCH)[0].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_weights_must_match_the_functions(rewards_file):
    with pytest.raises(RewardError, match="2 reward weights for 1 reward functions"):
        load_rewards([f"{rewards_file}:correct"], weights=[1.0, 2.0])
    with pytest.raises(RewardError, match="correct.*weight nan is not a finite number"):
        load_rewards([f"{rewards_file}:correct"], weights=[float("nan")])
    with pytest.raises(RewardError, match="no reward function given"):
        load_rewards([])


def test_async_functions_run_concurrently(rewards_file):
    fns = load_rewards([f"{rewards_file}:slow_a", f"{rewards_file}:slow_b", f"{rewards_file}:correct"])
    assert [f.is_async for f in fns] == [True, True, False]
    t = time.perf_counter()
    total, per = compute_rewards(fns, **BATCH)
    assert time.perf_counter() - t < 0.55  # one after the other would take 0.6 s
    assert per["slow_a"] == [0.25] * 4 and per["slow_b"] == [0.5] * 4
    assert total.tolist() == [1.75, 0.75, 1.75, 1.75]


def test_async_functions_wait_on_each_other():
    """Each awaits an event that only the other sets: run one after the other, they would never finish."""
    events = {}

    def make(mine, other):
        async def fn(prompts, completions, completion_ids, **kwargs):
            events.setdefault(mine, asyncio.Event()).set()
            await asyncio.wait_for(events.setdefault(other, asyncio.Event()).wait(), timeout=5)
            return [1.0] * len(completions)
        return fn
    fns = [RewardFunction("a", make("a", "b"), 1.0, True), RewardFunction("b", make("b", "a"), 1.0, True)]
    assert compute_rewards(fns, **BATCH)[0].tolist() == [2.0] * 4

    async def from_a_running_loop():  # e.g. called from an async service: a fresh loop in a worker thread
        events.clear()
        return compute_rewards(fns, **BATCH)[0].tolist()
    assert asyncio.run(from_a_running_loop()) == [2.0] * 4


@pytest.mark.parametrize("spec, message", [
    ("missing.py:correct", r"'missing.py:correct' not found: no file missing.py"),
    ("{f}:corect", r"has no 'corect' \(it defines: .*correct, "),
    ("{f}:NOT_A_FUNCTION", r"'NOT_A_FUNCTION' is a int, not a function"),
    ("{f}:wrong_signature", r"'wrong_signature'\(text\) does not take TRL's arguments"),
    ("no_such_package_xyz.rewards:correct", r"not found: no module 'no_such_package_xyz'"),
    ("correct", r"'correct' not found: expected path/to/file.py:name, package.module:name or a built-in "
                r"\(exact_match, last_number"),
    ("format_regex=(", r"'format_regex': '\(' is not a regular expression"),
    ("length_penalty", r"length_penalty=256 \(got no argument\)"),
    ("length_penalty=-3", r"positive number of tokens"),
    ("exact_match=1", r"'exact_match' takes no argument"),
])
def test_load_errors_name_the_function(rewards_file, spec, message):
    with pytest.raises(RewardError, match=message):
        load_rewards([spec.format(f=rewards_file)])


def test_import_errors_carry_the_message(tmp_path, monkeypatch):
    (tmp_path / "broken.py").write_text("import numpy\nraise RuntimeError('no API key set')\n")
    with pytest.raises(RewardError, match=r"importing .*broken.py failed: RuntimeError: no API key set"):
        load_rewards([f"{tmp_path}/broken.py:f"])
    (tmp_path / "badmod.py").write_text("import not_installed_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"importing badmod failed: ModuleNotFoundError: .*not_installed_module_xyz"):
        load_rewards(["badmod:f"])


@pytest.mark.parametrize("name, message", [
    ("raising", r"'raising' raised ZeroDivisionError: float division by zero on sample 2 \(dataset row 12\), prompt '0\+0='"),
    ("async_raising", r"'async_raising' raised ZeroDivisionError: float division by zero on sample 2 \(dataset row 12\)"),
    ("wrong_length", r"'wrong_length' returned 1 values for 4 completions"),
    ("scalar", r"'scalar' returned float 1.0, expected a list of 4 floats"),
    ("text_value", r"'text_value' returned str 'high' for sample 1 \(dataset row 11\), prompt '2\+2=': expected a float"),
    ("nan_value", r"'nan_value' returned nan for sample 2 \(dataset row 12\).*expected a finite float"),
    ("inf_value", r"'inf_value' returned inf for sample 0 \(dataset row 10\)"),
    ("beyond_f32", r"'beyond_f32' returned 1e\+39 for sample 1 \(dataset row 11\).*float32's range"),
    ("huge_int", r"'huge_int' returned inf for sample 3 \(dataset row 13\).*float32's range"),
    ("needs_column", r"'needs_column' needs the column\(s\) solution, which the dataset does not have "
                     r"\(columns: answer, data_source\)"),
])
def test_bad_results_name_the_function_and_sample(rewards_file, name, message):
    fns = load_rewards([f"{rewards_file}:correct", f"{rewards_file}:{name}"])
    with pytest.raises(RewardError, match=message):
        compute_rewards(fns, **BATCH, row_ids=[10, 11, 12, 13])


def test_weighted_rewards_that_overflow_float32_are_refused(rewards_file):
    """Each value fits float32, their weighted sum does not: refused before the step logs or trains on it (an
    inf total in the trajectory log would fail every --resume of the run)."""
    fns = load_rewards([f"{rewards_file}:large", f"{rewards_file}:large"])
    with pytest.raises(RewardError, match=r"weighted reward of sample 0 \(dataset row 10\).* is inf in float32"):
        compute_rewards(fns, **BATCH, row_ids=[10, 11, 12, 13])
    fns = load_rewards([f"{rewards_file}:large"], weights=[0.5])
    total, _ = compute_rewards(fns, **BATCH, row_ids=[10, 11, 12, 13])
    assert torch.isfinite(total).all()


def test_a_reward_that_exits_is_named(tmp_path):
    (tmp_path / "r.py").write_text("import sys\ndef f(completions, **kw):\n    sys.exit(3)\n"
                                   "async def g(completions, **kw):\n    raise SystemExit(4)\n")
    for name in ("f", "g"):
        fns = load_rewards([f"{tmp_path}/r.py:{name}"])
        with pytest.raises(RewardError, match=rf"'{name}' raised SystemExit"):
            compute_rewards(fns, **BATCH, row_ids=[10, 11, 12, 13])


def test_a_column_named_as_a_reward_argument_is_refused(rewards_file):
    fns = load_rewards([f"{rewards_file}:correct"])
    with pytest.raises(RewardError, match=r"column named 'completions'.*rename the column"):
        check_columns(fns, ["prompt", "answer", "completions"])


def test_missing_columns_are_found_before_the_first_step(rewards_file):
    fns = load_rewards([f"{rewards_file}:correct", f"{rewards_file}:needs_column", "reasoning_gym"]
                       if _has_gym() else [f"{rewards_file}:correct", f"{rewards_file}:needs_column"])
    check_columns(fns[:1], ["prompt", "answer"])
    with pytest.raises(RewardError, match=r"'needs_column' needs the column\(s\) solution.*columns: answer, prompt"):
        check_columns(fns, ["prompt", "answer"])


def _has_gym():
    try:
        import reasoning_gym  # noqa: F401
        return True
    except ImportError:
        return False


# -- built-ins ---------------------------------------------------------------------------------------------


def _run(spec, completions, answers=None, ids=None):
    fns = load_rewards([spec])
    n = len(completions)
    return compute_rewards(fns, prompts=["q"] * n, completions=completions, completion_ids=ids or [[0]] * n,
                           columns={} if answers is None else {"answer": answers}, trainer_state={})[1][fns[0].name]


def _both(texts):
    """The same completions in TRL's standard and conversational formats."""
    return [texts, [[{"role": "assistant", "content": t}] for t in texts]]


@pytest.mark.parametrize("fmt", [0, 1], ids=["standard", "conversational"])
def test_builtins(fmt):
    pick = lambda texts: _both(texts)[fmt]  # noqa: E731
    assert _run("exact_match", pick([" 42\n", "42.0", "Paris"]), ["42", "42", "Paris"]) == [1.0, 0.0, 1.0]
    assert _run("last_number", pick(["so 3 + 4 = 7", "it is 1,000.", "x = -2.50 then", "\\boxed{12} not 13",
                                     "no number", "7/2"]),
                ["7", "1000", "-2.5", "12", "1", "3.5"]) == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    # a GSM8K answer: the number after the rationale
    assert _run("last_number", pick(["The answer is 72."]), ["48 + 24 = 72\n#### 72"]) == [1.0]
    assert _run("boxed", pick(["so \\boxed{\\frac{1}{2}}", "\\boxed{0.50}", "\\boxed{3} no", "3"]),
                ["\\frac{1}{2}", "0.5", "4", "3"]) == [1.0, 1.0, 0.0, 0.0]
    assert _run("format_regex", pick(["<think>a\nb</think>\n<answer>5</answer>", "<answer>5</answer>",
                                      "<think>x</think><answer>5</answer> and more"])) == [1.0, 0.0, 0.0]
    assert _run("format_regex=Answer: \\d+", pick(["Answer: 12", "answer: 12"])) == [1.0, 0.0]
    assert _run("length_penalty=4", pick(["a", "b", "c"]), ids=[[1] * 3, [1] * 4, [1] * 6]) == [0.0, 0.0, -0.5]


def test_builtin_errors_name_the_row():
    with pytest.raises(RewardError, match=r"'last_number' raised ValueError: answer 'Paris' holds no number on sample 1"):
        _run("last_number", ["1", "2"], ["1", "Paris"])
    with pytest.raises(RewardError, match=r"'exact_match' raised TypeError: a completion is a string or a list"):
        _run("exact_match", [{"content": "1"}], ["1"])


# -- the built-in addition task ----------------------------------------------------------------------------


def _old_reward(a: int, b: int, completion: list[int]) -> float:
    """AdditionTask.reward with partial_credit=True as it was before the dataset API (copied verbatim)."""
    tok = build_tokenizer()
    target = tok.encode(str(a + b)).ids + [EOS]
    if completion[: len(target)] == target:
        return 1.0
    want = str(a + b)
    got = "".join(VOCAB[i] for i in (completion[: completion.index(EOS)] if EOS in completion else completion)
                  if i >= len(SPECIALS))
    hits = sum(1 for x, y in zip(got, want) if x == y)
    return 0.5 * hits / max(len(want), len(got), 1)


def test_addition_reward_equals_the_old_formula():
    rng, tok = random.Random(0), build_tokenizer()
    problems, ids = [], []
    for _ in range(3000):
        d = rng.choice([1, 2, 3])
        a, b = rng.randrange(10**d), rng.randrange(10**d)
        right = tok.encode(str(a + b)).ids + [EOS]
        kind = rng.random()
        if kind < 0.3:  # any ids
            seq = [rng.randrange(len(VOCAB)) for _ in range(rng.randrange(8))]
        elif kind < 0.6:  # the answer with a few ids changed, cut or extended
            seq = [rng.randrange(len(VOCAB)) if rng.random() < 0.3 else t for t in right][: rng.randrange(len(right) + 1)]
            seq += [rng.randrange(len(VOCAB)) for _ in range(rng.randrange(3))]
        else:  # digits only, then maybe <eos>
            seq = [rng.randrange(3, 13) for _ in range(rng.randrange(5))] + ([EOS] if rng.random() < 0.5 else [])
        problems.append((a, b))
        ids.append(seq)
    new = addition(["p"] * len(ids), ["c"] * len(ids), ids, [str(a + b) for a, b in problems])
    old = [_old_reward(a, b, seq) for (a, b), seq in zip(problems, ids)]
    assert new == old
    assert {1.0, 0.0} < set(old) and len(set(old)) > 5  # exact, wrong and several partial credits were covered
    (fn,) = load_rewards(["addition"])
    assert compute_rewards([fn], prompts=["p"] * 50, completions=["c"] * 50, completion_ids=ids[:50],
                           columns={"answer": [str(a + b) for a, b in problems[:50]]},
                           trainer_state={})[0].tolist() == torch.tensor(old[:50]).tolist()


def test_addition_reward_rejects_ids_outside_its_vocabulary():
    with pytest.raises(RewardError, match=r"'addition' raised ValueError: token id 99 is not in the addition task's"):
        compute_rewards(load_rewards(["addition"]), prompts=["p"], completions=["c"], completion_ids=[[3, 99]],
                        columns={"answer": ["5"]}, trainer_state={})
