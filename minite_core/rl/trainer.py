"""The RL loop, in process: GRPO on the addition task with the rollout engine and the learner sharing
one set of weights.

Each step: sample prompts, let the RolloutEngine draw `num_generations` completions per prompt (its
logprobs recorded), reward them, score them with the Learner (one full-sequence forward with autograd
through the fp32 master weights), take the GRPO loss with rollout correction, clip the gradient norm,
AdamW, then re-quantize the masters once into the NVFP4 weights both engines use and bump the weight
version. Metrics go to metrics.jsonl in the run directory (TRL's names for the sampling drift), and a
PNG plot of reward and drift is drawn at the end. Checkpoints (safetensors: masters and optimizer
state; JSON: step, weight version, RNG states, config) make `resume` continue to the same result, and
the trajectory log (wal.py) makes it survive a kill at any instant: each step's batch is recorded
durably before it is trained on and replayed after a restart, so every trajectory is used once.
With `data_parallel` = "ddp" or "fsdp" under torchrun, the step is spread over the ranks (distributed.py).
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .. import nvfp4, ops
from ..consistency import drift_stats
from ..engine import Learner, RolloutEngine, SamplingParams
from ..model import load_model
from ..nvfp4 import NVFP4Tensor
from . import distributed
from .grpo import GRPOConfig, group_advantages, grpo_loss, shard_share
from .tasks import EOS, AdditionTask
from .wal import TrajectoryLog, latest, write_atomically

log = logging.getLogger("minite.train")


@dataclasses.dataclass
class TrainConfig:
    model_dir: str = "runs/tiny-model"
    run_dir: str = "runs/train"
    precision: str = "nvfp4"
    backward: str = "ste"
    steps: int = 150
    prompts_per_step: int = 16
    digits: int = 2
    partial_credit: bool = True
    learning_rate: float = 5e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    checkpoint_every: int = 10
    data_parallel: str = "none"  # "ddp" / "fsdp": one learner over the torchrun ranks (distributed.py)
    device: str = "cpu"  # (a data-parallel rank on a GPU host takes its own GPU)
    backend: str = "torch"  # kernel backend: torch or triton
    rollout_knobs: dict = dataclasses.field(default_factory=dict)
    grpo: GRPOConfig = dataclasses.field(default_factory=lambda: GRPOConfig(num_generations=8, max_completion_length=4))

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        d = dict(d)
        d["grpo"] = GRPOConfig(**d.get("grpo", {}))
        return cls(**d)


@torch.no_grad()
def requantize(model, masters: dict, *, block_2d: bool = False) -> None:
    """Write the masters into `model.w` in the model's formats: NVFP4 weights re-quantized once (per-tensor
    global scale; 16x16 block scales for the NVIDIA recipe's backward), plain weights cast. On the Triton
    backend all NVFP4 weights go through `ops.quantize_weights` together (one amax reduction and one host
    sync for all of them, then the fused quantize kernel each); the same bits as one at a time."""
    fp4 = [n for n in masters if isinstance(model.w[n], NVFP4Tensor)]
    if block_2d:
        for n in fp4:
            model.w[n] = nvfp4.quantize(masters[n].detach(), scale_mode="tensor", block_2d=True)
    else:
        for n, q in zip(fp4, ops.quantize_weights([masters[n].detach() for n in fp4], backend=model.backend)):
            model.w[n] = q
    for n, m in masters.items():
        if not isinstance(model.w[n], NVFP4Tensor):
            model.w[n] = m.detach().to(model.dtype)


def make_optimizer(params, *, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.99)) -> torch.optim.AdamW:
    """The learner's AdamW: the fused (single-kernel) implementation when the masters are on CUDA, the
    multi-tensor one otherwise (deterministic either way, so a resumed run repeats an uninterrupted one)."""
    params = list(params)
    cuda = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas,
                             **({"fused": True} if cuda else {"foreach": True}))


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ with the multi-tensor norm and scale (no per-parameter kernels)."""
    return torch.nn.utils.clip_grad_norm_(list(params), max_norm, foreach=True)


class LocalRollout:
    """The in-process rollout: a RolloutEngine over the policy's own weight dict (updated in place)."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def generate(self, prompts: list, params: SamplingParams) -> list:
        return self.engine.generate(prompts, params)

    def update(self, weights: dict, version: int) -> None:
        self.engine.weight_version = version  # the engine reads the same dict the learner re-quantized

    def version_floor(self) -> int:
        return 0  # the in-process engine's version is the learner's own


class Follower:
    """The rollout of a data-parallel rank other than 0: rank 0 samples and broadcasts; this one only trains."""

    def generate(self, prompts: list, params: SamplingParams) -> list:
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


class Trainer:
    """One GRPO learner. `rollout` is where completions come from: anything with generate(prompts,
    params) -> [Completion], update(weights, version) and version_floor() -> the highest version it
    already serves (the learner service passes its remote replicas); by default an in-process
    RolloutEngine over the same weights."""

    def __init__(self, cfg: TrainConfig, rollout=None):
        cfg.grpo.validate()
        if cfg.backward not in ("ste", "nvfp4"):
            raise ValueError(f"backward must be 'ste' or 'nvfp4', got {cfg.backward!r}")
        self.cfg = cfg
        self.group = distributed.setup(cfg.data_parallel)  # None: one process
        self.leader = self.group is None or self.group.leader
        torch.manual_seed(cfg.seed)
        self.task = AdditionTask(cfg.digits, cfg.partial_credit, seed=cfg.seed)
        gpu = self.group is not None and self.group.device.type == "cuda"
        where = dict(device=self.group.device if gpu else cfg.device, backend=cfg.backend)
        self.policy = load_model(cfg.model_dir, precision=cfg.precision, **where)
        tok = self.policy.tokenizer
        if tok is None or tok.get_vocab() != self.task.tokenizer.get_vocab():
            raise ValueError(f"{cfg.model_dir}: the built-in addition task needs a model with its character tokenizer "
                             "(tokenizer.json); build one with `minite train` without --model-dir")
        self.policy.backward = cfg.backward
        rollout_model = self.policy
        if cfg.rollout_knobs:  # a misaligned rollout engine over the same weights
            rollout_model = load_model(cfg.model_dir, precision=cfg.precision, knobs=cfg.rollout_knobs, **where)
            rollout_model.w = self.policy.w
        self.engine = None
        if rollout is None and not self.leader:
            rollout = Follower()
        if rollout is None:
            self.engine = RolloutEngine(rollout_model, max_slots=64, max_seq_len=self.policy.cfg.max_position_embeddings)
            rollout = LocalRollout(self.engine)
        self.rollout = rollout
        self.last_drift = None  # (per-token |Δlogp| tensor, DriftStats) of the last step
        self.wal: TrajectoryLog | None = None  # set by run(): batches recorded before training, replayed on resume
        self.learner = Learner(self.policy)
        # the frozen reference policy of the KL penalty (only when beta > 0)
        self.reference = Learner(load_model(cfg.model_dir, precision=cfg.precision, **where)) if cfg.grpo.beta > 0 else None
        fp32 = load_model(cfg.model_dir, precision="fp32", **where)
        self.module = None  # the masters under DDP / FSDP2 (data-parallel runs)
        if self.group is None:
            self.masters = {n: t.clone().requires_grad_(True) for n, t in fp32.w.items()}
        else:
            inner = distributed.Masters(fp32.w)
            self.module = distributed.wrap(inner, self.group)
            self.masters = {n: inner.get_parameter(n) for n in inner.names}
        self.opt = make_optimizer(self.masters.values(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  betas=(0.9, 0.99))
        self.step_idx = 0
        self.version = 0
        self.ended = False  # (data-parallel) rank 0 has released the other ranks
        self._sync_weights()

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
        """One GRPO step: sample (or replay), score, loss, backward, clip, AdamW, re-quantize, push."""
        self._lead("_step")
        return self._step()

    def checkpoint(self, path) -> None:
        """An atomic checkpoint at `path` (wal.write_atomically; every rank writes its part)."""
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

    def _sync_weights(self) -> None:
        whole = self.masters if self.group is None else distributed.full(self.masters)
        requantize(self.policy, whole, block_2d=self.cfg.backward == "nvfp4")
        # monotonic on the rollout side too: above any version a replica already serves (a learner that
        # restarted, or resumed an older checkpoint, must not push "stale" versions forever)
        version = failure = None
        if self.leader:
            try:
                version = max(self.version, self.rollout.version_floor()) + 1
            except Exception as e:
                failure = e
        if self.group is not None:
            version, failed = self.group.broadcast((version, None if failure is None else repr(failure)))
            if failed is not None and failure is None:
                raise distributed.PeerFailed(f"rank 0 could not set the weight version: {failed}")
        if failure is not None:
            raise failure
        self.version = version
        self.rollout.update(self.policy.w, self.version)

    def _step(self) -> dict:
        cfg, g = self.cfg, self.cfg.grpo
        t0 = time.perf_counter()
        task_rng = self.task.rng.getstate()
        problems = [self.task.sample() for _ in range(cfg.prompts_per_step)]
        prompts = [self.task.prompt_ids(a, b) for a, b in problems]
        logged = self.wal.get(self.step_idx + 1) if self.wal is not None else None
        outs, failure = None, None
        if self.leader:
            try:
                outs = self._sample(problems, prompts, logged, g)
            except Exception as e:
                failure = e
        if self.group is not None:  # rank 0's batch (or its failure) on every rank
            sent = self.group.broadcast((outs, logged is not None, None if failure is None else repr(failure)))
            outs, replayed, failed = sent
        else:
            replayed, failed = logged is not None, None
        if failed is not None or failure is not None:
            self.task.rng.setstate(task_rng)  # a retried step draws the same problems
            raise failure or distributed.PeerFailed(f"rank 0 could not sample step {self.step_idx + 1}: {failed}")
        t_rollout = time.perf_counter() - t0
        rewards = torch.tensor([self.task.reward(*problems[o.request_index], o.token_ids) for o in outs])
        adv = group_advantages(rewards, g.num_generations, g.scale_rewards)

        # this rank's rows (all of them on one process): the learner's logprobs, then the loss
        rows = range(len(outs)) if self.group is None else self.group.rows(len(outs))
        mine = [outs[i] for i in rows]
        weights = self.masters if self.module is None else distributed.step_masters(self.module)  # (gathered for the step)
        self.policy.masters = weights
        try:
            lps, ents = self.learner.batch_logprobs([o.prompt_ids for o in mine], [o.token_ids for o in mine],
                                                    g.temperature, return_entropy=True)
        finally:
            self.policy.masters = None
        logp, logp_rollout, mask = padded(mine, lps)
        refs = None
        if self.reference is not None:
            with torch.no_grad():
                refs = self.reference.batch_logprobs([o.prompt_ids for o in mine], [o.token_ids for o in mine], g.temperature)
        logp_ref = padded(mine, refs)[0] if refs is not None else None
        loss, metrics = grpo_loss(logp, logp_rollout, adv[rows.start:rows.stop].to(logp.device), mask, g, logp_ref)
        if self.group is not None:  # this shard's part of the global loss, x W: the ranks' gradients are averaged
            mask_all = padded(outs, [])[2]  # (the whole batch's mask: its token count for "dapo")
            share = shard_share(g, mask.cpu(), mask_all)
            loss = loss * (share * self.group.world) + distributed.touch(weights.unread())
        self.opt.zero_grad()
        loss.backward()
        if self.group is not None:
            distributed.drop_unread(self.masters, weights.read)
        grad_norm = clip_grad_norm([p for p in self.masters.values() if p.grad is not None], cfg.max_grad_norm)
        self.opt.step()
        self._sync_weights()
        self.step_idx += 1
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
            "accuracy": float((rewards == 1.0).float().mean()), "entropy": float(torch.cat(ents).mean()),
            "grad_norm": float(grad_norm), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "rollout_seconds": t_rollout, "drift/bitwise_equal_ratio": drift.bitwise_equal_ratio,
            "drift/kl_k3": drift.kl_k3, "replayed": replayed,
            "batch_sha256": batch_digest(outs),
        })
        return metrics

    def _sample(self, problems: list, prompts: list, logged: dict | None, g: GRPOConfig) -> list:
        """The step's batch: replayed from the trajectory log, or sampled and logged before it is used."""
        if logged is not None:  # sampled before a crash, never trained on (or trained on and lost): replay it
            if logged["problems"] != [list(p) for p in problems]:
                raise RuntimeError(f"the trajectory log's step {self.step_idx + 1} holds other problems than this "
                                   "run draws: it belongs to another run (start afresh without resume)")
            return TrajectoryLog.completions(logged)
        outs = self._generate(prompts, g)
        if self.wal is not None:  # durably recorded before it is used: the acknowledgement
            self.wal.append(self.step_idx + 1, problems, outs)
        return outs

    def _generate(self, prompts: list, g: GRPOConfig) -> list:
        outs = self.rollout.generate(prompts, SamplingParams(
            max_tokens=g.max_completion_length, temperature=g.temperature, n=g.num_generations,
            seed=self.cfg.seed * 1_000_003 + self.step_idx, stop_token_ids=(EOS,)))
        stale = {o.weight_version for o in outs} - {self.version}
        if stale:  # off-policy by construction: the caller must re-sync the rollout and retry
            raise RuntimeError(f"rollout sampled with weight version(s) {sorted(stale)}, the learner is at {self.version}")
        return outs

    def evaluate(self, n: int = 128, seed: int = 1234) -> dict:
        """Greedy mean reward and accuracy on a fixed set of n problems (the same before and after training)."""
        probe = AdditionTask(self.cfg.digits, self.cfg.partial_credit, seed=seed)
        problems = [probe.sample() for _ in range(n)]
        outs = self.rollout.generate([probe.prompt_ids(a, b) for a, b in problems], SamplingParams(
            max_tokens=self.cfg.grpo.max_completion_length, temperature=0.0, stop_token_ids=(EOS,)))
        rewards = [probe.reward(*problems[o.request_index], o.token_ids) for o in outs]
        return {"eval/reward": sum(rewards) / n, "eval/accuracy": sum(r == 1.0 for r in rewards) / n}

    # -- checkpoints ---------------------------------------------------------------------------------
    def _checkpoint(self, path) -> None:
        write_atomically(path, self.save, group=self.group)
        if self.wal is not None:
            self.wal.drop_through(self.step_idx)

    def save(self, path) -> None:
        """Masters, optimizer state, step, version and RNG states into directory `path` (safetensors on one
        process; torch.distributed.checkpoint shards on a data-parallel learner, where every rank calls it)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = {"step": self.step_idx, "weight_version": self.version, "config": dataclasses.asdict(self.cfg),
                "torch_rng": torch.get_rng_state().tolist(), "task_rng": repr(self.task.rng.getstate())}
        if self.group is not None:
            distributed.save(path, self.module, self.opt)
            if self.leader:
                (path / "trainer.json").write_text(json.dumps(meta))
            return
        tensors = {f"master/{n}": m.detach().contiguous() for n, m in self.masters.items()}
        names = list(self.masters)
        state = self.opt.state_dict()
        for idx, st in state["state"].items():
            for key, val in st.items():
                tensors[f"optim/{names[idx]}/{key}"] = torch.as_tensor(val).contiguous()
        save_file(tensors, str(path / "trainer.safetensors"))
        (path / "trainer.json").write_text(json.dumps(meta))

    def _load(self, path) -> None:
        path = Path(path)
        meta = json.loads((path / "trainer.json").read_text())
        if self.group is not None:
            if not (path / ".metadata").exists():
                raise ValueError(f"{path} is not a data-parallel (torch.distributed.checkpoint) checkpoint")
            distributed.load(path, self.module, self.opt)
        else:
            if not (path / "trainer.safetensors").exists():
                raise ValueError(f"{path} holds a data-parallel checkpoint: resume it with torchrun and --data-parallel")
            tensors = load_file(str(path / "trainer.safetensors"))
            names = list(self.masters)
            with torch.no_grad():
                for n in names:
                    self.masters[n].copy_(tensors[f"master/{n}"])
            state = self.opt.state_dict()
            for idx, n in enumerate(names):
                keys = [k.split("/")[-1] for k in tensors if k.startswith(f"optim/{n}/")]
                if keys:
                    state["state"][idx] = {k: tensors[f"optim/{n}/{k}"].clone() for k in keys}
            self.opt.load_state_dict(state)
        self.step_idx = meta["step"]
        torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
        self.task.rng.setstate(ast.literal_eval(meta["task_rng"]))
        self.version = meta["weight_version"] - 1
        self._sync_weights()  # back to the saved version, on the rollout side too


def _read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file; a torn last line (a crash mid-append) is dropped."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return rows


def batch_digest(outs: list) -> str:
    """SHA-256 of a batch's completions (token ids, logprob bits, versions): which batch a step used."""
    h = hashlib.sha256()
    for o in outs:
        h.update(json.dumps([o.prompt_ids, o.token_ids, o.weight_version, o.request_index, o.sample_index]).encode())
        h.update(o.logprobs.to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def run(cfg: TrainConfig, *, resume: bool = False, progress=True, rollout=None, on_step=None,
        trainer: Trainer | None = None, retry=None, stop=None) -> list[dict]:
    """Train for cfg.steps steps (continuing from run_dir's checkpoint with resume), writing
    metrics.jsonl, checkpoints, summary.json (greedy reward on fixed problems before and after) and
    reward_drift.png to cfg.run_dir. Returns the metrics of each step. For the learner service:
    `rollout` (see Trainer), `on_step(trainer, metrics)` after every step, `retry(exc) -> bool` to take
    the step again after a failure it recognizes (a rollout replica down), `stop() -> bool` to end early.
    On a data-parallel learner every rank calls run(); rank 0 samples, evaluates and writes the files."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = trainer or Trainer(cfg, rollout)
    if not trainer.leader:  # rank 0 runs the loop below and names each collective step
        trainer.follow()
        return []
    try:
        return _lead_run(cfg, trainer, resume, progress, on_step, retry, stop)
    finally:
        trainer.end()


def _lead_run(cfg: TrainConfig, trainer: Trainer, resume: bool, progress, on_step, retry, stop) -> list[dict]:
    run_dir = Path(cfg.run_dir)
    metrics_file = run_dir / "metrics.jsonl"
    wal_file = run_dir / "trajectories.wal"
    checkpoint = latest(run_dir / "checkpoint") if resume else None
    if checkpoint is not None:
        trainer.load(checkpoint)
        kept = [m for m in _read_jsonl(metrics_file) if m["step"] <= trainer.step_idx]
        metrics_file.write_text("".join(json.dumps(m) + "\n" for m in kept))
    else:
        metrics_file.write_text("")
        if not resume:  # (resume without a checkpoint: a crash before the first one; its batches replay from step 1)
            wal_file.unlink(missing_ok=True)
    trainer.wal = TrajectoryLog(wal_file)
    if trainer.wal.records:
        pending = sorted(s for s in trainer.wal.records if s > trainer.step_idx)
        if pending:
            log.info("resuming at step %d: replaying the logged batches of steps %s", trainer.step_idx + 1, pending)
    history = _read_jsonl(metrics_file)
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if checkpoint is not None and summary_file.exists() else {}
    def retrying(fn):
        while True:
            try:
                return fn()
            except Exception as e:
                if retry is None or not retry(e):
                    raise

    if "before" not in summary:
        summary["before"] = retrying(trainer.evaluate)
        summary_file.write_text(json.dumps(summary, indent=1))  # a resumed run keeps the first "before"
    bar = _progress(progress)
    with bar:
        task = bar.add_task("GRPO", total=cfg.steps, completed=trainer.step_idx)
        while trainer.step_idx < cfg.steps and not (stop is not None and stop()):
            try:
                m = trainer.step()
            except Exception as e:
                if retry is not None and retry(e):
                    continue
                raise
            history.append(m)
            if on_step is not None:
                on_step(trainer, m)
            with metrics_file.open("a") as f:
                f.write(json.dumps(m) + "\n")
            bar.update(task, completed=trainer.step_idx, description=(
                f"step {m['step']} reward {m['reward']:.3f} acc {m['accuracy']:.2f} "
                f"drift {m['sampling/sampling_logp_difference/max']:.2g} {m['tokens_per_s']:.0f} tok/s"))
            if trainer.step_idx % cfg.checkpoint_every == 0 or trainer.step_idx == cfg.steps:
                trainer.checkpoint(run_dir / "checkpoint")
    if trainer.step_idx < cfg.steps:  # stopped early (a service shutting down)
        return history
    summary["after"] = retrying(trainer.evaluate)
    summary["steps"] = trainer.step_idx
    summary_file.write_text(json.dumps(summary, indent=1))
    plot(history, run_dir / "reward_drift.png")
    return history


def _progress(enabled: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), disable=not enabled)


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in history]

    def smooth(vals, k=10):
        return [sum(vals[max(0, i - k + 1): i + 1]) / len(vals[max(0, i - k + 1): i + 1]) for i in range(len(vals))]

    fig, ax = plt.subplots(figsize=(7, 4))
    reward, acc = [m["reward"] for m in history], [m["accuracy"] for m in history]
    ax.plot(steps, reward, color="tab:blue", alpha=0.25)
    ax.plot(steps, smooth(reward), label="mean reward (10-step avg)", color="tab:blue")
    ax.plot(steps, acc, color="tab:green", alpha=0.25)
    ax.plot(steps, smooth(acc), label="accuracy (10-step avg)", color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax2 = ax.twinx()
    ax2.plot(steps, [m["sampling/sampling_logp_difference/max"] for m in history], label="max |Δlogp|",
             color="tab:red", linestyle="--")
    ax2.set_ylabel("rollout vs learner max |Δlogp|")
    fig.legend(loc="lower right", fontsize=8)
    ax.set_title("GRPO on addition: reward and rollout/learner drift")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
