"""Reinforcement learning: GRPO with rollout correction, and the built-in addition task."""
from .grpo import GRPOConfig, group_advantages, grpo_loss, rollout_weights
from .tasks import AdditionTask, build_tokenizer

__all__ = ["AdditionTask", "GRPOConfig", "build_tokenizer", "group_advantages", "grpo_loss", "rollout_weights"]
