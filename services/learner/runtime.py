"""The learner service's state: the GRPO Trainer over remote rollout replicas, run on a background
thread, and the scoring both APIs offer.

The loop waits for a rollout replica, then runs `minite_core.rl.loop.run` (the same loop as
`minite train`, on the same RunConfig): each step pulls completions for the task's prompts from the replicas, scores them with the
learner engine, records every token's drift, takes a GRPO step and pushes the re-quantized packed
NVFP4 weights to every replica; each step's metrics go to metrics.jsonl (the loop) and to Prometheus
(`LearnerMetrics.record_step`: the same keys). A replica that is down makes the step wait and retry (reported in
Status and the log), never crash. Score and SubmitTrajectories use the same learner engine under the
same lock as the step, so they see one weight version at a time.

Fair share: scoring holds the lock SCORE_BATCH rows at a time, not for a whole batch, and a row group waits
while the training loop is waiting for the lock (`CountedLock.acquire_behind`): a step waits for at most the row group in
progress of each scoring call, and every scoring call still gets a row group between two steps.
"""
from __future__ import annotations

import logging
import math
import threading
import time

import torch

from minite_core.consistency import drift_stats
from minite_core.engine import check_temperature
from minite_core.rl.loop import RUN_ERRORS, run
from minite_core.rl.trainer import StaleRollout, Trainer

from ..common.metrics import LearnerMetrics
from ..common.turns import CountedLock
from .replicas import NewerVersion, RemoteRollout, ReplicaError

log = logging.getLogger("minite.learner")
SCORE_BATCH = 64  # sequences per learner forward in score_batch


class StaleVersion(ValueError):
    """Trajectories sampled at a weight version other than the learner's."""


class UnknownVersion(LookupError):
    """A weight version the learner no longer keeps (or never had)."""


class _LockedTrainer(Trainer):
    """A Trainer whose steps hold the runtime's lock (Score and SubmitTrajectories run between steps),
    taken ahead of scoring calls (CountedLock.acquire_behind)."""

    def __init__(self, cfg, rollout, lock, turn: CountedLock):
        self.lock, self.turn = lock, turn
        super().__init__(cfg, rollout)

    def step(self) -> dict:
        self.turn.acquire()
        try:
            return super().step()
        finally:
            self.lock.release()


class LearnerRuntime:
    def __init__(self, settings, metrics: LearnerMetrics | None = None):
        self.settings = settings
        self.metrics = metrics or LearnerMetrics()
        self.cfg = settings  # (a RunConfig: the run's knobs, read by `minite train` the same way)
        self.rollout = RemoteRollout(settings.rollout, settings, self.metrics)
        self.lock = threading.RLock()  # one of: a GRPO step, a Score row group, a SubmitTrajectories batch
        self.turn = CountedLock(self.lock)  # a waiting training step goes before scoring
        self.trainer = _LockedTrainer(self.cfg, self.rollout, self.lock, self.turn)
        self.metrics.weight_version.set(self.trainer.version)
        self.last = {}
        self.last_error = ""
        self.running = self.done = False
        self.paused = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="learner", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def version(self) -> int:
        return self.trainer.version

    # -- the loop ---------------------------------------------------------------------------------
    def _retry(self, e: Exception) -> bool:
        if isinstance(e, NewerVersion):  # re-quantize and push above the replicas' version
            with self.lock:
                self.trainer.sync_weights()
            self.metrics.weight_version.set(self.trainer.version)
            return not self.stopping.is_set()
        if isinstance(e, (ReplicaError, StaleRollout)):
            self.last_error = str(e)
            log.warning("step %d waits: %s", self.trainer.step_idx + 1, e)
            self.stopping.wait(1.0)
            return not self.stopping.is_set()
        return False

    def _stop(self) -> bool:
        while self.paused.is_set() and not self.stopping.is_set():
            time.sleep(0.1)
        return self.stopping.is_set()

    def _on_step(self, trainer, m: dict) -> None:
        diffs, stats = trainer.last_drift
        self.metrics.record_drift(diffs.tolist(), stats)
        self.metrics.record_step(m)  # tokens, steps, reward(s), loss, KL, entropy, grad norm, clip ratio, step time
        self.metrics.weight_version.set(trainer.version)
        self.last = m
        self.last_error = ""
        log.info("step %d: reward %.3f, max |Δlogp| %g, %d tokens, weight version %d", m["step"], m["reward"],
                 stats.max_abs_diff, m["tokens"], trainer.version)

    def _loop(self) -> None:
        while not self.stopping.is_set():  # wait for a replica before the first step
            try:
                self.rollout.live()
                break
            except NewerVersion as e:
                self._retry(e)
            except ReplicaError as e:
                self.last_error = str(e)
                log.warning("waiting for a rollout replica: %s", e)
                self.stopping.wait(1.0)
        if self.stopping.is_set() or self.cfg.steps == 0:
            self.done = True
            self.trainer.end()  # (a data-parallel learner: the other ranks leave)
            return
        self.running = True
        try:
            run(self.cfg, resume=True, progress=False, trainer=self.trainer, on_step=self._on_step,
                on_eval=self.metrics.record_eval, retry=self._retry, stop=self._stop)
            self.done = not self.stopping.is_set()
            if self.done:
                log.info("training finished: %d steps, weight version %d", self.trainer.step_idx, self.trainer.version)
            else:
                log.info("stopped at step %d, weight version %d", self.trainer.step_idx, self.trainer.version)
        except Exception as e:  # report, keep serving Score/Status
            if self.stopping.is_set():  # a step cut by the shutdown (its replica calls cancelled)
                log.info("stopped during step %d: %s", self.trainer.step_idx + 1, e)
                return
            self.last_error = f"{type(e).__name__}: {e}"
            if isinstance(e, RUN_ERRORS):  # the run's data, rewards or settings: the message says what and where
                log.error("the training loop stopped: %s", e)
            else:
                log.exception("the training loop stopped")
        finally:
            self.running = False

    # -- scoring ----------------------------------------------------------------------------------
    def _check(self, prompt: list[int], completion: list[int]) -> None:
        vocab = self.trainer.policy.cfg.vocab_size
        if not prompt or not completion:
            raise ValueError("prompt and completion token ids must be non-empty")
        bad = [t for t in list(prompt) + list(completion) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of the vocabulary [0, {vocab})")
        if len(prompt) + len(completion) > self.trainer.policy.cfg.max_position_embeddings:
            raise ValueError(f"{len(prompt) + len(completion)} tokens exceed the model's context of "
                             f"{self.trainer.policy.cfg.max_position_embeddings}")

    def check_trajectory(self, t: dict, i: int = 0) -> None:
        """Refuse a trajectory that cannot be scored or would poison the drift metrics (ValueError)."""
        try:
            self._check(t["prompt_ids"], t["completion_ids"])
            check_temperature(t["temperature"])
        except ValueError as e:
            raise ValueError(f"trajectory {i}: {e}") from None
        lps = t["rollout_logprobs"]
        if len(lps) != len(t["completion_ids"]):
            raise ValueError(f"trajectory {i}: {len(lps)} logprobs for {len(t['completion_ids'])} completion tokens")
        if not all(math.isfinite(x) and x <= 0 for x in lps):
            raise ValueError(f"trajectory {i}: rollout logprobs must be finite and <= 0")
        if not math.isfinite(t["reward"]):
            raise ValueError(f"trajectory {i}: reward must be finite, got {t['reward']!r}")

    def score(self, prompt: list[int], completion: list[int], temperature: float = 1.0,
              version: int = 0) -> tuple[list[float], int]:
        """The learner's logprobs of `completion` at weight `version` (0: the current one; an older one
        while it is among the last `keep_versions` pushed, else UnknownVersion)."""
        return self.score_batch([(prompt, completion, temperature, version)])[0]

    def score_batch(self, items: list[tuple]) -> list[tuple[list[float], int]]:
        """score() for many (prompt, completion, temperature, version) items: grouped by version and
        temperature, scored SCORE_BATCH rows at a time (a row's bits do not depend on its batch)."""
        for i, (prompt, completion, temperature, _) in enumerate(items):
            try:
                self._check(prompt, completion)
                check_temperature(temperature)
            except ValueError as e:
                raise ValueError(f"item {i}: {e}" if len(items) > 1 else str(e)) from None
        out: list = [None] * len(items)
        self.turn.acquire_behind()  # (held on for the first row group)
        try:  # resolve every item's version once, so a step between two row groups changes nothing
            current = self.trainer.version
            groups: dict = {}
            for i, (_, _, temperature, version) in enumerate(items):
                groups.setdefault((version if version not in (0, current) else current, temperature or 1.0), []).append(i)
            # (a step replaces the policy's tensors, never writes into them: this dict stays version `current`)
            weights = {v: dict(self.trainer.policy.w) if v == current else self._kept(v) for v, _ in groups}
        except BaseException:
            self.lock.release()
            raise
        first = True
        for (version, temperature), idx in groups.items():
            for k in range(0, len(idx), SCORE_BATCH):
                part = idx[k:k + SCORE_BATCH]
                if not first:  # one row group per turn: a waiting training step goes first
                    self.turn.acquire_behind()
                first = False
                try:
                    with torch.no_grad(), self.trainer.policy.using(weights[version]):
                        lps = self.trainer.learner.batch_logprobs([items[i][0] for i in part],
                                                                  [items[i][1] for i in part], temperature)
                finally:
                    self.lock.release()
                for i, lp in zip(part, lps):
                    out[i] = (lp.tolist(), version)
        return out

    def _kept(self, version: int) -> dict:
        weights = self.rollout.history.get(version)
        if weights is None:
            kept = sorted(self.rollout.history)
            raise UnknownVersion(f"weight version {version} is not kept (the learner keeps versions "
                                 f"{kept[0] if kept else '-'}..{kept[-1] if kept else '-'}; --keep-versions "
                                 f"{self.settings.keep_versions})")
        return weights

    def submit(self, trajectories: list[dict]):
        """Score trajectories sampled elsewhere at the learner's weights; record and return the drift."""
        if not trajectories:
            raise ValueError("no trajectories")
        for i, t in enumerate(trajectories):
            self.check_trajectory(t, i)
        with self.lock, torch.no_grad():
            for i, t in enumerate(trajectories):
                if t["weight_version"] != self.trainer.version:
                    raise StaleVersion(f"trajectory {i} was sampled at weight version {t['weight_version']}; "
                                       f"the learner is at {self.trainer.version}")
            mine = [self.trainer.learner.logprobs(t["prompt_ids"], t["completion_ids"], t["temperature"] or 1.0)
                    for t in trajectories]
        theirs = [torch.tensor(t["rollout_logprobs"], dtype=torch.float32) for t in trajectories]
        stats = drift_stats(theirs, mine)
        diffs = torch.cat([(a - b).abs() for a, b in zip(mine, theirs)])
        self.metrics.record_drift(diffs.tolist(), stats)
        return stats

    def status(self) -> dict:
        return {"step": self.trainer.step_idx, "weight_version": self.trainer.version, "total_steps": self.cfg.steps,
                "running": self.running, "done": self.done, "paused": self.paused.is_set(),
                "reward_mean": self.last.get("reward", 0.0),
                "logprob_abs_diff_max": self.last.get("sampling/sampling_logp_difference/max", 0.0),
                "rollout_replicas": self.rollout.status(), "last_error": self.last_error}

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)
