"""The learner step, written once: forward through the fp32 masters, a loss, backward, clip, optimizer
step, and re-quantization of the masters into the weights both engines read.

The policy the engines run holds NVFP4 (or bf16) weights; training keeps fp32 master copies next to it.
A forward with the masters (`Learner.batch_logprobs(..., masters=)`) computes the logprobs with exactly
the weights the rollout holds — the NVFP4 values quantized from the masters — while the gradients flow
to the masters (straight-through, or the `nvfp4` backward recipe). After the optimizer step the masters
are re-quantized once (`requantize`), and both engines read the new weights: one weight version.

`LearnerState` is used by the GRPO trainer (trainer.py), the tiny model's supervised warm-up (tiny.py)
and the learner benchmarks (bench/learner.py, bench/learner_dp.py): each supplies its loss, the step
around it is this one.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .. import nvfp4, ops
from ..engine import Learner
from ..nvfp4 import NVFP4Tensor


@torch.no_grad()
def requantize(model, masters: dict, *, block_2d: bool = False) -> None:
    """Write the masters into `model.w` in the model's formats: NVFP4 weights re-quantized once (per-tensor
    global scale; 16x16 block scales for the NVIDIA recipe's backward), plain weights cast. On the Triton
    backend all NVFP4 weights go through `ops.quantize_weights` together (one amax reduction and one host
    sync for all of them, then the fused quantize kernel each); the same bits as one at a time."""
    fp4 = [n for n in masters if isinstance(model.w[n], NVFP4Tensor)]
    if block_2d:
        for n in fp4:
            model.w[n] = nvfp4.quantize(masters[n].detach(), scale_mode="tensor", block_2d=True)
    else:
        # decoded: the 2-D weights also carry their fp16 decoded form, which the learner's wide forward GEMMs
        # read instead of decoding each weight at every step; dequantized: their bf16 values, which the
        # backward's dgrad reads instead of dequantizing each weight at every step (one launch for all, here)
        for n, q in zip(fp4, ops.quantize_weights([masters[n].detach() for n in fp4], backend=model.backend,
                                                  decoded=True, dequantized=True)):
            model.w[n] = q
    for n, m in masters.items():
        if not isinstance(model.w[n], NVFP4Tensor):
            model.w[n] = m.detach().to(model.dtype)


def make_optimizer(params, *, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.99)) -> torch.optim.AdamW:
    """The learner's AdamW: the fused (single-kernel) implementation when the masters are on CUDA, the
    multi-tensor one otherwise (deterministic either way, so a resumed run repeats an uninterrupted one)."""
    params = list(params)
    cuda = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas,
                             **({"fused": True} if cuda else {"foreach": True}))


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ with the multi-tensor norm and scale (no per-parameter kernels)."""
    return torch.nn.utils.clip_grad_norm_(list(params), max_norm, foreach=True)


def fp32_masters(weights: dict) -> dict[str, torch.Tensor]:
    """Trainable fp32 copies of a model's weights (load the model in fp32 first)."""
    return {n: t.detach().clone().float().requires_grad_(True) for n, t in weights.items()}


class LearnerState:
    """The policy the engines read, its fp32 masters and their optimizer: what one learner step changes.

    `masters` are the tensors the optimizer owns (on a data-parallel learner, its shards); the forward
    reads `forward_masters` when given (the gathered masters of FSDP2), else `masters`."""

    def __init__(self, policy, masters: dict, opt: torch.optim.Optimizer, *, max_grad_norm: float | None = None,
                 block_2d: bool = False):
        self.policy, self.masters, self.opt = policy, masters, opt
        self.learner = Learner(policy)
        self.max_grad_norm = max_grad_norm
        self.block_2d = block_2d

    def logprobs(self, prompts: list, completions: list, temperature: float = 1.0, *, entropy: bool = False,
                 masters: dict | None = None):
        """The completions' logprobs (and entropies), differentiable in the masters."""
        return self.learner.batch_logprobs(prompts, completions, temperature, return_entropy=entropy,
                                           masters=self.masters if masters is None else masters)

    def optimize(self, loss: torch.Tensor, *, after_backward: Callable[[], None] | None = None) -> float:
        """Backward, clip (when max_grad_norm is set), optimizer step -> the gradient norm before clipping
        (NaN when not clipped)."""
        self.opt.zero_grad()
        loss.backward()
        if after_backward is not None:
            after_backward()
        norm = math.nan
        if self.max_grad_norm is not None:
            norm = float(clip_grad_norm([p for p in self.masters.values() if p.grad is not None], self.max_grad_norm))
        self.opt.step()
        return norm

    def requantize(self, whole: dict | None = None) -> None:
        """The new weights into the policy (from `whole`: the gathered masters of a data-parallel learner)."""
        requantize(self.policy, self.masters if whole is None else whole, block_2d=self.block_2d)
