"""Durable trajectories: a write-ahead log of each step's completions, and atomic checkpoints.

A learner can die at any instant (SIGKILL, a lost node). Two promises survive it:

* every trajectory is used exactly once: a step's completions are appended to the log and fsync'd
  *before* the step trains on them (the append is the acknowledgement), and a checkpoint records the
  last step it contains. On restart the learner loads the checkpoint and replays the logged batches of
  the steps after it instead of sampling new ones, so a batch that was sampled is neither lost nor
  trained on twice. The replayed steps repeat the lost ones exactly (same masters, same batch, a
  deterministic optimizer), so the resumed run ends with the bits of an uninterrupted one. Records of
  steps a checkpoint already holds are dropped when the checkpoint is written; a torn last line (the
  process died mid-append) was never acknowledged and is ignored: that step samples again.
* a checkpoint is never half written: it is written to a fresh directory, fsync'd, then swapped in by
  renames; a crash between the renames leaves the previous one at `<dir>.old`, which `candidates` finds.

One JSON line per step: {"step", "rows" (the dataset rows drawn), "completions": [{prompt_ids, token_ids,
logprobs, finish_reason, weight_version, request_index, sample_index}], "rewards": {"total": [...],
"per_function": {name: [... or null]}}}. The rewards are recorded with the batch, so reward functions
run once per trajectory (a replayed step does not call them again, and a non-deterministic or remote
reward cannot change a replay). Logprobs and rewards are float32 / float64 values written as Python
floats, which round-trip exactly.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..engine import Completion


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TrajectoryLog:
    """Append-only log of step batches in `path` (one JSON line per step)."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records = self._read()

    def _read(self) -> dict[int, dict]:
        if not self.path.exists():
            return {}
        out = {}
        lines = self.path.read_bytes().split(b"\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if i >= len(lines) - 2:  # a torn last append: never acknowledged
                    break
                raise ValueError(f"{self.path}: line {i + 1} is corrupt (not a torn last line)") from None
            out[rec["step"]] = rec
        return out

    def get(self, step: int) -> dict | None:
        return self.records.get(step)

    def append(self, step: int, rows: list[int], completions: list[Completion], rewards: dict) -> None:
        """Record a step's batch and its rewards durably (returns after fsync)."""
        if step in self.records:
            raise ValueError(f"step {step} is already in the trajectory log")
        rec = {"step": step, "rows": list(rows), "rewards": rewards,
               "completions": [{"prompt_ids": list(c.prompt_ids), "token_ids": list(c.token_ids),
                                "logprobs": c.logprobs.tolist(), "finish_reason": c.finish_reason,
                                "weight_version": c.weight_version, "request_index": c.request_index,
                                "sample_index": c.sample_index} for c in completions]}
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        with open(self.path, "ab") as f:
            if f.tell() and not self._ends_with_newline():
                f.write(b"\n")  # a torn line before this one: keep ours on a line of its own
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records[step] = rec

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def drop_through(self, step: int) -> None:
        """Forget the records of steps <= `step` (a checkpoint holds them now): rewrite atomically."""
        keep = {s: r for s, r in self.records.items() if s > step}
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            for s in sorted(keep):
                f.write((json.dumps(keep[s], separators=(",", ":")) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self.records = keep

    @staticmethod
    def completions(rec: dict) -> list[Completion]:
        return [Completion(c["prompt_ids"], c["token_ids"], torch.tensor(c["logprobs"], dtype=torch.float32),
                           c["finish_reason"], c["weight_version"], c["request_index"], c["sample_index"])
                for c in rec["completions"]]


def write_atomically(path, write, group=None) -> None:
    """Call write(tmp_dir) to fill a fresh directory, fsync it, then put it at `path` by renames: readers
    (`candidates`) see the old checkpoint or the new one, never a mix; the old one stays as `<path>.prev`. With a data-parallel `group`
    (distributed.Group) every rank calls this: rank 0 prepares and swaps, every rank writes its part."""
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    lead = group is None or group.leader
    if lead:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if group is not None:
        group.barrier()
    write(tmp)
    if group is not None:
        group.barrier()
    if lead:
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(path.parent)
        if old.exists():  # the previous checkpoint: the fallback when the new one cannot be read later
            prev = path.with_name(path.name + ".prev")
            shutil.rmtree(prev, ignore_errors=True)
            os.rename(old, prev)
            _fsync_dir(path.parent)
    if group is not None:
        group.barrier()


def newest_readable(path, read, error: type[Exception], on_skip=None):
    """(checkpoint, read(checkpoint)) for the newest of `candidates(path)` that `read` accepts (it raises `error`
    for one that cannot be read; `on_skip(checkpoint, exc)` hears of each); None when there is none; `error`
    naming every problem when none can be read. `--resume` and `minite export` both walk the checkpoints so."""
    problems = []
    for ckpt in candidates(path):
        try:
            return ckpt, read(ckpt)
        except error as e:
            problems.append(str(e))
            if on_skip is not None:
                on_skip(ckpt, e)
    if problems:
        raise error("no checkpoint of this run can be read: " + "; ".join(problems))
    return None


def candidates(path) -> list[Path]:
    """The checkpoint directories to resume from, newest first: `path` (or `<path>.old` if a crash fell
    between the renames), then `<path>.prev`, the one before."""
    path = Path(path)
    return [p for p in (path, path.with_name(path.name + ".old"), path.with_name(path.name + ".prev"))
            if (p / "trainer.json").exists()]
