"""Batched sampling for the rollout engine: one call draws the next token of every sequence in a batch.

Each row r has its own temperature T_r (0: greedy), top-k, top-p, and a 32-bit noise key derived from
its sequence's seed and the index of the token being drawn (`noise_key`). The draw is Gumbel-max over
z = logits / T_r (see `kernels.sample` for the math): the tokens a sequence gets depend on its own seed
and position only, whatever else is in the batch. Top-k and top-p become a threshold on z per row,
computed here in torch for the rows that ask for them (rare in RL, where the policy's own distribution
is the one trained on); the common rows cost one kernel pass over the vocabulary.

The reported logprob is log_softmax(logits / T)[token] over the full vocabulary (T = 1 for greedy
rows), through `ops.token_logprobs`, the very function the learner scores with: bit for bit the
learner's number for the same logits row.
"""
from __future__ import annotations

import torch

from .. import ops

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def mix32(x):
    """lowbias32 on Python ints or int64 tensors holding uint32 values (products split so they never
    overflow int64)."""
    def mul(a, c):
        return ((a * (c & 0xFFFF)) + (((a * (c >> 16)) & 0xFFFF) << 16)) & M32

    x = x ^ (x >> 16)
    x = mul(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A sequence's 32-bit seed key, from its seed (< 2^63)."""
    return mix32((seed & M32) ^ mix32(((seed >> 32) ^ GOLDEN) & M32))


def noise_key(seed_k, index):
    """The noise key of the `index`-th token drawn for a sequence with seed key `seed_k` (ints or int64 tensors)."""
    return mix32(seed_k ^ (index & M32))


def uniform_reference(keys: torch.Tensor, v: int) -> torch.Tensor:
    """Uniforms in (0, 1) [R, V] for int64 keys [R]: the kernel's integers and rounding, in torch."""
    cols = torch.arange(v, device=keys.device, dtype=torch.int64)
    h = mix32((keys.view(-1, 1) + cols * GOLDEN) & M32)
    return ((h >> 8).float() + 0.5) * 2.0 ** -24


def sample_reference(logits: torch.Tensor, seed_keys: torch.Tensor, counters: torch.Tensor, temperature: torch.Tensor,
                     threshold: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """The torch backend of `kernels.sample.sample_triton` (same arguments, same definition)."""
    keys = noise_key(seed_keys.to(torch.int64), counters.to(torch.int64))
    z = logits.float() / temperature.float().view(-1, 1)  # a tensor divisor: correctly rounded on every device
    score = torch.where(greedy.view(-1, 1), z, z - torch.log(-torch.log(uniform_reference(keys, logits.shape[1]))))
    score = torch.where(z >= threshold.view(-1, 1), score, torch.full_like(score, float("-inf")))
    return torch.argmax(score, dim=-1)


def _threshold(z: torch.Tensor, top_k: int, top_p: float) -> float:
    """The smallest z a row keeps under top-k then top-p (top-p on the full distribution's probabilities,
    over the tokens top-k kept); -inf keeps everything."""
    lp = z - torch.logsumexp(z, 0)
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k and top_k < z.numel():
        keep &= lp >= torch.topk(lp, top_k).values[-1]
    if top_p < 1.0:
        shaped = torch.where(keep, lp, torch.full_like(lp, float("-inf")))
        sorted_lp, order = torch.sort(shaped, descending=True)
        probs = torch.exp(sorted_lp)
        drop = torch.cumsum(probs, 0) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        keep[order[drop]] = False
    return float(z[keep].min())


def sample_batch(logits: torch.Tensor, rows: list, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V]; rows: per row (temperature, top_k, top_p, seed key, token index) -> (tokens int64 [R],
    logprobs fp32 [R]), both on logits' device, with no host synchronization unless a row uses top-k / top-p."""
    dev = logits.device
    temps = [r[0] if r[0] > 0 else 1.0 for r in rows]
    thresh = []
    for i, (t, k, p, _, _) in enumerate(rows):
        needs = t > 0 and ((k and k < logits.shape[1]) or p < 1.0)
        thresh.append(_threshold(logits[i].float() / torch.full_like(logits[i], temps[i], dtype=torch.float32), k, p)
                      if needs else float("-inf"))
    ints = torch.tensor([(r[3], r[4], r[0] == 0) for r in rows], dtype=torch.int64).to(dev, non_blocking=True)
    floats = torch.tensor([temps, thresh], dtype=torch.float32).to(dev, non_blocking=True)
    args = (ints[:, 0], ints[:, 1], floats[0], floats[1], ints[:, 2] != 0)
    if ops.resolve_backend(backend) == "triton":
        tokens = ops._triton("sample").sample_triton(logits, *args)
    else:
        tokens = sample_reference(logits, *args)
    logprobs = torch.empty(len(rows), dtype=torch.float32, device=dev)
    for t in sorted(set(temps)):  # one logprob call per distinct temperature; rows are independent
        idx = [i for i, ti in enumerate(temps) if ti == t]
        sel = torch.tensor(idx, device=dev) if len(idx) < len(rows) else None
        part = logits if sel is None else logits.index_select(0, sel)
        lp = ops.token_logprobs(part, tokens if sel is None else tokens.index_select(0, sel), t, backend=backend)
        if sel is None:
            logprobs = lp
        else:
            logprobs.index_copy_(0, sel, lp)
    return tokens, logprobs


ALTERNATIVES_ELEMENTS = 1 << 24  # logits values (rows x alternatives x vocabulary) one top_alternatives call holds


def top_alternatives(logits: torch.Tensor, rows: list[int], params: list, backend: str) -> list[list[tuple[int, float]]]:
    """The params[j].logprobs most likely tokens of logits row rows[j], each with its logprob at the row's
    temperature (1 for greedy), most likely first (ties: the smaller id). Each logprob comes from
    `ops.token_logprobs`, the function the sampled token's logprob and the learner's come from, so an
    alternative's logprob is bit for bit what the learner would report had that token been sampled (its rows
    are batch-invariant: the rows of one (count, temperature) go in one call, a few at a time, one host copy)."""
    out: list = [[] for _ in rows]
    groups: dict[tuple[int, float], list[int]] = {}
    for j, p in enumerate(params):
        if p.logprobs:
            groups.setdefault((p.logprobs, p.temperature if p.temperature > 0 else 1.0), []).append(j)
    for (k, t), js in groups.items():
        step = max(1, ALTERNATIVES_ELEMENTS // (k * logits.shape[-1]))
        for lo in range(0, len(js), step):
            part = js[lo:lo + step]
            sel = logits[[rows[j] for j in part]]
            # (the order of logits / t is the order of the logits; a stable sort puts the smaller id first on ties)
            ids = torch.sort(sel.float(), dim=-1, descending=True, stable=True).indices[:, :k]
            lps = ops.token_logprobs(sel.repeat_interleave(ids.shape[1], 0), ids.reshape(-1), t, backend=backend)
            for j, i_row, l_row in zip(part, ids.tolist(), lps.view(len(part), -1).tolist()):
                out[j] = list(zip(i_row, l_row))
    return out
