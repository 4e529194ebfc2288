"""Random-weight checkpoints in the HF layout, for tests, benchmarks and diagnostics (nothing is downloaded)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .qwen3 import Qwen3Config


def random_checkpoint(path, cfg: Qwen3Config, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16, std: float = 0.02) -> Path:
    """Write config.json and model.safetensors for `cfg` with N(0, std) matrices and norms near 1."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in cfg.expected_shapes().items():
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g) if name.endswith("norm.weight") else 0.02 * torch.randn(shape, generator=g)
        else:
            t = std * torch.randn(shape, generator=g)
        tensors[name] = t.to(dtype).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    return path
