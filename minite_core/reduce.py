"""The fixed-order sum every torch-backend reduction uses (no dependency on batch, layout or threads)."""
from __future__ import annotations

import torch


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` in a fixed order: zero-pad to a power of two, then add the halves, log2(n) times.

    Only elementwise adds, so the order cannot depend on the other dimensions (batch, rows). And
    zeros appended at the end do not change the bits: tree_sum(cat(x, 0)) == tree_sum(x). That is
    what lets a decode step over a KV cache (t+1 keys, or a padded cache) and the learner's causal
    prefill (T keys, the future ones masked to 0) sum the same terms in the same order.
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]
