"""The run loop: steps, evaluation, checkpoints, the trajectory log and the report, for `minite train` and
the learner service alike.

`run(cfg)` trains for cfg.steps steps (continuing from the run directory's checkpoint with `resume`),
evaluates before the first step, every `eval_steps` and after the last, checkpoints every
`checkpoint_every` steps and when `stop()` ends it early, and writes metrics.jsonl, summary.json and
reward_drift.png (report.py). On a data-parallel learner every rank calls run(); rank 0 runs the loop and
names each collective step.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from . import report
from .config import ConfigError, RunConfig
from .data import DataError
from .rewards import RewardError
from .state import CheckpointError, RunDirInUse
from .task import TaskError
from .trainer import ReplayMismatch, Trainer
from .wal import TrajectoryLog, newest_readable

log = logging.getLogger("minite.train")

# What a run's own inputs cause (its data, reward functions, task, settings, run directory): reported as
# one line that names the file, row or function, never as a traceback.
RUN_ERRORS = (ConfigError, DataError, RewardError, TaskError, CheckpointError, ReplayMismatch, RunDirInUse)


def run(cfg: RunConfig, *, resume: bool | None = None, progress: bool = True, rollout=None, on_step=None,
        on_eval=None, trainer: Trainer | None = None, retry=None, stop=None) -> list[dict]:
    """Returns the metrics of each step. For the learner service: `rollout` (see Trainer), `on_step(trainer,
    metrics)` after every step, `on_eval(metrics)` after every evaluation, `retry(exc) -> bool` to take the
    step again after a failure it recognizes (a replica down, a stale version), `stop() -> bool` to end early."""
    if Path(cfg.run_dir).exists() and not Path(cfg.run_dir).is_dir():
        raise ConfigError(f"run directory {cfg.run_dir} is a file, not a directory")
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    trainer = trainer or Trainer(cfg, rollout)
    if not trainer.leader:  # rank 0 runs the loop below and names each collective step
        trainer.follow()
        return []
    try:
        return _lead(cfg, trainer, cfg.resume if resume is None else resume, progress, on_step, on_eval, retry, stop)
    finally:
        trainer.end()


def _lead(cfg: RunConfig, trainer: Trainer, resume: bool, progress, on_step, on_eval, retry, stop) -> list[dict]:
    run_dir = Path(cfg.run_dir)
    metrics_file, wal_file, summary_file = run_dir / "metrics.jsonl", run_dir / "trajectories.wal", run_dir / "summary.json"
    checkpoint = _resume_from(trainer, run_dir / "checkpoint") if resume else None
    if checkpoint is not None:
        kept = [m for m in report.read_jsonl(metrics_file) if m["step"] <= trainer.step_idx]
        metrics_file.write_text("".join(json.dumps(m) + "\n" for m in kept))
    else:
        metrics_file.write_text("")
        if not resume:  # (resume without a checkpoint: a crash before the first one; its batches replay from step 1)
            wal_file.unlink(missing_ok=True)
            (run_dir / "calibration.json").unlink(missing_ok=True)
        elif not wal_file.exists():  # (a mistyped --run-dir would otherwise start afresh without a word)
            log.warning("--resume: %s holds no checkpoint and no trajectory log: starting at step 1", run_dir)
    trainer.wal = TrajectoryLog(wal_file)
    pending = sorted(s for s in trainer.wal.records if s > trainer.step_idx)
    if pending:
        log.info("resuming at step %d: replaying the logged batches of steps %s", trainer.step_idx + 1, pending)
    history = report.read_jsonl(metrics_file)
    summary = json.loads(summary_file.read_text()) if checkpoint is not None and summary_file.exists() else {}

    def retrying(fn):
        while True:
            try:
                return fn()
            except Exception as e:
                if retry is None or not retry(e):
                    raise

    def evaluate() -> dict:
        m = retrying(trainer.evaluate)
        if m and on_eval is not None:
            on_eval(m)
        return m

    if "before" not in summary:
        summary["before"] = evaluate()
        summary_file.write_text(json.dumps(summary, indent=1))  # a resumed run keeps the first "before"
    bar = report.progress(progress)
    with bar:
        task = bar.add_task("GRPO", total=cfg.steps, completed=trainer.step_idx)
        while trainer.step_idx < cfg.steps and not (stop is not None and stop()):
            try:
                m = trainer.step()
            except Exception as e:
                if retry is not None and retry(e):
                    continue
                raise
            last = trainer.step_idx == cfg.steps
            if cfg.eval_steps and trainer.step_idx % cfg.eval_steps == 0 or last:
                m.update(evaluate())
            history.append(m)
            if on_step is not None:
                on_step(trainer, m)
            with metrics_file.open("a") as f:
                f.write(json.dumps(m) + "\n")
            bar.update(task, completed=trainer.step_idx, description=report.describe(m))
            if trainer.step_idx % cfg.checkpoint_every == 0 or last:
                trainer.checkpoint(run_dir / "checkpoint")
    if trainer.step_idx < cfg.steps:  # stopped early (a service shutting down, `minite train` interrupted)
        if trainer.step_idx > trainer.checkpoint_step:  # keep the steps done: `--resume` continues after them
            trainer.checkpoint(run_dir / "checkpoint")
        return history
    summary["after"] = {k: v for k, v in (history[-1] if history else {}).items() if k.startswith("eval/")} \
        if history and trainer.step_idx == history[-1]["step"] else evaluate()
    summary["steps"] = trainer.step_idx
    summary_file.write_text(json.dumps(summary, indent=1))
    report.plot(history, run_dir / "reward_drift.png", summary.get("before"), title=f"GRPO on {cfg.dataset}")
    return history


def _resume_from(trainer: Trainer, path: Path) -> Path | None:
    """Load the newest checkpoint that can be read (a warning names each one that cannot); None when there is
    none; CheckpointError naming every file when none of them can be read."""
    skipped = []

    def skip(ckpt, e):
        skipped.append(ckpt)
        log.warning("cannot resume from %s (%s); trying the checkpoint before it", ckpt, e)

    found = newest_readable(path, trainer.load, CheckpointError, skip)
    if found is None:
        return None
    if skipped:
        log.warning("resumed from the previous checkpoint %s (step %d); the trajectory log replays the steps "
                    "after it", found[0], trainer.step_idx)
    return found[0]
