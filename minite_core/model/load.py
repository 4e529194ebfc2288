"""load_model: a local HF checkpoint directory -> a miniTE model in fp32, bf16 or NVFP4 (W4A4).

Reads config.json, the safetensors files (single, or shards through model.safetensors.index.json),
NVFP4 checkpoints in the compressed-tensors or ModelOpt format (`minite_core.checkpoint`), and the HF
tokenizer folder files (tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json's
eos ids) as `model.tokenizer`, a `minite_core.tokenizer.Tokenizer` (None without tokenizer.json). Nothing is
downloaded.

NVFP4 precision quantizes the linear layers (attention projections, MLP and expert projections) with a
per-tensor global scale; activations are quantized per row inside each linear. Embeddings, lm_head,
norms and the MoE router stay in bf16, and so does every layer that `keep_bf16` names: a block index
(negative counts from the end, as in "first/last N blocks") or a substring of a weight name.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import checkpoint, nvfp4
from ..nvfp4 import NVFP4Tensor
from ..tokenizer import Tokenizer
from .qwen3 import Qwen3, Qwen3Config

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "nvfp4": torch.bfloat16}
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_linear_weight(name: str) -> bool:
    """Whether a checkpoint tensor is a linear layer's weight: the ones NVFP4 precision holds packed (unless
    `keep_bf16` names its layer), and so the ones a weight push sends packed."""
    return name.endswith(".weight") and name.split(".")[-2] in _LINEAR


def _split_fused_experts(tensors: dict) -> dict:
    """HF's in-memory MoE layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) -> per expert."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}{e}.gate_proj.weight"], out[f"{p}{e}.up_proj.weight"] = t[e, :half], t[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def _kept(name: str, keep_bf16, n_layers: int) -> bool:
    for k in keep_bf16:
        if isinstance(k, int):
            if f"model.layers.{k % n_layers}." in name:
                return True
        elif k in name:
            return True
    return False


def load_model(path, *, precision: str = "bf16", backend: str = "torch", device="cpu", keep_bf16=(),
               knobs: dict | None = None) -> Qwen3:
    """Load a Qwen3 / Qwen3-MoE checkpoint directory. Raises ValueError/FileNotFoundError naming the problem.

    `knobs` (see `minite_core.knobs`) reproduce real stacks' misalignments, e.g. {"matmul": "library"}."""
    path = Path(path)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path / 'config.json'}: expected a JSON object, got {type(raw).__name__}")
    cfg = Qwen3Config.from_hf(raw)
    try:
        tensors, _ = checkpoint.load_checkpoint(path)
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:  # a truncated *.safetensors (an interrupted download), a malformed index or quantization_config
        raise ValueError(f"{path}: the checkpoint cannot be read ({type(e).__name__}: {e})") from None
    tensors = _split_fused_experts(tensors)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = cfg.expected_shapes()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensors missing, e.g. {missing[:3]}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(f"{path}: {len(unexpected)} unexpected tensors, e.g. {unexpected[:3]}")
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise ValueError(f"{path}: {name} has shape {got}, expected {shape} from config.json")

    dtype = PRECISIONS[precision]
    weights = {}
    for name, t in tensors.items():
        quantize = precision == "nvfp4" and is_linear_weight(name) and not _kept(name, keep_bf16, cfg.num_hidden_layers)
        if isinstance(t, NVFP4Tensor):
            weights[name] = t.to(device) if quantize else t.dequantize(dtype).to(device)
        elif quantize:
            weights[name] = nvfp4.quantize(t.to(device), scale_mode="tensor")
        else:
            weights[name] = t.to(device=device, dtype=dtype)
    model = Qwen3(cfg, weights, dtype=dtype, backend=backend, knobs=knobs)
    model.tokenizer = Tokenizer.from_dir(path, vocab_size=cfg.vocab_size)
    return model

