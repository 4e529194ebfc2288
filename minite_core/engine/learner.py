"""The learner engine: scores whole sequences with one full-sequence forward (prefill-style, the
training path, autograd-capable) and returns the per-token logprobs of the completion tokens, with the
same definition the rollout engine uses (log_softmax(logits / temperature) at the token)."""
from __future__ import annotations

import torch

from .. import ops
from ..model.qwen3 import Qwen3


class Learner:
    def __init__(self, model: Qwen3):
        self.model = model

    def logprobs(self, prompt_ids, completion_ids, temperature: float = 1.0) -> torch.Tensor:
        """Logprobs [len(completion)] of one completion; differentiable when the model's weights require grad."""
        return self.batch_logprobs([prompt_ids], [completion_ids], temperature)[0]

    def batch_logprobs(self, prompts: list, completions: list, temperature: float = 1.0, *,
                       return_entropy: bool = False, masters: dict | None = None):
        """Score many sequences in one right-padded batch; each row's bits do not depend on the batch.
        With return_entropy, also the entropy of each completion position's full distribution. With
        `masters` (fp32 tensors by weight name), the forward reads them for this call and the logprobs
        are differentiable in them (the NVFP4 weights keep the values the rollout holds)."""
        if masters is not None:
            self.model.masters = masters
            try:
                return self.batch_logprobs(prompts, completions, temperature, return_entropy=return_entropy)
            finally:
                self.model.masters = None
        if len(prompts) != len(completions) or not prompts:
            raise ValueError("need one completion per prompt, and at least one")
        t = temperature if temperature > 0 else 1.0
        seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
        if any(len(p) == 0 for p in prompts) or any(len(c) == 0 for c in completions):
            raise ValueError("prompts and completions must be non-empty")
        longest = max(len(s) for s in seqs)
        if longest > self.model.cfg.max_position_embeddings:
            raise ValueError(f"a sequence of {longest} tokens exceeds the model's context")
        dev = self.model.device
        ids = torch.zeros(len(seqs), longest, dtype=torch.long, device=dev)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, device=dev)
        logits = self.model.logits(ids, logits_dtype=self.model.dtype)  # same values; the logprob ops upcast
        out, ent = [], []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            rows = logits[i, len(p) - 1 : len(p) + len(c) - 1]
            out.append(ops.token_logprobs(rows, torch.tensor(list(c), device=dev), t, backend=self.model.backend))
            if return_entropy:
                with torch.no_grad():
                    lsm = ops.log_softmax(rows, t, backend=self.model.backend)
                    ent.append(-(torch.exp(lsm) * lsm).sum(-1))
        return (out, ent) if return_entropy else out
