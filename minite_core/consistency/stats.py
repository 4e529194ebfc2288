"""Drift statistics between two engines' logprobs of the same sampled tokens: one function, used by the
diagnose CLI, the RL loop and the Prometheus exporter alike.

With r = logp_learner - logp_rollout per token (the log importance ratio):
- mean_abs_diff, max_abs_diff: mean and max |r| (the TRL-style `sampling_logp_difference`);
- kl_k3: mean(exp(r) - r - 1), the k3 estimator of KL(rollout || learner) on rollout samples;
- bitwise_equal_ratio: the fraction of tokens with r exactly 0;
- mismatch_ratio: the fraction of tokens with |r| > MISMATCH (1e-3), drift large enough to matter;
- ppl_ratio: rollout perplexity / learner perplexity = exp(mean(logp_learner) - mean(logp_rollout));
- token_mismatch_ratio: the fraction of positions where the two engines' argmax tokens differ (when given).
"""
from __future__ import annotations

import dataclasses

import torch

MISMATCH = 1e-3


@dataclasses.dataclass
class DriftStats:
    tokens: int
    mean_abs_diff: float
    max_abs_diff: float
    kl_k3: float
    bitwise_equal_ratio: float
    ppl_ratio: float
    mismatch_ratio: float = 0.0
    token_mismatch_ratio: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _flat(x) -> torch.Tensor:
    if isinstance(x, (list, tuple)):
        x = torch.cat([torch.as_tensor(t, dtype=torch.float64).reshape(-1).cpu() for t in x]) if x else torch.zeros(0)
    return torch.as_tensor(x).reshape(-1).double().cpu()


def drift_stats(rollout_logprobs, learner_logprobs, rollout_argmax=None, learner_argmax=None) -> DriftStats:
    """Statistics over all tokens; each argument is a tensor or a list of per-sequence tensors."""
    a, b = _flat(rollout_logprobs), _flat(learner_logprobs)
    if a.shape != b.shape:
        raise ValueError(f"rollout and learner logprobs differ in length: {a.numel()} vs {b.numel()}")
    if a.numel() == 0:
        return DriftStats(0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, None)
    r = b - a
    mismatch = None
    if rollout_argmax is not None and learner_argmax is not None:
        ra, la = _flat(rollout_argmax), _flat(learner_argmax)
        mismatch = float((ra != la).double().mean())
    return DriftStats(
        tokens=a.numel(),
        mean_abs_diff=float(r.abs().mean()),
        max_abs_diff=float(r.abs().max()),
        kl_k3=float((torch.exp(r) - r - 1).mean()),
        bitwise_equal_ratio=float((r == 0).double().mean()),
        ppl_ratio=float(torch.exp(b.mean() - a.mean())),
        mismatch_ratio=float((r.abs() > MISMATCH).double().mean()),
        token_mismatch_ratio=mismatch,
    )
