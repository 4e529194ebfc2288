"""What an RL run trains on: prompts, how they become token ids, and how completions are rewarded.

A `Task` is three things the trainer asks for, and nothing else is task-specific in the loop:

* `draw(step, count)`: the step's prompts. Rows come from (seed, step, index) alone: position
  p = (step - 1) * count + index walks the dataset in the order of a seeded permutation per epoch
  (epoch = p // rows), so a retried or replayed step draws the same rows, without saved RNG state;
* `score(samples, completions, step, version)`: one reward per completion (and each function's own);
* `eval_samples()`: the fixed prompts that evaluation uses.

`DatasetTask` is the one implementation for files and built-in sources: rows with a `prompt` column
(TRL's two formats: *standard*, a string used as is; *conversational*, a list of {"role", "content"}
messages rendered with the model's chat template and its generation prompt), every other column handed
to the reward functions, rewards with TRL's signature (rewards.py). Prompts longer than
`max_prompt_length` tokens are skipped and counted, never cut. The built-in addition task is a dataset
source (`addition`), a reward function (`addition`) and the tiny model's character tokenizer: it goes
through this same door. A user's own task implements the protocol and is named by `--task
package.module:factory` (factory(cfg, tokenizer) -> Task).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Any, Protocol, Sequence

import torch

from ..engine import Completion
from . import data, rewards
from .config import RunConfig

log = logging.getLogger("minite.task")

DEFAULT_COMPLETION_LENGTH = 256


@dataclasses.dataclass
class Sample:
    """One prompt of a step: as the dataset holds it, as token ids, its other columns, and its row."""
    prompt: str | list
    prompt_ids: list[int]
    columns: dict
    row: int


@dataclasses.dataclass
class Scores:
    total: torch.Tensor  # [completions]: the weighted sum of the functions' rewards (None counts 0)
    per_function: dict[str, list]  # name -> one value (or None) per completion


class Task(Protocol):
    max_completion_length: int
    stop_token_ids: tuple[int, ...]

    def draw(self, step: int, count: int) -> list[Sample]: ...

    def score(self, samples: list[Sample], completions: list[Completion], *, step: int, version: int) -> Scores: ...

    def eval_samples(self) -> list[Sample]: ...


class TaskError(ValueError):
    """A task that cannot run as configured (the message names the dataset, row or function)."""


def _order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63))
    return torch.randperm(n, generator=g).tolist()


class DatasetTask:
    def __init__(self, cfg: RunConfig, tokenizer, context: int):
        if tokenizer is None:
            raise TaskError(f"{cfg.model_path} has no tokenizer.json: a dataset task needs the model's tokenizer")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.stop_token_ids = tuple(cfg.stop_token_ids) if cfg.stop_token_ids is not None else tuple(tokenizer.eos_token_ids)
        if not self.stop_token_ids and cfg.stop_token_ids is not None:
            raise TaskError("stop_token_ids is empty: a completion would never stop before max_completion_length; "
                            "leave it out to stop at the tokenizer's eos id(s)")
        if not self.stop_token_ids:
            raise TaskError(f"{cfg.model_path}: the tokenizer has no eos id (generation_config.json eos_token_id, "
                            "config.json eos_token_id or tokenizer_config.json eos_token): set stop_token_ids")
        rows = data.load_rows(cfg.dataset)
        self.format = data.prompt_format(rows)
        specs = cfg.reward or data.default_reward(cfg.dataset)
        if not specs:
            raise TaskError(f"no reward function: give --reward (the dataset {cfg.dataset!r} has none of its own)")
        self.rewards = rewards.load_rewards(specs, cfg.reward_weights)
        rewards.check_columns(self.rewards, _columns(rows))  # before the first step, not in it
        builtin = _builtin(cfg.dataset)
        self.max_completion_length = cfg.max_completion_length or builtin.get("completion_length",
                                                                             DEFAULT_COMPLETION_LENGTH)
        budget = min(cfg.max_prompt_length, context - self.max_completion_length)
        if budget < 1:
            raise TaskError(f"max_completion_length {self.max_completion_length} leaves no room for a prompt in the "
                            f"model's context of {context} tokens")
        self.rows, self.ids, self.kept = rows, {}, []
        for i in range(len(rows)):
            ids = self._render(rows[i], i, cfg.dataset)
            if not ids:
                raise TaskError(f"{cfg.dataset}: row {i}: the prompt is empty (no tokens)")
            if len(ids) <= budget:
                self.ids[i] = ids
                self.kept.append(i)
        skipped = len(rows) - len(self.kept)
        if not self.kept:
            raise TaskError(f"{cfg.dataset}: every one of its {len(rows)} prompts is longer than {budget} tokens "
                            f"(max_prompt_length {cfg.max_prompt_length}, context {context} - max_completion_length "
                            f"{self.max_completion_length})")
        if skipped:
            log.warning("%s: skipped %d of %d prompts longer than %d tokens", cfg.dataset, skipped, len(rows), budget)
        self.skipped = skipped
        self.budget = budget
        if cfg.eval_dataset is not None:
            self.eval_rows, self.eval_source = data.load_rows(cfg.eval_dataset), cfg.eval_dataset
            if len(self.eval_rows) and data.prompt_format(self.eval_rows) != self.format:  # (the rewards see one kind)
                raise TaskError(f"eval dataset {cfg.eval_dataset}: its prompts are {data.prompt_format(self.eval_rows)} "
                                f"but {cfg.dataset}'s are {self.format}: the reward functions see one format")
            try:
                rewards.check_columns(self.rewards, _columns(self.eval_rows))
            except rewards.RewardError as e:
                raise TaskError(f"eval dataset {cfg.eval_dataset}: {e}") from None
        else:
            self.eval_rows, self.eval_source = builtin.get("eval", []), f"{cfg.dataset} (its evaluation set)"

    # -- prompts ---------------------------------------------------------------------------------
    def _render(self, row: dict, i: int, source: str) -> list[int]:
        prompt = row["prompt"]
        try:
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt, add_special_tokens=False)
            return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, **self.cfg.chat_template_kwargs)
        except ValueError as e:
            raise TaskError(f"{source}: row {i}: the prompt cannot be rendered: {e}") from None

    def _sample(self, rows: Sequence[dict], i: int, ids: list[int] | None = None, source: str = "") -> Sample:
        row = rows[i]
        return Sample(prompt=row["prompt"], prompt_ids=ids if ids is not None else self._render(row, i, source),
                      columns={k: v for k, v in row.items() if k != "prompt"}, row=i)

    def draw(self, step: int, count: int) -> list[Sample]:
        n = len(self.kept)
        out = []
        for index in range(count):
            p = (step - 1) * count + index
            r = self.kept[self._epoch(p // n)[p % n]]
            out.append(self._sample(self.rows, r, self.ids[r]))
        return out

    @functools.lru_cache(maxsize=4)
    def _epoch(self, epoch: int) -> list[int]:
        return _order(len(self.kept), self.cfg.seed, epoch)

    @functools.cache
    def eval_samples(self) -> list[Sample]:  # (the same every evaluation: rendered and checked once)
        out, rows = [], min(len(self.eval_rows), self.cfg.eval_max_rows)
        for i in range(rows):
            s = self._sample(self.eval_rows, i, source=self.eval_source)
            if not s.prompt_ids:
                raise TaskError(f"{self.eval_source}: row {i}: the prompt is empty (no tokens)")
            if len(s.prompt_ids) <= self.budget:
                out.append(s)
        if rows and not out:
            raise TaskError(f"{self.eval_source}: every one of its {rows} evaluated prompts is longer than "
                            f"{self.budget} tokens (max_prompt_length {self.cfg.max_prompt_length}, context - "
                            f"max_completion_length {self.max_completion_length})")
        if len(out) < rows:
            log.warning("%s: skipped %d of %d evaluation prompts longer than %d tokens", self.eval_source,
                        rows - len(out), rows, self.budget)
        return out

    # -- completions -------------------------------------------------------------------------------
    def completion_text(self, c: Completion) -> str:
        text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        for s in self.cfg.stop:
            at = text.find(s)
            if at >= 0:
                text = text[:at]
        return text

    def score(self, samples: list[Sample], completions: list[Completion], *, step: int, version: int) -> Scores:
        conversational = self.format == "conversational"
        rows = [samples[c.request_index] for c in completions]
        texts = [self.completion_text(c) for c in completions]
        columns: dict[str, list[Any]] = {}
        for k in rows[0].columns if rows else ():
            columns[k] = [r.columns.get(k) for r in rows]
        total, per = rewards.compute_rewards(
            self.rewards, prompts=[r.prompt for r in rows],
            completions=[[{"role": "assistant", "content": t}] for t in texts] if conversational else texts,
            completion_ids=[list(c.token_ids) for c in completions], columns=columns,
            trainer_state={"step": step, "weight_version": version}, row_ids=[r.row for r in rows])
        return Scores(total=total.float(), per_function=per)


def _columns(rows: Sequence[dict]) -> set[str]:
    """The columns besides `prompt` (every row has all of them: data.py fills the missing with None)."""
    return set(rows[0]) - {"prompt"} if len(rows) else set()


def _builtin(spec: str) -> dict:
    """What a built-in source brings besides its rows: its completion length and its evaluation set."""
    name, _, arg = spec.partition(":")
    if name == "addition" and not spec.endswith((".jsonl", ".json", ".csv", ".parquet")):
        from .addition import addition_eval_rows

        digits = int(arg) if arg.isdigit() else 2
        return {"completion_length": digits + 2, "eval": addition_eval_rows(digits)}
    return {}


def cut_at_stop(c: Completion, tokenizer, stops: Sequence[str]) -> Completion:
    """The completion ended at the token that completes the first stop string (the tokens sampled after it
    are dropped, with their logprobs, as if sampling had stopped there)."""
    if not stops or not any(s in tokenizer.decode(c.token_ids, skip_special_tokens=True) for s in stops):
        return c  # (the common case, one decode; the prefix search below only runs on a completion that stops)
    for n in range(1, len(c.token_ids) + 1):
        text = tokenizer.decode(c.token_ids[:n], skip_special_tokens=True)
        if any(s in text for s in stops):
            if n == len(c.token_ids):
                return c
            return dataclasses.replace(c, token_ids=list(c.token_ids[:n]), logprobs=c.logprobs[:n].clone(),
                                       finish_reason="stop")
    return c


def make_task(cfg: RunConfig, tokenizer, context: int) -> Task:
    """The run's task: `cfg.task` (package.module:factory(cfg, tokenizer) -> Task) or a DatasetTask."""
    if cfg.task is None:
        return DatasetTask(cfg, tokenizer, context)
    module, _, name = cfg.task.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise TaskError(f"task {cfg.task!r} not found: {e}") from None
    except Exception as e:  # the module itself fails (a syntax error, an import-time error)
        raise TaskError(f"importing the task {cfg.task!r} failed: {type(e).__name__}: {e}") from None
    try:
        task = factory(cfg, tokenizer)
    except TaskError:
        raise
    except Exception as e:  # (a wrong signature, an error of its own: named, not a traceback)
        raise TaskError(f"task factory {cfg.task!r} raised {type(e).__name__}: {e} (it is called as "
                        "factory(cfg, tokenizer))") from None
    for attr in ("draw", "score", "eval_samples", "max_completion_length", "stop_token_ids"):
        if not hasattr(task, attr):
            raise TaskError(f"task {cfg.task!r} returned {type(task).__name__}, which has no {attr!r} (see Task)")
    return task
