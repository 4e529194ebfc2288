"""The backward of `ops.linear`: gradients need not match anything bit for bit (only the forward must
equal the rollout's), so they are free to trade exactness for speed. Recipes (`backward=`):

- "ste" (default): straight-through on the dequantized operands, bf16-rounded, fp32 accumulation (NeMo-RL /
  Transformer Engine's "dequantized" backward): dgrad = g @ deq(W), wgrad = g.T @ deq(Q(x)), with Q(x) the
  forward's own quantized activation (saved instead of x: 4.5 bits per value instead of 16).
  On the GPU (`ste_cuda`): bf16 operands, cuBLAS on transposed views, fp32 accumulation. On the CPU
  (`ste_cpu`): the fixed-order torch GEMM, so a resumed run has the bits of an uninterrupted one.
- "nvfp4": NVIDIA's NVFP4 training recipe (`nvfp4_recipe`): gradients quantized with stochastic rounding,
  a random Hadamard transform on wgrad's operands.
- "fp8": the straight-through products on FP8 (e4m3) operands, as DeepSeek-V3 / Transformer Engine train
  (`fp8_recipe`): each operand row (along the product's inner dimension) scaled to e4m3's range by its
  amax / 448 and rounded to e4m3 (2^-4 relative), the per-row scales applied to the fp32 accumulator. The
  H200's e4m3 tensor cores run ~1.7x its bf16 ones (`torch._scaled_mm`, bf16 out); on the CPU the same
  e4m3 operands go through the fixed-order GEMM, so resumes stay exact.
"""
from __future__ import annotations

import torch

from . import nvfp4, reference
from .nvfp4 import NVFP4Tensor

BACKWARDS = ("ste", "nvfp4", "fp8")


def pad_rows16(t: torch.Tensor) -> torch.Tensor:
    """Zero-pad the last dimension to a multiple of 16 (zeros add nothing to the sums over it)."""
    pad = (-t.shape[-1]) % 16
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


def _bwd_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, R] @ b [N, R].T for the CPU backward, fp32, in the fixed-order torch GEMM: MKL's results can
    depend on buffer alignment, so they differ between processes and a resumed run would drift from an
    uninterrupted one. (The GPU backward is `ste_cuda`.)"""
    return reference.mm_plain(pad_rows16(a), pad_rows16(b))


def ste_cpu(g2: torch.Tensor, x2: torch.Tensor | None, w, xq: NVFP4Tensor | None, dequantize=nvfp4.dequantize):
    """Straight-through on the dequantized operands, bf16-rounded, fp32 accumulation (NeMo-RL/TE's
    "dequantized" backward): dgrad = g @ deq(W), wgrad = g.T @ deq(Q(x)), with Q(x) the forward's own
    quantized activation (saved instead of x: 4.5 bits per value instead of 16). The CPU path (fixed-order
    `reference.mm_plain`, fp32 operands); the GPU has `ste_cuda`. `dequantize`: as `ste_cuda`'s."""
    gb = g2.to(torch.bfloat16).float()
    if isinstance(w, NVFP4Tensor):
        wd = dequantize(w, torch.bfloat16).float()
        xd = dequantize(xq, torch.bfloat16).float()
    else:
        wd, xd = w.float(), x2.float()
    return _bwd_mm(gb, wd.T.contiguous()), _bwd_mm(gb.T.contiguous(), xd.T.contiguous())


def ste_cuda(g2: torch.Tensor, x2: torch.Tensor | None, w, xq: NVFP4Tensor | None,
             x_dtype: torch.dtype | None, w_dtype: torch.dtype | None, dequantize=nvfp4.dequantize):
    """`ste_cpu` on the GPU without fp32 round trips or materialized transposes: g as bf16 (a bf16
    grad_out is used as is), the operands dequantized straight to bf16, cuBLAS on transposed views with
    fp32 accumulation. grad_x comes out in x's dtype when that is bf16 (one rounding of the fp32
    accumulator, as the old fp32 result `.to(bf16)`), else fp32; grad_w in fp32 for fp32 masters, bf16
    for bf16 weights. x_dtype / w_dtype None: that gradient is not needed (not computed). `dequantize`:
    `nvfp4.dequantize`'s bits (the caller's: `ops` passes one that reads a weight's bf16 form where it
    carries one, `NVFP4Tensor.dequantized`, and dequantizes a shared activation once)."""
    bf16 = torch.bfloat16
    gb = g2.to(bf16)
    if isinstance(w, NVFP4Tensor):
        wd = dequantize(w, bf16) if x_dtype is not None else None
        xd = dequantize(xq, bf16) if w_dtype is not None else None
    elif w.dtype == bf16 and x2.dtype == bf16:
        wd, xd = w, x2
    else:  # fp32/fp16 plain operands: fp32 SIMT matmul on the bf16-rounded gradient, as before
        gb, wd, xd = gb.float(), w.float(), x2.float()

    grad_x = cuda_mm(gb, wd, x_dtype) if x_dtype is not None else None  # [M, N] @ [N, K]
    grad_w = cuda_mm(gb.T, xd, w_dtype) if w_dtype is not None else None  # [N, M] @ [M, K]
    return grad_x, grad_w


def cuda_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`ste_cuda`'s product a @ b (cuBLAS, fp32 accumulation): in a's dtype when `dtype` is a's (one rounding
    of the accumulator), else fp32 (bf16 operands: `out_dtype=float32`, no bf16 rounding of the result). On
    CPU tensors (tests) the same operands in an fp32 torch.mm, rounded once to that dtype."""
    f32 = torch.float32
    if not a.is_cuda:
        return torch.mm(a.float(), b.float()).to(dtype if dtype == a.dtype else f32)
    if a.dtype == f32 or dtype == a.dtype:
        return torch.mm(a, b)
    return torch.mm(a, b, out_dtype=f32)


def nvfp4_recipe(g2: torch.Tensor, x2: torch.Tensor, w: NVFP4Tensor):
    """NVIDIA's NVFP4 training recipe: gradients quantized to NVFP4 with stochastic rounding; dgrad
    against the same (2-D block scaled) weight; wgrad with a random Hadamard transform along the token
    dimension on both operands, so the rotation cancels in the product."""
    wt = w.dequantize(torch.float32).T.contiguous()  # [K, N]: valid for dgrad when w was quantized block_2d
    wq_t = nvfp4.quantize(wt, scale_mode="tensor", check_finite=False)
    gq = nvfp4.quantize(g2, rounding="stochastic", check_finite=False)
    grad_x = reference.mm_nvfp4(gq, wq_t)
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gt = nvfp4.rht(pad_rows16(g2.T.contiguous()), seed)  # [N, M16]
    xt = nvfp4.rht(pad_rows16(x2.float().T.contiguous()), seed)  # [K, M16]
    grad_w = reference.mm_nvfp4(nvfp4.quantize(gt, rounding="stochastic", check_finite=False),
                                nvfp4.quantize(xt, check_finite=False))
    return grad_x, grad_w


def _pad16(t: torch.Tensor, dim: int) -> torch.Tensor:
    pad = (-t.shape[dim]) % 16
    if not pad:
        return t
    return torch.nn.functional.pad(t, (0, pad) if dim == 1 else (0, 0, 0, pad))


def e4m3_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a [R, C] -> (e4m3 [RP, CP], fp32 scales [RP, 1]): a zero-padded to multiples of 16 in both
    dimensions (the FP8 GEMM's alignment; zero rows get scale 1 and add nothing), each row multiplied by
    1 / scale, scale = amax / 448 (1 for a zero row), and rounded to e4m3, so a ~= q * scale; row-major, as
    the FP8 GEMM wants its operands. (A multiply by the row's reciprocal, not a division per element: the
    kernel's loop is then one multiply and the hardware's e4m3 conversion a value.) The definition;
    `kernels.fp8.e4m3_rows_triton` writes the same bytes and scales in one pass, reading transposed views
    without a copy."""
    a = _pad16(_pad16(a, 1), 0).contiguous()
    amax = a.abs().amax(dim=1, keepdim=True).float()
    # nvfp4.div and a tensor numerator: true divisions on CUDA too, as the kernel's div_rn
    scale = torch.where(amax > 0, nvfp4.div(amax, nvfp4.E4M3_MAX), torch.ones_like(amax))
    return (a.float() * (torch.ones_like(scale) / scale)).to(torch.float8_e4m3fn), scale


def _fp8_mm(a: torch.Tensor, b, rows=e4m3_rows, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a [M, R] @ b [N, R].T on per-row e4m3 operands (`rows`: `e4m3_rows` or its kernel) -> [M, N] in
    `out_dtype` (fp32 or bf16); b may come already encoded, as `encode_rows(b, rows)`. The GPU's row-scaled
    GEMM writes bf16, so there fp32 is its output widened and bf16 its output itself (no fp32 round trip);
    the CPU's fp32 sums are rounded once for bf16."""
    m = a.shape[0]
    aq, sa = rows(a)
    bq, sb, n = b if isinstance(b, tuple) else encode_rows(b, rows)
    if a.is_cuda:  # row-wise scaled e4m3 GEMM (cuBLASLt), bf16 out; b column-major as it wants
        out = torch._scaled_mm(aq, bq.T, scale_a=sa, scale_b=sb.T, out_dtype=torch.bfloat16)
    else:  # the same operands, fixed-order fp32 (MKL's order depends on buffer alignment: resumes would drift)
        out = reference.mm_plain(aq.float() * sa, bq.float() * sb)
    return out[:m, :n].to(out_dtype)


def encode_rows(b: torch.Tensor, rows=e4m3_rows) -> tuple[torch.Tensor, torch.Tensor, int]:
    """An `_fp8_mm` operand encoded once, for several products: (e4m3 rows, scales, b's row count)."""
    return *rows(b), b.shape[0]


def fp8_recipe(g2: torch.Tensor, x2: torch.Tensor | None, w, xq: NVFP4Tensor | None, need_x: bool, need_w: bool,
               dequantize=nvfp4.dequantize, rows=e4m3_rows, x_dtype: torch.dtype = torch.float32,
               shared: dict | None = None):
    """dgrad = g @ deq(W) and wgrad = g.T @ deq(Q(x)) (plain weights: W and x) with both operands of each
    product in e4m3, per-row scales along the inner dimension (`rows`: `e4m3_rows` or its kernel, which
    reads the transposed views below in place). Returns (grad_x, grad_w), None where not needed: grad_w in
    fp32, grad_x in bf16 when `x_dtype` is bf16 (the activations' gradient, straight from the GEMM), else fp32.
    `shared`: a dict kept across the weights of one input (q/k/v, gate/up), so that x's operand is encoded once."""
    if isinstance(w, NVFP4Tensor):
        wd = dequantize(w, torch.bfloat16) if need_x else None
    else:
        wd = w
    gx_dtype = torch.bfloat16 if x_dtype == torch.bfloat16 else torch.float32
    grad_x = _fp8_mm(g2, wd.T, rows, gx_dtype) if need_x else None  # [M, N] @ [N, K]: rows of W^T along N
    grad_w = None
    if need_w:  # [N, M] @ [M, K]: along M
        shared = {} if shared is None else shared
        if "x_rows" not in shared:
            xd = dequantize(xq, torch.bfloat16) if isinstance(w, NVFP4Tensor) else x2
            shared["x_rows"] = encode_rows(xd.T, rows)
        grad_w = _fp8_mm(g2.T, shared["x_rows"], rows)
    return grad_x, grad_w
