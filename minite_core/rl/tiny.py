"""The built-in tiny model: a 2-layer Qwen3 (or Qwen3-MoE with `moe=True`) trained briefly, supervised,
on the addition task.

`build_tiny_model(path)` writes a random-weight Qwen3 checkpoint with the task's character tokenizer,
then runs a short supervised warm-up (cross-entropy on the answer tokens, AdamW, a fixed seed) through
the same `load_model` / `Learner` path that the RL run uses, until greedy accuracy reaches a target that
leaves room to improve, and saves the result as an ordinary HF checkpoint directory (bf16 safetensors,
config.json, tokenizer.json). About a minute on 2 CPU cores.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..engine import Learner, RolloutEngine, SamplingParams
from ..model import load_model
from ..model.qwen3 import Qwen3Config
from ..model.random_init import random_checkpoint
from .tasks import EOS, VOCAB, AdditionTask

TINY = Qwen3Config(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32)
TINY_MOE = dataclasses.replace(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True)


def greedy_accuracy(model, task: AdditionTask, n: int = 64, seed: int = 1234) -> float:
    probe = AdditionTask(task.digits, seed=seed)
    problems = [probe.sample() for _ in range(n)]
    outs = RolloutEngine(model, max_slots=64, max_seq_len=24).generate(
        [probe.prompt_ids(a, b) for a, b in problems],
        SamplingParams(max_tokens=task.digits + 2, temperature=0.0, stop_token_ids=(EOS,)))
    return sum(probe.reward(*problems[o.request_index], o.token_ids) == 1.0 for o in outs) / n


def build_tiny_model(path, *, digits: int = 2, seed: int = 0, max_steps: int = 800, target_accuracy: float = 0.35,
                     batch: int = 64, lr: float = 5e-3, moe: bool = False, log=print) -> Path:
    path = Path(path)
    torch.manual_seed(seed)
    random_checkpoint(path, TINY_MOE if moe else TINY, seed=seed, dtype=torch.float32)
    task = AdditionTask(digits, seed=seed)
    task.tokenizer.save(str(path / "tokenizer.json"))
    model = load_model(path, precision="fp32")
    masters = {n: w.clone().requires_grad_(True) for n, w in model.w.items()}
    model.masters = masters
    opt = torch.optim.AdamW(masters.values(), lr=lr, weight_decay=0.0)
    learner = Learner(model)
    acc = 0.0
    for step in range(1, max_steps + 1):
        problems = [task.sample() for _ in range(batch)]
        lps = learner.batch_logprobs([task.prompt_ids(a, b) for a, b in problems], [task.answer_ids(a, b) for a, b in problems])
        loss = -torch.cat(lps).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            with torch.no_grad():
                model.masters = None
                model.w = {n: m.detach().clone() for n, m in masters.items()}
                acc = greedy_accuracy(model, task)
                model.masters = masters
            log(f"warm-up step {step}: loss {loss.item():.3f}, greedy accuracy {acc:.2f}")
            if acc >= target_accuracy:
                break
    tensors = {n: m.detach().to(torch.bfloat16).contiguous() for n, m in masters.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "warmup.json").write_text(json.dumps({"steps": step, "greedy_accuracy": acc, "seed": seed, "digits": digits}))
    return path
