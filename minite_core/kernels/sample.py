"""Batched token sampling (Triton): Gumbel-max over the vocabulary with counter-based noise.

Drawing token v with probability softmax(z)[v], z = logits / T, is the same as taking
argmax_v (z_v + g_v) with g_v = -log(-log(u_v)) and u_v independent uniforms (the Gumbel-max trick):
no softmax, no cumulative sum, no host round trip, one pass over the row. Top-k / top-p restrict the
draw to the tokens with z >= a per-row threshold (computed by the caller, `engine.sampler`); greedy
rows take argmax z (no noise). Ties go to the smallest token id, as torch.argmax.

The uniforms come from a counter-based hash, not from a stateful generator: u_v = h(key, v), with
key = mix32(seed_key ^ index), seed_key a 32-bit function of the sequence's seed and index the
position of the token being drawn among the sequence's generated tokens. A sequence's draws
therefore depend only on its own seed and position, never on which other sequences share the batch
or on how the engine schedules them, and the same (logits, seed, position) gives the same token on
every call. h is Chris Wellons' "lowbias32" integer mixer applied to key + v * 0x9E3779B9 (mod 2^32),
and u = (top 24 bits + 0.5) / 2^24, strictly inside (0, 1) so g is always finite. It is a statistical
hash, not a cryptographic one, which is what sampling needs.

The torch reference (`engine.sampler.sample_reference`) computes the same integers and the same
formula in int64 / fp32 torch ops; the two agree on every hash bit, and on the tokens up to the last
ulp of log() (different libm on different devices), i.e. except for near-exact ties.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import interpreting



@triton.jit
def _mix32(x):
    """lowbias32 on uint32 lanes (wrapping multiplies, logical shifts)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _uniform(key, cols):
    """key: uint32 scalar, cols: int32 token ids -> uniforms in (0, 1), fp32, exact multiples of 2^-25."""
    h = _mix32(key + cols.to(tl.uint32) * 0x9E3779B9)
    return ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24


@triton.jit
def _gumbel(key, cols):
    return -tl.log(-tl.log(_uniform(key, cols)))


@triton.jit
def _sample_kernel(X, SEEDKEYS, COUNTERS, TEMP, THRESH, GREEDY, OUT, sx, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols0 = tl.arange(0, BLOCK)
    base = X + row.to(tl.int64) * sx
    key = _mix32(tl.load(SEEDKEYS + row).to(tl.uint32) ^ tl.load(COUNTERS + row).to(tl.uint32))
    t = tl.load(TEMP + row)
    thresh = tl.load(THRESH + row)
    greedy = tl.load(GREEDY + row) != 0
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        ok = cols < V
        x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        z = tl.div_rn(x, t + tl.zeros_like(x))
        score = tl.where(greedy, z, z + _gumbel(key, cols))
        score = tl.where(ok & (z >= thresh), score, float("-inf"))
        better = score > best  # strict: within a lane the earlier (smaller) id keeps a tie
        best_i = tl.where(better, cols, best_i)
        best = tl.maximum(best, score)
    top = tl.max(best, axis=0)
    tl.store(OUT + row, tl.min(tl.where(best == top, best_i, 2147483647), axis=0))


@triton.jit
def _uniform_kernel(KEYS, OUT, V, BLOCK: tl.constexpr):
    """Test hook: the uniforms behind the Gumbel noise the sampling kernel adds, for one row."""
    row = tl.program_id(0)
    key = tl.load(KEYS + row).to(tl.uint32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        tl.store(OUT + row * V + cols, _uniform(key, cols), mask=cols < V)


def _block() -> int:
    return 64 if interpreting() else 2048


def sample_triton(logits: torch.Tensor, seed_keys: torch.Tensor, counters: torch.Tensor, temperature: torch.Tensor,
                  threshold: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """logits [R, V]; per row: the sequence's seed key (uint32 values in int64), the index of the token being
    drawn (its noise key is mix32(seed_key ^ counter)), temperature (fp32, > 0), threshold (fp32, z below
    it is excluded; -inf: none), greedy (bool) -> token ids int64 [R]. No host synchronization."""
    r, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(r, dtype=torch.int32, device=logits.device)
    if r:
        _sample_kernel[(r,)](logits, seed_keys.to(torch.int64).contiguous(), counters.to(torch.int64).contiguous(),
                             temperature.float().contiguous(),
                             threshold.float().contiguous(), greedy.to(torch.int8).contiguous(), out,
                             logits.stride(0), v, BLOCK=_block(), num_warps=8 if not interpreting() else 4)
    return out.long()


def uniform_triton(keys: torch.Tensor, v: int) -> torch.Tensor:
    """The uniforms [R, V] behind the kernel's noise for `keys` (tests compare them with the reference's)."""
    out = torch.empty(keys.shape[0], v, dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        _uniform_kernel[(keys.shape[0],)](keys.to(torch.int64).contiguous(), out, v, BLOCK=_block())
    return out
