"""The built-in tiny model: a 2-layer Qwen3 (or Qwen3-MoE with `moe=True`) trained briefly, supervised,
on the addition task.

`build_tiny_model(path)` writes a random-weight Qwen3 checkpoint with the task's character tokenizer
(tokenizer.json, tokenizer_config.json, generation_config.json naming <eos>), then runs a short
supervised warm-up (cross-entropy on the answer tokens, AdamW, a fixed seed) through the same
`load_model` and learner step (step.py) that the RL run uses, until greedy accuracy reaches a target that
leaves room to improve, and saves the result as an ordinary HF checkpoint directory (bf16 safetensors).
The warm-up plateaus (loss ~0.8, accuracy ~0.1) until the model learns the carries, then climbs within a
few hundred steps; when that happens depends on the seed and on the CPU's float kernels (seed 0 on an
AVX-512 AMD EPYC: step 1,350; seeds 1 and 2 there: 650 and 500), hence up to 2,000 steps. One to three
minutes on 2 CPU cores.

The dense model of seed 0 ships with the package (`SHIPPED`, `tiny_model/`: 200 KB, written by
`minite build-model --rebuild --out minite_core/rl/tiny_model`; its warmup.json records the steps and accuracy), so
the built-in model is the same file on every machine and a first run starts at once: `install_tiny_model`
copies it (whatever the run's seed, which seeds the RL run). The MoE variant is built by the warm-up, here;
`minite build-model --seed N` builds a dense one from another seed.
"""
from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..engine import RolloutEngine, SamplingParams
from ..model import load_model
from ..model.qwen3 import Qwen3Config
from ..model.random_init import random_checkpoint
from .step import LearnerState, fp32_masters
from .addition import BOS, EOS, PAD, SPECIALS, VOCAB, addition, addition_eval_rows, build_tokenizer

TINY = Qwen3Config(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32)
TINY_MOE = dataclasses.replace(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True)


SHIPPED = Path(__file__).parent / "tiny_model"  # the dense model of seed 0, built once by build_tiny_model


def install_tiny_model(path, *, moe: bool = False, seed: int = 0, log=print) -> Path:
    """The built-in tiny model in folder `path`: the shipped dense checkpoint copied there; the MoE variant
    built by `build_tiny_model` with `seed` (it is not shipped)."""
    path = Path(path)
    if not moe:
        path.mkdir(parents=True, exist_ok=True)
        for f in SHIPPED.iterdir():
            shutil.copy2(f, path / f.name)
        return path
    log(f"building the tiny MoE model in {path} (supervised warm-up, seed {seed}: a few minutes)")
    return build_tiny_model(path, seed=seed, moe=True, log=log)


def write_tokenizer(path) -> None:
    """The character tokenizer as an HF tokenizer folder: tokenizer.json, tokenizer_config.json (the special
    tokens) and generation_config.json (generation stops at <eos>)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[BOS], "eos_token": SPECIALS[EOS],
        "pad_token": SPECIALS[PAD], "model_max_length": TINY.max_position_embeddings}, indent=1))
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}, indent=1))


def greedy_accuracy(model, digits: int = 2, n: int = 64) -> float:
    """Fraction of the first n fixed eval problems answered exactly (greedy)."""
    rows = addition_eval_rows(digits, n=n)
    tok = build_tokenizer()
    outs = RolloutEngine(model, max_slots=64, max_seq_len=24).generate(
        [tok.encode(r["prompt"]).ids for r in rows],
        SamplingParams(max_tokens=digits + 2, temperature=0.0, stop_token_ids=(EOS,)))
    answers = [rows[o.request_index]["answer"] for o in outs]
    rewards = addition([r["prompt"] for r in rows], [""] * len(outs), [o.token_ids for o in outs], answers)
    return sum(r == 1.0 for r in rewards) / n


def build_tiny_model(path, *, digits: int = 2, seed: int = 0, max_steps: int = 2000, target_accuracy: float = 0.35,
                     batch: int = 64, lr: float = 5e-3, moe: bool = False, log=print) -> Path:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small run faster on one thread (0.14 vs 0.22 s a step on 2 cores)
    try:
        return _build_tiny_model(Path(path), digits, seed, max_steps, target_accuracy, batch, lr, moe, log)
    finally:
        torch.set_num_threads(threads)


def _build_tiny_model(path: Path, digits, seed, max_steps, target_accuracy, batch, lr, moe, log) -> Path:
    torch.manual_seed(seed)
    random_checkpoint(path, TINY_MOE if moe else TINY, seed=seed, dtype=torch.float32)
    write_tokenizer(path)
    tok = build_tokenizer()
    model = load_model(path, precision="fp32")
    masters = fp32_masters(model.w)
    state = LearnerState(model, masters, torch.optim.AdamW(masters.values(), lr=lr, weight_decay=0.0))
    rng, hi = random.Random(seed), 10**digits  # the warm-up's own stream of problems
    acc = 0.0
    for step in range(1, max_steps + 1):
        problems = [(rng.randrange(hi), rng.randrange(hi)) for _ in range(batch)]
        prompts = [tok.encode(f"{SPECIALS[BOS]}{a}+{b}=").ids for a, b in problems]
        answers = [tok.encode(str(a + b)).ids + [EOS] for a, b in problems]
        loss = -torch.cat(state.logprobs(prompts, answers)).mean()
        state.optimize(loss)
        if step % 50 == 0:
            with torch.no_grad():
                model.w = {n: m.detach().clone() for n, m in masters.items()}
                acc = greedy_accuracy(model, digits)
            log(f"warm-up step {step}: loss {loss.item():.3f}, greedy accuracy {acc:.2f}")
            if acc >= target_accuracy:
                break
    tensors = {n: m.detach().to(torch.bfloat16).contiguous() for n, m in masters.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "warmup.json").write_text(json.dumps({"steps": step, "greedy_accuracy": acc, "seed": seed, "digits": digits}))
    return path
