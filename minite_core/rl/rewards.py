"""Reward functions, with TRL's signature and rules, so that a user's GRPOTrainer functions run unchanged.

A reward function is `fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]`, called once
per batch with keyword arguments: `prompts` and `completions` in the dataset's format (strings; or message
lists, a completion being `[{"role": "assistant", "content": text}]`), `completion_ids` (lists of token ids),
every other dataset column as a list (one value per completion) and `trainer_state` (step, weight version).
A function without `**kwargs` receives only the columns it names. `async def` functions run concurrently in
one event loop. A `None` value means "does not apply to this sample"; the total reward of a sample is the sum
of weight x value over the functions that apply (TRL's nansum; 0 when none applies).

Functions are named as `path/to/file.py:name` (the file imported by path, relative to the working directory),
`package.module:name`, or a built-in, some taking an argument after "=":
- `exact_match`: 1.0 when the stripped completion equals str(answer), else 0.0;
- `last_number`: the `\\boxed{}` content if any, else the last number of the completion, equals the last number
  of the answer (numerically: "1,000" == "1000.0"; a GSM8K "... #### 72" answer gives 72);
- `boxed`: the last `\\boxed{}` content equals the answer (numerically when both are numbers);
- `format_regex` or `format_regex=<regex>`: 1.0 when the whole stripped completion matches (re.DOTALL); the
  default is the think/answer format `<think>...</think> <answer>...</answer>`;
- `length_penalty=<tokens>`: 0 up to that many completion tokens, then -(tokens - target) / target;
- `addition`: the built-in addition task (minite_core.rl.addition);
- `reasoning_gym`: reasoning-gym's own scorer for the row's dataset (`metadata["source_dataset"]`) on the text
  of the last <answer>...</answer> of the completion (rows from `--dataset reasoning_gym:<name>`).

Anything wrong (not found, not callable, raising, the wrong number of values, NaN, a non-number) is a
`RewardError` naming the function and, where there is one, the sample.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import re
import sys
from fractions import Fraction
from pathlib import Path
from typing import Callable

import torch

F32_MAX = torch.finfo(torch.float32).max
RESERVED = {"prompts", "completions", "completion_ids", "trainer_state"}  # a reward function's own arguments


class RewardError(ValueError):
    """A reward function that cannot be loaded or gave an unusable result; the message names it (and the sample)."""


@dataclasses.dataclass
class RewardFunction:
    name: str  # logged as rewards/<name>/mean
    fn: Callable
    weight: float = 1.0
    is_async: bool = False


# -- loading -----------------------------------------------------------------------------------------------


def load_rewards(specs: list[str], weights: list[float] | None = None) -> list[RewardFunction]:
    """Resolve every spec to a callable (see the module docstring) with its weight (1.0 each by default)."""
    if not specs:
        raise RewardError("no reward function given: name at least one (path/to/file.py:name, package.module:name "
                          f"or a built-in: {', '.join(BUILTINS)})")
    if weights is None:
        weights = [1.0] * len(specs)
    if len(weights) != len(specs):
        raise RewardError(f"{len(weights)} reward weights for {len(specs)} reward functions ({', '.join(specs)}): "
                          "give one weight per function")
    out, seen = [], {}
    for spec, weight in zip(specs, weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise RewardError(f"reward function {spec!r}: weight {weight!r} is not a finite number")
        name, fn = _resolve(spec)
        _check_signature(name, fn)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:  # two functions of one name (e.g. two format_regex patterns) are logged apart
            name = f"{name}_{seen[name]}"
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
        out.append(RewardFunction(name, fn, float(weight), is_async))
    return out


def _resolve(spec: str) -> tuple[str, Callable]:
    head, _, arg = spec.partition("=")
    if head in BUILTINS:
        return head, BUILTINS[head](arg if "=" in spec else None)
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise RewardError(f"reward function {spec!r} not found: expected path/to/file.py:name, package.module:name "
                          f"or a built-in ({', '.join(BUILTINS)})")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = _import_file(spec, where) if is_file else _import_module(spec, where)
    if not hasattr(module, attr):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        raise RewardError(f"reward function {spec!r} not found: {where} has no {attr!r}"
                          + (f" (it defines: {', '.join(defined)})" if defined else ""))
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return attr, fn


_FILES: dict[Path, object] = {}  # a file named by several specs is imported once (its module state is shared)


def _import_file(spec: str, where: str):
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise RewardError(f"reward function {spec!r} not found: no file {where} (from {Path.cwd()})")
    if path not in _FILES:
        name = f"minite_reward_{path.stem}_{abs(hash(path)):x}"
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
        sys.modules[name] = module  # dataclasses, pickling and typing look the module up by name
        try:
            module.__spec__.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise RewardError(f"reward function {spec!r}: importing {where} failed: {type(e).__name__}: {e}") from e
        _FILES[path] = module
    return _FILES[path]


def _import_module(spec: str, where: str):
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name and (where == e.name or where.startswith(e.name + ".")):
            raise RewardError(f"reward function {spec!r} not found: no module {e.name!r} (a file is named "
                              "path/to/file.py:name)") from e
        raise RewardError(f"reward function {spec!r}: importing {where} failed: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise RewardError(f"reward function {spec!r}: importing {where} failed: {type(e).__name__}: {e}") from e


def _check_signature(name: str, fn: Callable) -> None:
    """It must take prompts, completions and completion_ids as keywords (by name, or through **kwargs)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable without a signature: its call will tell
    try:
        sig.bind_partial(prompts=[], completions=[], completion_ids=[])
    except TypeError as e:
        raise RewardError(f"reward function {name!r}{sig} does not take TRL's arguments "
                          f"(prompts, completions, completion_ids, **kwargs): {e}") from e


def required_columns(fn: RewardFunction) -> list[str]:
    """The keyword arguments `fn` needs beyond TRL's three (dataset columns), for a check before the first step."""
    try:
        params = inspect.signature(fn.fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.name not in ("prompts", "completions", "completion_ids")
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_columns(fns: list[RewardFunction], columns) -> None:
    """RewardError when a function needs a column (keyword argument) that the dataset does not have."""
    reserved = sorted(set(columns) & RESERVED)
    if reserved:  # (TRL's call would fail with "got multiple values", blaming the function; or drop the column)
        raise RewardError(f"the dataset has a column named {reserved[0]!r}, which reward functions receive as an "
                          f"argument of their own ({', '.join(sorted(RESERVED))}): rename the column")
    have = set(columns) | {"trainer_state"}
    for f in fns:
        missing = [c for c in required_columns(f) if c not in have]
        if missing:
            raise RewardError(f"reward function {f.name!r} needs the column(s) {', '.join(missing)}, which the dataset "
                              f"does not have (columns: {', '.join(sorted(set(columns))) or 'none'})")


# -- computing ---------------------------------------------------------------------------------------------


def compute_rewards(fns: list[RewardFunction], *, prompts: list, completions: list, completion_ids: list,
                    columns: dict[str, list], trainer_state: dict,
                    row_ids: list | None = None) -> tuple[torch.Tensor, dict[str, list]]:
    """Call every function once on the batch (the async ones concurrently) and combine as TRL does.

    Returns the total reward per sample (float32, sum of weight x value over the values that are not None) and
    each function's values by name (None kept). `row_ids` (optional, one per sample) names the dataset rows in
    errors."""
    n = len(completions)
    lists = {"prompts": prompts, "completion_ids": completion_ids, **{f"column {k!r}": v for k, v in columns.items()}}
    for what, v in lists.items():
        if len(v) != n:
            raise ValueError(f"compute_rewards: {len(v)} {what} for {n} completions")
    kwargs = {**columns, "trainer_state": trainer_state}
    call = dict(prompts=prompts, completions=completions, completion_ids=completion_ids)
    where = functools.partial(_sample, prompts=prompts, row_ids=row_ids)

    outputs: dict[str, object] = {}
    for f in fns:
        if not f.is_async:
            try:
                outputs[f.name] = f.fn(**call, **_accepted(f, kwargs))
            except (Exception, SystemExit) as e:  # (sys.exit() in a reward would end the run without a word)
                raise _raised(f, e, call, kwargs, where) from e
    pending = [f for f in fns if f.is_async]
    if pending:
        results = _run_async([functools.partial(f.fn, **call, **_accepted(f, kwargs)) for f in pending])
        for f, r in zip(pending, results):
            if isinstance(r, BaseException):
                raise _raised(f, r, call, kwargs, where) from r
            outputs[f.name] = r

    per_func = {f.name: _check_values(f, outputs[f.name], n, where) for f in fns}
    values = torch.tensor([[math.nan if v is None else v for v in per_func[f.name]] for f in fns],
                          dtype=torch.float32).reshape(len(fns), n)
    weights = torch.tensor([f.weight for f in fns], dtype=torch.float32)
    total = (values * weights[:, None]).nansum(dim=0)
    bad = torch.nonzero(~torch.isfinite(total)).flatten().tolist()
    if bad:  # each value was finite: the weighted sum overflowed float32 (before anything is logged or trained)
        raise RewardError(f"the weighted reward of {where(bad[0])} is {total[bad[0]].item()} in float32: the rewards "
                          f"{ {f.name: per_func[f.name][bad[0]] for f in fns} } times the weights "
                          f"{ {f.name: f.weight for f in fns} } overflow; scale them down")
    return total, per_func


def _accepted(f: RewardFunction, kwargs: dict) -> dict:
    """All the columns for a function with **kwargs (TRL's call); only those it names otherwise."""
    try:
        params = inspect.signature(f.fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _run_async(calls: list[Callable]) -> list:
    """Await the calls' coroutines concurrently; from sync code in one fresh event loop (in a worker thread when
    this thread already runs a loop). Exceptions, a call's own included, come back as values."""
    async def one(call):
        try:
            return await call()
        except SystemExit as e:  # (asyncio re-raises it from the loop: a value here, as the sync path's)
            return e

    async def gather():
        return await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def _sample(i: int, *, prompts: list, row_ids: list | None) -> str:
    row = f" (dataset row {row_ids[i]})" if row_ids is not None else ""
    text = prompts[i] if isinstance(prompts[i], str) else json.dumps(prompts[i], default=str)
    return f"sample {i}{row}, prompt {text[:80] + '...' if len(text) > 80 else text!r}"


def _raised(f: RewardFunction, e: BaseException, call: dict, kwargs: dict, where) -> RewardError:
    """The error of a raising function, with the first sample that makes it raise on its own (the function is
    called once more on single samples to find it; a batch-level failure names no sample)."""
    if isinstance(e, TypeError) and (missing := [c for c in required_columns(f) if c not in kwargs]):
        return RewardError(f"reward function {f.name!r} needs the column(s) {', '.join(missing)}, which the dataset "
                           f"does not have (columns: {', '.join(sorted(set(kwargs) - {'trainer_state'})) or 'none'})")
    n = len(call["completions"])
    culprit = f" on {where(0)}" if n == 1 else " on the whole batch (no sample raises on its own)"
    for i in range(n) if n > 1 else ():
        one = {k: v[i:i + 1] for k, v in call.items()}
        extra = {k: (v if k == "trainer_state" else v[i:i + 1]) for k, v in _accepted(f, kwargs).items()}
        try:
            r = _run_async([functools.partial(f.fn, **one, **extra)])[0] if f.is_async else f.fn(**one, **extra)
            if isinstance(r, BaseException):
                raise r
        except (Exception, SystemExit):
            culprit = f" on {where(i)}"
            break
    return RewardError(f"reward function {f.name!r} raised {type(e).__name__}{f': {e}' if str(e) else ''}{culprit}")


def _check_values(f: RewardFunction, out, n: int, where) -> list:
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        raise RewardError(f"reward function {f.name!r} returned {type(out).__name__} {_short(out)}, "
                          f"expected a list of {n} floats (or None)")
    if isinstance(out, torch.Tensor) or hasattr(out, "tolist"):
        out = out.tolist()
    values = list(out)
    if len(values) != n:
        raise RewardError(f"reward function {f.name!r} returned {len(values)} values for {n} completions")
    for i, v in enumerate(values):
        if v is None:
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if not isinstance(v, numbers.Real):
            raise RewardError(f"reward function {f.name!r} returned {type(v).__name__} {_short(v)} for {where(i)}: "
                              "expected a float or None")
        try:
            v = float(v)
        except OverflowError:  # (an int beyond any float)
            v = math.inf
        if not math.isfinite(v) or abs(v) > F32_MAX:
            raise RewardError(f"reward function {f.name!r} returned {_short(v)} for {where(i)}: expected a finite "
                              f"float within float32's range (|r| <= {F32_MAX:.3g}; None when it does not apply)")
        values[i] = v
    return values


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


# -- built-ins ---------------------------------------------------------------------------------------------


def completion_text(completion) -> str:
    """A completion's text: the string itself, or the contents of its messages (conversational format)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                            for m in completion):
        return "".join(m["content"] for m in completion)
    raise TypeError(f"a completion is a string or a list of {{'role', 'content'}} messages, not {_short(completion)}")


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")


def _number(text: str) -> Fraction | None:
    """The last number in `text` ("1,000", "-2.50", "3/4"), exactly; None when there is none."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return Fraction(found[-1].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces allowed); None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return None


def _no_arg(name: str, make: Callable) -> Callable:
    def builtin(arg):
        if arg is not None:
            raise RewardError(f"built-in reward {name!r} takes no argument (got {name}={arg})")
        return make()
    return builtin


def exact_match(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def _gold(a) -> Fraction:
    want = _number(_boxed(str(a)) or str(a))
    if want is None:
        raise ValueError(f"answer {_short(a)} holds no number")
    return want


def last_number(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    out = []
    for c, a in zip(completions, answer):
        text = completion_text(c)
        got = _number(_boxed(text) or text)
        out.append(float(got is not None and got == _gold(a)))
    return out


def boxed(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    out = []
    for c, a in zip(completions, answer):
        got, want = _boxed(completion_text(c)), _boxed(str(a)) or str(a).strip()
        if got is None:
            out.append(0.0)
        elif _NUMBER.fullmatch(got) and _NUMBER.fullmatch(want):
            out.append(float(_number(got) == _number(want)))
        else:
            out.append(float(got.replace(" ", "") == want.replace(" ", "")))
    return out


THINK_ANSWER = r"<think>.*?</think>\s*<answer>.*?</answer>"


def format_regex(arg: str | None) -> Callable:
    try:
        pattern = re.compile(arg if arg else THINK_ANSWER, re.DOTALL)
    except re.error as e:
        raise RewardError(f"built-in reward 'format_regex': {arg!r} is not a regular expression: {e}") from e

    def format_regex(prompts, completions, completion_ids, **kwargs) -> list[float]:
        return [float(pattern.fullmatch(completion_text(c).strip()) is not None) for c in completions]
    return format_regex


def length_penalty(arg: str | None) -> Callable:
    try:
        target = int(arg)
        assert target > 0
    except (TypeError, ValueError, AssertionError):
        raise RewardError(f"built-in reward 'length_penalty' needs a positive number of tokens: "
                          f"length_penalty=256 (got {'no argument' if arg is None else repr(arg)})") from None

    def length_penalty(prompts, completions, completion_ids, **kwargs) -> list[float]:
        return [-max(0, len(ids) - target) / target for ids in completion_ids]
    return length_penalty


def gym_score(prompts, completions, completion_ids, answer, metadata, question=None, **kwargs) -> list[float]:
    from reasoning_gym import get_score_answer_fn
    from reasoning_gym.utils import extract_answer

    scorers: dict[str, Callable] = {}
    out = []
    for i, (c, a, meta) in enumerate(zip(completions, answer, metadata)):
        meta = json.loads(meta) if isinstance(meta, str) else meta
        name = meta["source_dataset"]
        if name not in scorers:
            scorers[name] = get_score_answer_fn(name)
        entry = {"question": question[i] if question is not None else None, "answer": a, "metadata": meta}
        out.append(float(scorers[name](extract_answer(completion_text(c)), entry)))
    return out


def _reasoning_gym():
    try:
        import reasoning_gym as _  # noqa: F401
    except ImportError as e:
        raise RewardError("built-in reward 'reasoning_gym' needs reasoning-gym: pip install 'minite[gym]'") from e
    return gym_score


def _addition():
    from .addition import addition
    return addition


BUILTINS: dict[str, Callable[[str | None], Callable]] = {
    "exact_match": _no_arg("exact_match", lambda: exact_match),
    "last_number": _no_arg("last_number", lambda: last_number),
    "boxed": _no_arg("boxed", lambda: boxed),
    "format_regex": format_regex,
    "length_penalty": length_penalty,
    "addition": _no_arg("addition", _addition),
    "reasoning_gym": _no_arg("reasoning_gym", _reasoning_gym),
}
