"""Test setup: without a GPU, the Triton backend runs under the interpreter (TRITON_INTERPRET=1).

The variable must be set before any Triton kernel is defined, so it is set here, at collection time.
On a CUDA machine the kernels compile for the GPU and the same tests run there.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # the torch backend is still tested
    HAS_TRITON = False

DEVICE = "cuda" if HAS_CUDA else "cpu"


def backend_params():
    """'torch' always; 'triton' marked `interpreter` on CPU, `gpu` on CUDA."""
    mark = pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter
    skip = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
    return [pytest.param("torch", id="torch"), pytest.param("triton", id="triton", marks=[mark, skip])]


@pytest.fixture
def device():
    return DEVICE


HF_TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def save_hf_checkpoint(path, *, moe: bool = False, random_norms: bool = False, **overrides):
    """A tiny random Qwen3 / Qwen3-MoE saved by HF transformers itself (the peer's own layout and config)."""
    import transformers

    torch.manual_seed(0)
    cfg = dict(HF_TINY, **overrides)
    if moe:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **cfg, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    if random_norms:  # norms start at 1: random ones make parity tests mean more
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def service_model(tmp_path_factory):
    """The built-in tiny architecture with random weights and the task's tokenizer: what the service
    tests serve (the mechanics do not need the warmed-up model; the RL tests build that one)."""
    from minite_core.model.random_init import random_checkpoint
    from minite_core.rl.tiny import TINY, write_tokenizer

    path = random_checkpoint(tmp_path_factory.mktemp("service-model"), TINY, seed=3)
    write_tokenizer(path)
    return path
