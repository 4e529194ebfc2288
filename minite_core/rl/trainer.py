"""The GRPO trainer: the rollout engine and the learner sharing one set of weights, one step at a time.

Each step: draw the step's prompts from the task (rows fixed by seed and step), let the rollout draw
`num_generations` completions per prompt (its logprobs recorded), reward them with the task's reward
functions, record the batch and its rewards durably (wal.py), score it with the learner (one
full-sequence forward through the fp32 masters), take the GRPO loss with rollout correction, and run the
learner step (step.py: backward, clip, AdamW, re-quantize), then bump the weight version and hand the
new weights to the rollout. `loop.run` drives the steps, evaluation, checkpoints and the report.

`rollout` is where completions come from: anything with generate(prompts, params) -> [Completion],
update(weights, version) and version_floor() -> the highest version it already serves: an in-process
RolloutEngine over the same weights by default, remote replicas in the learner service.

Data-parallel (`data_parallel` = "ddp" or "fsdp", under torchrun): rank 0 samples, rewards and logs,
and names each collective operation (`_lead`); the other ranks `follow()` and do the same. Each rank
scores and differentiates its share of the rows (distributed.py explains the arithmetic).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from ..consistency import drift_stats
from ..engine import RolloutEngine, SamplingParams
from ..engine import Learner
from ..model import load_model
from . import distributed, state
from .config import RunConfig
from .grpo import group_advantages, grpo_loss, shard_share
from .report import batch_digest
from .step import LearnerState, fp32_masters, make_optimizer
from .task import Sample, Scores, cut_at_stop, make_task
from .wal import TrajectoryLog, write_atomically

log = logging.getLogger("minite.train")
# Settings a resumed run may change without a word: how long it runs and how often it checkpoints or evaluates,
# where its files are. Any other change (the seed, the learning rate, the data) is named when the run resumes.
RESUME_FREE = frozenset({"steps", "resume", "run_dir", "checkpoint_every", "eval_steps", "eval_max_rows"})


def changed_settings(saved: dict, now: dict) -> list[str]:
    """'name: old -> new' for each setting recorded in a checkpoint (`saved`) that differs now, but RESUME_FREE's
    (a setting the checkpoint does not record, from an older version, is not compared)."""
    return [f"{k}: {saved[k]!r} -> {now.get(k)!r}" for k in sorted(saved)
            if k not in RESUME_FREE and k in now and saved[k] != now[k]]


class StaleRollout(RuntimeError):
    """The rollout sampled at a weight version other than the learner's: re-sync it and take the step again."""


class ReplayMismatch(RuntimeError):
    """The trajectory log holds another run's batch for this step (start afresh, without resume)."""


class LocalRollout:
    """The in-process rollout: a RolloutEngine over the policy's own weight dict (updated in place)."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list:
        return self.engine.generate(prompts, params)

    def update(self, weights: dict, version: int) -> None:
        self.engine.weight_version = version  # the engine reads the same dict the learner re-quantized

    def version_floor(self) -> int:
        return 0  # the in-process engine's version is the learner's own


class Follower:
    """The rollout of a data-parallel rank other than 0: rank 0 samples and broadcasts; this one only trains."""

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list:
        raise RuntimeError("only rank 0 samples")

    def update(self, weights: dict, version: int) -> None:
        pass

    def version_floor(self) -> int:
        return 0


def padded(outs: list, lps: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(learner logprobs, rollout logprobs, mask), each [len(outs), longest completion], zero-padded, on
    the learner logprobs' device."""
    longest = max(len(o.token_ids) for o in outs)
    dev = lps[0].device if lps else torch.device("cpu")
    logp_rollout = torch.zeros(len(outs), longest, device=dev)
    mask = torch.zeros(len(outs), longest, device=dev)
    for i, o in enumerate(outs):
        n = len(o.token_ids)
        logp_rollout[i, :n] = o.logprobs
        mask[i, :n] = 1.0
    logp = torch.stack([torch.nn.functional.pad(lp, (0, longest - lp.numel())) for lp in lps]) if lps else None
    return logp, logp_rollout, mask


def _mean(values: list) -> float:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else float("nan")


class Trainer:
    def __init__(self, cfg: RunConfig, rollout=None):
        self.cfg = cfg
        self.group = distributed.setup(cfg.data_parallel)  # None: one process
        self.leader = self.group is None or self.group.leader
        if self.leader:  # a second learner on this run directory refuses to start (it would interleave steps)
            state.lock_run_dir(cfg.run_dir)
        torch.manual_seed(cfg.seed)
        gpu = self.group is not None and self.group.device.type == "cuda"
        where = dict(device=self.group.device if gpu else cfg.device, backend=cfg.backend)
        path = cfg.model_path
        policy = load_model(path, precision=cfg.precision, **where)
        policy.backward = cfg.backward
        context = policy.cfg.max_position_embeddings
        self.task = make_task(cfg, policy.tokenizer, context)
        self.grpo = cfg.grpo(self.task.max_completion_length)
        rollout_model = policy
        if cfg.rollout_knobs:  # a misaligned rollout engine over the same weights
            rollout_model = load_model(path, precision=cfg.precision, knobs=cfg.rollout_knobs, **where)
            rollout_model.w = policy.w
        self.engine = None
        if rollout is None and not self.leader:
            rollout = Follower()
        if rollout is None:
            longest = min(context, getattr(self.task, "budget", context) + self.task.max_completion_length)
            self.engine = RolloutEngine(rollout_model, max_slots=64, max_seq_len=longest)
            rollout = LocalRollout(self.engine)
        self.rollout = rollout
        self.last_drift = None  # (per-token |Δlogp| tensor, DriftStats) of the last step
        self.wal: TrajectoryLog | None = None  # set by loop.run: batches recorded before training, replayed on resume
        # the frozen reference policy of the KL penalty (only when beta > 0)
        self.reference = Learner(load_model(path, precision=cfg.precision, **where)) if cfg.beta > 0 else None
        fp32 = load_model(path, precision="fp32", **where)
        self.module = None  # the masters under DDP / FSDP2 (data-parallel runs)
        if self.group is None:
            masters = fp32_masters(fp32.w)
        else:
            inner = distributed.Masters(fp32.w)
            self.module = distributed.wrap(inner, self.group)
            masters = {n: inner.get_parameter(n) for n in inner.names}
        opt = make_optimizer(masters.values(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
        self.state = LearnerState(policy, masters, opt, max_grad_norm=cfg.max_grad_norm,
                                  block_2d=cfg.backward == "nvfp4")
        self.step_idx = 0
        self.checkpoint_step = 0  # the step of the last checkpoint written or loaded
        self.version = 0
        self.ended = False  # (data-parallel) rank 0 has released the other ranks
        self._sync_weights()

    @property
    def policy(self):
        return self.state.policy

    @property
    def masters(self) -> dict:
        return self.state.masters

    @property
    def learner(self) -> Learner:
        return self.state.learner

    # -- what the ranks do together: rank 0 names it, the other ranks (follow) do the same ----------
    def _lead(self, name: str, *args) -> None:
        if self.group is not None and self.leader:
            if self.ended:
                raise RuntimeError("the data-parallel run has ended: the other ranks have left")
            self.group.broadcast((name, args))

    def sync_weights(self) -> None:
        """Re-quantize the masters once into the weights both engines use; bump the weight version."""
        self._lead("_sync_weights")
        self._sync_weights()

    def step(self) -> dict:
        """One GRPO step: sample (or replay), reward, score, loss, learner step, re-quantize, push."""
        self._lead("_step")
        return self._step()

    def checkpoint(self, path) -> None:
        """An atomic checkpoint at `path` (every rank writes its part)."""
        self._lead("_checkpoint", str(path))
        self._checkpoint(path)

    def load(self, path) -> None:
        """Continue from the checkpoint at `path`."""
        self._lead("_load", str(path))
        self._load(path)

    def follow(self) -> None:
        """A data-parallel rank other than 0: do what rank 0 names until it ends the run."""
        while True:
            name, args = self.group.broadcast(None)
            if name == "end":
                return
            try:
                getattr(self, name)(*args)
            except distributed.PeerFailed:
                continue  # rank 0 could not go on with this step; it decides what comes next

    def end(self) -> None:
        """Rank 0: release the other ranks from follow() (once; later calls do nothing)."""
        if self.group is not None and self.leader and not self.ended:
            self._lead("end")
            self.ended = True

    def _on_leader(self, what: str, fn):
        """fn() on rank 0, its result (or its failure) on every rank."""
        result = failure = None
        if self.leader:
            try:
                result = fn()
            except Exception as e:
                failure = e
        if self.group is not None:
            result, failed = self.group.broadcast((result, None if failure is None else repr(failure)))
            if failed is not None and failure is None:
                raise distributed.PeerFailed(f"rank 0 could not {what}: {failed}")
        if failure is not None:
            raise failure
        return result

    def _sync_weights(self) -> None:
        self.state.requantize(None if self.group is None else distributed.full(self.masters))
        # monotonic on the rollout side too: above any version a replica already serves (a learner that
        # restarted, or resumed an older checkpoint, must not push "stale" versions forever)
        self.version = self._on_leader("set the weight version",
                                       lambda: max(self.version, self.rollout.version_floor()) + 1)
        self.rollout.update(self.policy.w, self.version)

    # -- the step ------------------------------------------------------------------------------------
    def _step(self) -> dict:
        cfg, g = self.cfg, self.grpo
        t0 = time.perf_counter()
        step = self.step_idx + 1
        samples = self.task.draw(step, cfg.prompts_per_step) if self.leader else []
        outs, scores, replayed = self._on_leader(f"sample step {step}", lambda: self._batch(step, samples))
        t_rollout = time.perf_counter() - t0
        rewards = scores.total
        adv = group_advantages(rewards, g.num_generations, g.scale_rewards)

        # this rank's rows (all of them on one process): the learner's logprobs, then the loss
        rows = range(len(outs)) if self.group is None else self.group.rows(len(outs))
        mine = [outs[i] for i in rows]
        prompts, completions = [o.prompt_ids for o in mine], [o.token_ids for o in mine]
        weights = None if self.module is None else distributed.step_masters(self.module)  # (gathered for the step)
        lps, ents = self.state.logprobs(prompts, completions, g.temperature, entropy=True, masters=weights)
        logp, logp_rollout, mask = padded(mine, lps)
        refs = None
        if self.reference is not None:
            with torch.no_grad():
                refs = self.reference.batch_logprobs(prompts, completions, g.temperature)
        logp_ref = padded(mine, refs)[0] if refs is not None else None
        loss, metrics = grpo_loss(logp, logp_rollout, adv[rows.start:rows.stop].to(logp.device), mask, g, logp_ref)
        after_backward = None
        if self.group is not None:  # this shard's part of the global loss, x W: the ranks' gradients are averaged
            share = shard_share(g, mask.cpu(), padded(outs, [])[2])  # (the whole batch's mask: its tokens for "dapo")
            loss = loss * (share * self.group.world) + distributed.touch(weights.unread())
            after_backward = lambda: distributed.drop_unread(self.masters, weights.read)  # noqa: E731
        grad_norm = self.state.optimize(loss, after_backward=after_backward)
        self._sync_weights()
        self.step_idx = step
        if self.group is not None:  # every row's logprobs on rank 0; its metrics from the whole batch
            cpu = lambda ts: None if ts is None else [t.detach().cpu() for t in ts]  # noqa: E731
            shards = self.group.gather((cpu(lps), cpu(ents), cpu(refs)))
            if not self.leader:
                return {"step": self.step_idx, "weight_version": self.version}
            lps = [lp for sh in shards for lp in sh[0]]
            ents = [e for sh in shards for e in sh[1]]
            logp, logp_rollout, mask = padded(outs, lps)
            logp_ref = padded(outs, [r for sh in shards for r in sh[2]])[0] if refs is not None else None
            with torch.no_grad():
                metrics = grpo_loss(logp, logp_rollout, adv, mask, g, logp_ref)[1]

        learner_lps = [lp.detach().cpu() for lp in lps]  # (completions hold CPU logprobs)
        drift = drift_stats([o.logprobs for o in outs], learner_lps)
        self.last_drift = (torch.cat([(lp - o.logprobs).abs() for o, lp in zip(outs, learner_lps)]), drift)
        tokens = int(mask.sum())
        seconds = time.perf_counter() - t0
        metrics.update({
            "step": self.step_idx, "weight_version": self.version, "reward": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            **{f"rewards/{name}/mean": _mean(vals) for name, vals in scores.per_function.items()},
            "entropy": float(torch.cat(ents).mean()), "grad_norm": grad_norm, "tokens": tokens,
            "completion_length": tokens / len(outs), "seconds": seconds, "tokens_per_s": tokens / seconds,
            "rollout_seconds": t_rollout, "drift/bitwise_equal_ratio": drift.bitwise_equal_ratio,
            "drift/kl_k3": drift.kl_k3, "replayed": replayed, "batch_sha256": batch_digest(outs),
        })
        return metrics

    def _batch(self, step: int, samples: list[Sample]) -> tuple[list, Scores, bool]:
        """Rank 0: the step's completions and rewards, replayed from the trajectory log, or sampled, rewarded
        and logged before they are used (a reward function that fails leaves nothing logged: the step is
        sampled again on retry or resume, with the same seeds)."""
        rows = [s.row for s in samples]
        logged = self.wal.get(step) if self.wal is not None else None
        if logged is not None:  # sampled before a crash, never trained on (or trained on and lost): replay it
            if logged.get("rows") != rows:
                raise ReplayMismatch(f"the trajectory log's step {step} holds other prompts than this run draws: "
                                     "it belongs to another run (start afresh without resume)")
            r = logged["rewards"]
            return (TrajectoryLog.completions(logged),
                    Scores(torch.tensor(r["total"], dtype=torch.float32), r["per_function"]), True)
        outs = self._generate([s.prompt_ids for s in samples], SamplingParams(
            max_tokens=self.task.max_completion_length, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
            n=self.grpo.num_generations, seed=self.cfg.seed * 1_000_003 + self.step_idx,
            stop_token_ids=self.task.stop_token_ids))
        scores = self.task.score(samples, outs, step=step, version=self.version)
        if self.wal is not None:  # durably recorded before it is used: the acknowledgement
            self.wal.append(step, rows, outs, {"total": scores.total.tolist(), "per_function": scores.per_function})
        self._write_calibration(outs)
        return outs, scores, False

    def _generate(self, prompts: list, params: SamplingParams) -> list:
        """Sample `params` for each prompt, each prompt with a seed of its own (derived from params.seed): one
        seed for all would give sample j of every prompt the same random draws (a request seeds its samples
        seed, seed + 1, ... whatever its prompt), correlating the batch."""
        if params.seed is not None:
            params = [dataclasses.replace(params, seed=(params.seed * 1_000_033 + r) % 2**62) for r in range(len(prompts))]
        outs = self.rollout.generate(prompts, params)
        stale = {o.weight_version for o in outs} - {self.version}
        if stale:  # off-policy by construction: the caller must re-sync the rollout and retry
            raise StaleRollout(f"rollout sampled with weight version(s) {sorted(stale)}, the learner is at {self.version}")
        return [cut_at_stop(o, self.policy.tokenizer, self.cfg.stop) for o in outs]

    def _write_calibration(self, outs: list) -> None:
        """The first batch's sequences, for the activation scales of an NVFP4 export (export.py)."""
        path = Path(self.cfg.run_dir) / "calibration.json"
        if not path.exists():
            path.write_text(json.dumps({"sequences": [list(o.prompt_ids) + list(o.token_ids) for o in outs[:64]]}))

    # -- evaluation ------------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """On the task's fixed eval prompts: greedy reward (total, per function) and the fraction of prompts
        whose total reaches `pass_threshold`; with num_generations_eval = k > 1 also the sampled mean and pass@k."""
        samples = self.task.eval_samples()
        if not samples:
            return {}
        cfg, L = self.cfg, self.task.max_completion_length
        prompts = [s.prompt_ids for s in samples]
        greedy = self._generate(prompts, SamplingParams(max_tokens=L, temperature=0.0, seed=cfg.seed,  # (a seed: no
                                                        stop_token_ids=self.task.stop_token_ids))  # draw from torch's RNG)
        sc = self.task.score(samples, greedy, step=self.step_idx, version=self.version)
        out = {"eval/reward": float(sc.total.mean()),
               "eval/accuracy": float((sc.total >= cfg.pass_threshold).float().mean()),
               **{f"eval/rewards/{n}/mean": _mean(v) for n, v in sc.per_function.items()}}
        k = cfg.num_generations_eval
        if k > 1:
            outs = self._generate(prompts, SamplingParams(max_tokens=L, temperature=cfg.temperature, top_p=cfg.top_p,
                                                          n=k, seed=cfg.seed * 7919 + 17,
                                                          stop_token_ids=self.task.stop_token_ids))
            sc = self.task.score(samples, outs, step=self.step_idx, version=self.version)
            hits = torch.zeros(len(samples))
            for o, r in zip(outs, sc.total.tolist()):
                hits[o.request_index] += r >= cfg.pass_threshold
            out.update({"eval/sampled/reward": float(sc.total.mean()), f"eval/pass@{k}": float((hits > 0).float().mean())})
        return out

    # -- checkpoints -------------------------------------------------------------------------------
    def _config_record(self) -> dict:
        """The run's settings as a checkpoint records them (the model folder absolute: `minite export` reads it
        from any working directory)."""
        config = self.cfg.run_fields()
        if config.get("model_dir"):
            config["model_dir"] = str(Path(config["model_dir"]).resolve())
        return config

    def _checkpoint(self, path) -> None:
        meta = {"step": self.step_idx, "weight_version": self.version, "config": self._config_record()}
        write_atomically(path, lambda p: state.save(p, self.masters, self.state.opt, meta, group=self.group,
                                                    module=self.module), group=self.group)
        if self.wal is not None:  # kept from the previous checkpoint on: it is the fallback (state.py)
            self.wal.drop_through(self.checkpoint_step)
        self.checkpoint_step = self.step_idx

    def _load(self, path) -> None:
        meta = state.load(path, self.masters, self.state.opt, group=self.group, module=self.module)
        self.step_idx = self.checkpoint_step = meta["step"]
        self.version = meta["weight_version"] - 1
        changed = changed_settings(meta.get("config") or {}, self._config_record())
        if changed and self.leader:
            log.warning("--resume: settings changed since the checkpoint of step %d (the run goes on with the new "
                        "ones): %s", self.step_idx, "; ".join(changed))
        self._sync_weights()  # back to the saved version, on the rollout side too
