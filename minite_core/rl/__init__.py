"""Reinforcement learning: the run configuration, datasets and reward functions, the Task door, GRPO, the
learner step, the trainer and its loop (see docs/tasks.md)."""
from .grpo import GRPOConfig, group_advantages, grpo_loss, rollout_weights

__all__ = ["GRPOConfig", "group_advantages", "grpo_loss", "rollout_weights"]
