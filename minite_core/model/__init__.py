"""Models built from `minite_core.ops`, and loading them from local HF checkpoint directories."""
from .load import load_model
from .qwen3 import KVCache, Qwen3, Qwen3Config

__all__ = ["load_model", "KVCache", "Qwen3", "Qwen3Config"]
