"""Reinforcement learning: GRPO with rollout correction, tasks (datasets + reward functions), the trainer."""
from .grpo import GRPOConfig, group_advantages, grpo_loss, rollout_weights
from .tasks import AdditionRows, addition, build_tokenizer

__all__ = ["AdditionRows", "GRPOConfig", "addition", "build_tokenizer", "group_advantages", "grpo_loss",
           "rollout_weights"]
