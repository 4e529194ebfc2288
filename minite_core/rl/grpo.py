"""GRPO with rollout correction, as pure functions on padded [B, L] tensors (B = prompts x generations).

Advantages are group-normalized: A = (r - mean_group(r)) / (std_group(r) + 1e-4), or r - mean_group(r)
with `scale_rewards="none"` (Dr. GRPO). The per-token objective is PPO's clipped surrogate,

    ratio = exp(logp - logp_old)                                 (logp_old: the learner's, detached)
    loss  = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) * w  + beta * k3(ref)

where w corrects for the rollout engine's own logprobs: with rho = exp(logp_old - logp_rollout),
TIS uses w = min(rho, tis_cap); MIS-token masks tokens with rho outside [1/cap, cap]; MIS-sequence masks
whole sequences on the geometric mean of rho. With miniTE's aligned engines rho is exactly 1, so all
three are the identity. Aggregation: "grpo" averages each sequence's tokens then the sequences; "dapo"
(token) averages all tokens of the batch; "dr_grpo" sums and divides by B * max_completion_length.
Names follow TRL's GRPOConfig where they exist.
"""
from __future__ import annotations

import dataclasses

import torch

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
CORRECTIONS = (None, "tis", "mis_token", "mis_seq")
SCALE_REWARDS = ("group", "batch", "none")  # TRL's scale_rewards


@dataclasses.dataclass
class GRPOConfig:
    num_generations: int = 8
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: = epsilon
    beta: float = 0.0
    loss_type: str = "grpo"
    scale_rewards: str = "group"  # group, batch or none (TRL's)
    temperature: float = 1.0
    max_completion_length: int = 8
    rollout_correction: str | None = "tis"
    tis_cap: float = 2.0

    def validate(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.rollout_correction not in CORRECTIONS:
            raise ValueError(f"rollout_correction must be one of {CORRECTIONS}, got {self.rollout_correction!r}")
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2 (advantages are relative to the group)")
        if not (self.epsilon >= 0 and self.tis_cap >= 1 and self.beta >= 0 and self.temperature > 0):
            raise ValueError("need epsilon >= 0, tis_cap >= 1, beta >= 0, temperature > 0")


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """rewards [B] (groups of num_generations consecutive samples) -> advantages [B]: each reward less its
    group's mean, divided (TRL's `scale_rewards`) by the group's reward std ("group"), the whole batch's
    ("batch") or nothing ("none", Dr. GRPO)."""
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {num_generations}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, not {scale_rewards!r}")
    g = rewards.float().view(-1, num_generations)
    adv = g - g.mean(1, keepdim=True)
    if scale_rewards == "group":
        adv = adv / (g.std(1, keepdim=True) + 1e-4)
    elif scale_rewards == "batch":
        adv = adv / (g.std() + 1e-4)
    return adv.reshape(-1)


def rollout_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                    cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, L], rho [B, L]): the correction factor per token, and the raw importance ratio."""
    rho = torch.exp((logp_old - logp_rollout) * mask)
    if cfg.rollout_correction is None:
        return torch.ones_like(rho), rho
    if cfg.rollout_correction == "tis":
        return torch.clamp(rho, max=cfg.tis_cap), rho
    lo, hi = 1.0 / cfg.tis_cap, cfg.tis_cap
    if cfg.rollout_correction == "mis_token":
        return ((rho >= lo) & (rho <= hi)).float(), rho
    log_geo = ((logp_old - logp_rollout) * mask).sum(1) / mask.sum(1).clamp(min=1)
    keep = ((log_geo >= -torch.log(torch.tensor(hi))) & (log_geo <= torch.log(torch.tensor(hi)))).float()
    return keep.unsqueeze(1).expand_as(rho).contiguous(), rho


def grpo_loss(logp: torch.Tensor, logp_rollout: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              cfg: GRPOConfig, logp_ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """logp [B, L] (differentiable), logp_rollout [B, L], advantages [B], mask [B, L] (1 = a completion
    token). Returns the loss and the metrics of the step."""
    mask = mask.float()
    logp_old = logp.detach()
    ratio = torch.exp(logp - logp_old)
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    a = advantages.unsqueeze(1)
    surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - cfg.epsilon, 1 + eps_hi) * a)
    weights, rho = rollout_weights(logp_old, logp_rollout, mask, cfg)
    per_token = -surrogate * weights
    kl = torch.zeros_like(logp)
    if cfg.beta > 0:
        if logp_ref is None:
            raise ValueError("beta > 0 needs the reference model's logprobs")
        r = logp_ref - logp
        kl = torch.exp(r) - r - 1
        per_token = per_token + cfg.beta * kl
    if cfg.loss_type == "grpo":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    elif cfg.loss_type == "dapo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    else:
        loss = (per_token * mask).sum() / (logp.shape[0] * cfg.max_completion_length)
    n = mask.sum().clamp(min=1)
    on = mask.bool()
    diff = (logp_old - logp_rollout)[on].abs()
    clipped = ((ratio < 1 - cfg.epsilon) & (a < 0)) | ((ratio > 1 + eps_hi) & (a > 0))
    metrics = {
        "loss": float(loss.detach()),
        "kl": float((kl * mask).sum() / n),
        "clip_ratio": float((clipped.float() * mask).sum() / n),
        "sampling/sampling_logp_difference/mean": float(diff.mean()) if diff.numel() else 0.0,
        "sampling/sampling_logp_difference/max": float(diff.max()) if diff.numel() else 0.0,
        "sampling/importance_sampling_ratio/min": float(rho[on].min()) if diff.numel() else 1.0,
        "sampling/importance_sampling_ratio/mean": float(rho[on].mean()) if diff.numel() else 1.0,
        "sampling/importance_sampling_ratio/max": float(rho[on].max()) if diff.numel() else 1.0,
    }
    return loss, metrics


def shard_share(cfg: GRPOConfig, mask_shard: torch.Tensor, mask_all: torch.Tensor) -> float:
    """The fraction of the global batch's loss normalizer that `grpo_loss` on a shard of its rows divides
    by (sequences for "grpo" and "dr_grpo", completion tokens for "dapo"): shard loss x share summed over
    the shards is the global loss (the data-parallel learner, distributed.py)."""
    if cfg.loss_type == "dapo":
        return float(mask_shard.sum().clamp(min=1)) / float(mask_all.sum().clamp(min=1))
    return mask_shard.shape[0] / mask_all.shape[0]
