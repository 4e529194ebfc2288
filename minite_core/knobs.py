"""Misalignment knobs: the drift of a stack whose two engines run different ops, reproduced on purpose.

Each knob swaps one aligned op of the model for the one a real stack runs (docs/consistency.md lists what
each costs); with every knob off, the rollout and the learner are bitwise equal. Knobs are how the tests
and `minite diagnose` show that the drift comes from the execution and where. Everything about them is
here: the table of knobs and values, `Knobs` (the parsed set a model consults), and the stand-in ops
(a library matmul, torch's SDPA), which the aligned code never calls.
"""
from __future__ import annotations

import dataclasses

import torch

from . import nvfp4, ops
from .nvfp4 import NVFP4Tensor

KNOBS = {  # knob -> its values, the aligned one first
    "matmul": ("invariant", "library"),  # library: torch.matmul (MKL / cuBLAS), order chosen by shape
    "attention": ("invariant", "sdpa"),  # sdpa: torch's scaled_dot_product_attention
    "act_scale": ("row", "tensor"),  # tensor: per-tensor activation global scale (depends on the batch)
    "kv_cache_dtype": (None, "fp8_e4m3", "fp16", "bf16"),  # the rollout's KV cache stored in another dtype
}
_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Knobs:
    matmul: str = "invariant"
    attention: str = "invariant"
    act_scale: str = "row"
    kv_cache_dtype: str | None = None

    @classmethod
    def parse(cls, knobs: dict | None) -> Knobs:
        """From {"matmul": "library", ...}; an unknown knob or value is a ValueError naming it."""
        knobs = dict(knobs or {})
        for k, v in knobs.items():
            if k not in KNOBS:
                raise ValueError(f"unknown knob {k!r}: expected one of {sorted(KNOBS)}")
            if v not in KNOBS[k]:
                raise ValueError(f"knob {k} must be one of {KNOBS[k]}, got {v!r}")
        return cls(**knobs)

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache rounds keys and values to (the model's own when aligned)."""
        return _CACHE_DTYPES.get(self.kv_cache_dtype, dtype)


def library_linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None,
                   scale_mode: str = "row") -> torch.Tensor:
    """Like `linear` (same activation quantization for NVFP4 weights), but the product is torch.matmul
    (MKL / cuBLAS), whose reduction order depends on the shapes."""
    ops._check_linear(x, w, bias)
    out_dtype = out_dtype or x.dtype
    if isinstance(w, NVFP4Tensor):
        xq = nvfp4.quantize(x, scale_mode=scale_mode, check_finite=False)
        y = torch.matmul(xq.dequantize(torch.float32), w.dequantize(torch.float32).T)
    else:
        y = torch.matmul(x.to(w.dtype), w.T).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor, *,
                   scale: float | None = None) -> torch.Tensor:
    """The same attention through torch.nn.functional.scaled_dot_product_attention (flash/efficient/math
    kernels chosen by shape), fp32 out."""
    rep = q.shape[1] // k.shape[1]
    j = torch.arange(k.shape[2], device=q.device)
    valid = (j.view(1, 1, -1) <= q_pos.unsqueeze(-1)) & (j.view(1, 1, -1) < kv_len.view(-1, 1, 1))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=valid.unsqueeze(1), scale=scale)
    return out.float()
