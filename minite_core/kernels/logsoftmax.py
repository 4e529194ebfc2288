"""Row log-sum-exp (Triton) for log-softmax and token logprobs, batch-invariant.

lse(x / T) per row, fp32: one program per row walks the vocabulary in fixed blocks of BLOCK, keeping a
BLOCK-wide running max (pass 1) and a BLOCK-wide running sum of exp(z - max) (pass 2), each reduced to a
scalar once at the end with `tl.max` / `tl.sum`. A row's result depends only on that row and on BLOCK
(a constant), never on how many rows are in the call: the rollout's one-row sample step and the
learner's many-row scoring get the same bits.

Callers form log_softmax = z - lse and a token's logprob = z[token] - lse with the same elementwise
z = x / T (IEEE division), so the rollout's full-vocabulary logprob at the sampled token and the
learner's gathered one are equal bit for bit. The learner's fused path (`TokenLogprob`) never
materializes z or the log-softmax over the vocabulary in the forward, and takes the logits in the model's
dtype (bf16): the kernels upcast each element exactly, so bf16 logits hold the values of their `.float()`
copy, without the fp32 [R, V] copy. The *bits* of the final `tl.sum` are another matter on the GPU: the
compiler lays the row block out by the load width (8 bf16 or 4 fp32 values per 16-byte load), and the
within-thread part of the reduction follows that layout, so the same values read as bf16 or as fp32 can
differ in the last bit (the interpreter sums in one order and cannot show it). Both engines therefore
pass logits in the model dtype.

Its backward, grad = g * (onehot(token) - exp(z - lse)) / T, is one more kernel: a program owns BLOCK
columns of one row, recomputes z with the same IEEE division, forms (-g * p) (+ g at the token), divides
by T and stores the result directly in the logits' dtype: one read and one write of [R, V], where the
torch formula made several fp32 [R, V] temporaries. (The same expression as that formula, in the same
order; only exp's last bits are Triton's.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import nvfp4
from .gemm import cdiv, interpreting
from .rows import round_to


@triton.jit
def _lse_kernel(X, OUT, sx, V, t, HAS_T: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    base = X + row.to(tl.int64) * sx
    m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        if HAS_T:
            x = tl.div_rn(x, t + tl.zeros_like(x))
        m_vec = tl.maximum(m_vec, x)
    m = tl.max(m_vec, axis=0)
    s_vec = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        if HAS_T:
            x = tl.div_rn(x, t + tl.zeros_like(x))
        s_vec += tl.exp(x - m)
    tl.store(OUT + row, m + tl.log(tl.sum(s_vec, axis=0)))


def lse(x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """x [..., V] (fp32/bf16) -> logsumexp(x / temperature) [...] fp32, one fixed order per row."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], device=x.device, dtype=torch.float32)
    if x2.shape[0]:
        block = 64 if interpreting() else 4096
        _lse_kernel[(x2.shape[0],)](x2, out, x2.stride(0), x2.shape[1], float(temperature),
                                    HAS_T=temperature != 1.0, BLOCK=block, num_warps=8 if block > 1024 else 4)
    return out.reshape(x.shape[:-1])


def scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = x / T in fp32, elementwise and IEEE (the same bits wherever an element sits)."""
    z = x.float()
    return nvfp4.div(z, float(temperature)) if temperature != 1.0 else z


@triton.jit
def _token_logprob_bwd_kernel(X, TOK, LSE, G, DX, sx, sdx, V, t, HAS_T: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    row64 = row.to(tl.int64)
    z = tl.load(X + row64 * sx + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_T:
        z = tl.div_rn(z, t + tl.zeros_like(z))
    g = tl.load(G + row)
    grad = -g * tl.exp(z - tl.load(LSE + row))
    grad = tl.where(cols == tl.load(TOK + row), grad + g, grad)
    if HAS_T:
        grad = tl.div_rn(grad, t + tl.zeros_like(grad))
    tl.store(DX + row64 * sdx + cols, round_to(grad, DX.dtype.element_ty), mask=mask)


def token_logprob_backward(g: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, l: torch.Tensor,
                           temperature: float) -> torch.Tensor:
    """d(z[token] - lse(z)) / d logits for logits [R, V], tokens [R], lse [R], upstream g [R] -> [R, V]
    in the logits' dtype."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    r, v = logits.shape
    out = torch.empty(r, v, device=logits.device, dtype=logits.dtype)
    if r and v:
        block = 64 if interpreting() else 4096
        _token_logprob_bwd_kernel[(r, cdiv(v, block))](
            logits, tokens.contiguous(), l.contiguous(), g.float().contiguous(), out, logits.stride(0), out.stride(0),
            v, float(temperature), HAS_T=temperature != 1.0, BLOCK=block, num_warps=8 if block > 1024 else 4)
    return out


class TokenLogprob(torch.autograd.Function):
    """logits [R, V] (fp32 or bf16), tokens [R] -> z[token] - lse(z) [R] fp32, with z = logits / T."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature):
        l = lse(logits, temperature)
        ctx.save_for_backward(logits, tokens, l)
        ctx.temperature = temperature
        return scaled(logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), temperature) - l

    @staticmethod
    def backward(ctx, g):
        logits, tokens, l = ctx.saved_tensors
        return token_logprob_backward(g, logits, tokens, l, ctx.temperature), None, None
