"""The rollout engine: token-by-token sampling with a slot KV cache and continuous batching.

Requests wait in a queue; whenever a KV-cache slot is free, the next sequence joins: its prompt is
prefilled into its slot (a forward over the prompt alone), then it takes part in the batched decode
steps with every other running sequence until it stops, and its slot is freed for the next one. The
cache is bounded (`max_slots` x `max_seq_len`): more requests queue, never crash; a request that could
never fit is rejected with a ValueError.

The logprob of a sampled token is log_softmax(logits / temperature) over the full vocabulary, at that
token (temperature 0, greedy, reports temperature 1); top-k and top-p only shape the distribution the
token is drawn from. Each sequence samples from its own torch.Generator seeded from (seed, its index
among the request's n samples), so a seeded request gives the same tokens whatever runs beside it.
Because every op of the model is batch-invariant and decode == prefill, these logprobs equal, bit for
bit, those `Learner.logprobs` computes from the full sequence.
"""
from __future__ import annotations

import collections
import dataclasses
import math

import torch

from .. import ops
from ..model.qwen3 import KVCache, Qwen3

FINISH_STOP, FINISH_LENGTH = "stop", "length"


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: the whole vocabulary
    seed: int | None = None
    stop_token_ids: tuple = ()
    n: int = 1

    def validate(self) -> None:
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.n, int) and self.n >= 1):
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor  # fp32 [len(token_ids)]
    finish_reason: str
    weight_version: int
    request_index: int = 0
    sample_index: int = 0


@dataclasses.dataclass
class _Seq:
    prompt: list[int]
    params: SamplingParams
    gen: torch.Generator
    request_index: int
    sample_index: int
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    slot: int = -1
    finish: str | None = None


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, torch.Tensor]:
    """Draw one token from logits [V]; return it and its logprob (full-vocabulary log-softmax at T)."""
    t = params.temperature if params.temperature > 0 else 1.0
    logp = ops.log_softmax(logits.unsqueeze(0), t)[0]
    if params.temperature == 0:
        tok = int(torch.argmax(logits))
        return tok, logp[tok]
    shaped = logp.clone()
    if params.top_k and params.top_k < shaped.numel():
        kth = torch.topk(shaped, params.top_k).values[-1]
        shaped[shaped < kth] = float("-inf")
    if params.top_p < 1.0:
        sorted_lp, order = torch.sort(shaped, descending=True)
        probs = torch.exp(sorted_lp)
        cum = torch.cumsum(probs, 0)
        drop = cum - probs > params.top_p  # keep the smallest prefix whose mass reaches top_p
        shaped[order[drop]] = float("-inf")
    probs = torch.exp(shaped - shaped.max())
    tok = int(torch.multinomial(probs.cpu(), 1, generator=gen))
    return tok, logp[tok]


class RolloutEngine:
    def __init__(self, model: Qwen3, *, max_slots: int = 16, max_seq_len: int | None = None):
        self.model = model
        self.max_seq_len = max_seq_len or min(model.cfg.max_position_embeddings, 4096)
        if max_slots < 1 or self.max_seq_len < 2:
            raise ValueError("max_slots must be >= 1 and max_seq_len >= 2")
        self.cache = KVCache(model.cfg, max_slots, self.max_seq_len, model.dtype, model.device)
        self.weight_version = 0

    def _check_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            raise ValueError("a prompt must be a non-empty list of token ids")
        vocab = self.model.cfg.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of {self.max_seq_len} tokens")
        return list(prompt)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, *,
                 capture=None) -> list[Completion]:
        """Complete every prompt (n samples each); results in request order, then sample order.

        `capture((request_index, sample_index), op_name, rows)` receives every op's output rows of each
        sequence as the engine computes them (prefill rows, then one row per decode step)."""
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
            plist = params
        else:
            plist = [params or SamplingParams()] * len(prompts)
        queue = collections.deque()
        for r, (prompt, p) in enumerate(zip(prompts, plist)):
            p.validate()
            prompt = self._check_prompt(prompt)
            for s in range(p.n):
                seed = p.seed if p.seed is not None else int(torch.randint(0, 2**31, ()))
                gen = torch.Generator().manual_seed((seed * 1_000_003 + s) % 2**63)
                queue.append(_Seq(prompt, p, gen, r, s))
        done = self._run(queue, capture)
        done.sort(key=lambda q: (q.request_index, q.sample_index))
        return [Completion(q.prompt, q.tokens, torch.stack(q.logprobs) if q.logprobs else torch.zeros(0),
                           q.finish, self.weight_version, q.request_index, q.sample_index) for q in done]

    # -- the scheduler --------------------------------------------------------------------------
    def _append(self, seq: _Seq, logits: torch.Tensor) -> None:
        tok, lp = sample(logits, seq.params, seq.gen)
        seq.tokens.append(tok)
        seq.logprobs.append(lp)
        if tok in seq.params.stop_token_ids:
            seq.finish = FINISH_STOP
        elif len(seq.tokens) >= seq.params.max_tokens or len(seq.prompt) + len(seq.tokens) >= self.max_seq_len:
            seq.finish = FINISH_LENGTH

    @staticmethod
    def _capture_rows(capture, seqs: list[_Seq]):
        if capture is None:
            return None
        return lambda name, t: [capture((q.request_index, q.sample_index), name, t[j]) for j, q in enumerate(seqs)]

    @torch.no_grad()
    def _run(self, queue: collections.deque, capture=None) -> list[_Seq]:
        free = list(range(self.cache.slots))
        running: list[_Seq] = []
        done: list[_Seq] = []
        dev = self.model.device
        while queue or running:
            while queue and free:  # join: prefill a waiting sequence into a free slot
                seq = queue.popleft()
                seq.slot = free.pop(0)
                ids = torch.tensor([seq.prompt], device=dev)
                pos = torch.arange(len(seq.prompt), device=dev).view(1, -1)
                logits = self.model(ids, pos, self.cache, torch.tensor([seq.slot], device=dev),
                                    capture=self._capture_rows(capture, [seq]))
                self._append(seq, logits[0, -1])
                running.append(seq)
            finished = [q for q in running if q.finish]
            for q in finished:
                running.remove(q)
                free.append(q.slot)
                done.append(q)
            if finished:
                continue  # let waiting sequences join before the next decode step
            ids = torch.tensor([[q.tokens[-1]] for q in running], device=dev)
            pos = torch.tensor([[len(q.prompt) + len(q.tokens) - 1] for q in running], device=dev)
            slots = torch.tensor([q.slot for q in running], device=dev)
            logits = self.model(ids, pos, self.cache, slots, capture=self._capture_rows(capture, running))
            for q, row in zip(running, logits[:, 0]):
                self._append(q, row)
        return done
