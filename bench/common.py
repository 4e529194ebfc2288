"""Shared by the GPU benchmarks: the model shapes they run (random weights, nothing downloaded) and timing."""
from __future__ import annotations

import time

import torch

from minite_core.model.qwen3 import Qwen3Config

CONFIGS = {  # Qwen3-0.6B and Qwen3-1.7B shapes (vocabulary included), and a small Qwen3-MoE
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    # Qwen3-30B-A3B's layer structure (GQA 32/4 -> 16/8 here, 128 experts top-8 -> 32 experts top-4), scaled down
    "moe": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True),
}


def make_config(name: str, seq: int) -> Qwen3Config:
    moe = "num_experts" in CONFIGS[name]
    c = dict(CONFIGS[name], max_position_embeddings=max(seq, 4096), rms_norm_eps=1e-6, rope_theta=1e6,
             model_type="qwen3_moe" if moe else "qwen3",
             architectures=["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"])
    return Qwen3Config.from_hf(c)


def cuda_time(fn) -> float:
    """Wall seconds of fn() with the GPU drained before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0
