"""The op surface that both engines call; it picks the backend and checks the operands.

Two backends compute the same functions:
- "torch": plain PyTorch (`minite_core.nvfp4`, `minite_core.reference`), on CPU or GPU. It is the
  reference and the CI backend.
- "triton": the kernels in `minite_core.kernels`, on the GPU, or on the CPU under TRITON_INTERPRET=1.

Pick one by argument or by the MINITE_BACKEND environment variable (default "torch"). Quantization is
bit-identical across backends. The GEMMs are each batch-invariant (row m of the output depends only
on row m of x and on w) but sum in different orders, so the two backends agree to fp32-accumulation
tolerance, not bit for bit: a rollout engine and a learner must use the same backend.

`linear` is an autograd.Function: the forward is the invariant GEMM; the backward is a
straight-through estimator on the dequantized operands with library matmuls (gradients need not be
batch-invariant; only the forward must match the rollout).

A decode step of a small model is bound by kernel launches, so the ops the model chains are also offered
fused, each with the arithmetic of the chain it replaces: `linears` (projections of one input: one
activation quantize, one GEMM launch), `rms_norm` / `silu_mul` with quantize=True (the NVFP4 activation
of the next linears from the same kernel), `add_rms_norm` (the residual add in the norm's kernel),
`qk_norm_rope` (q/k RMSNorm, RoPE and the KV-cache write), `attention(out_dtype=)` (rounded in the kernel;
with quantize=True a decode step's kernel also makes the o_proj input's NVFP4). `bench/launches.py` counts what
a decode step launches.
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import NamedTuple

import torch

from . import backward as bwd
from . import nvfp4, reference
from .nvfp4 import NVFP4Tensor, check_float_input

BACKENDS = ("torch", "triton")


def resolve_backend(backend: str | None = None) -> str:
    name = backend or os.environ.get("MINITE_BACKEND", "torch")
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: expected one of {BACKENDS} (argument or MINITE_BACKEND)")
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise RuntimeError("backend 'triton' needs the triton package (pip install triton)") from e
    return name


class _NoGrad:
    """The ctx a Function's forward gets from `_call` where autograd records nothing: it keeps nothing."""

    def save_for_backward(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass


def _call(fn: type[torch.autograd.Function], *args):
    """`fn.apply(*args)`; with grad mode off (the rollout's forwards) `fn.forward` itself on a ctx that keeps
    nothing: the same outputs without autograd's bookkeeping, ~20 µs of host time a call on this CPU (an eager
    28-layer forward makes ~200 such calls: 4.5 of its 27-31 ms, measured with no-op kernels)."""
    if torch.is_grad_enabled():
        return fn.apply(*args)
    return fn.forward(_NoGrad(), *args)


@functools.cache
def _triton(name: str):
    """The Triton kernel module `kernels.<name>`, imported on first use (the torch backend runs without Triton);
    how the ops, the MoE layer and the sampler reach their kernels. Cached: an import statement in a function costs
    ~2 µs a call, and an eager forward makes hundreds of op calls."""
    return importlib.import_module(f"{__package__}.kernels.{name}")


def _check_triton_device(t: torch.Tensor, name: str) -> None:
    if not t.is_cuda and not _triton("gemm").interpreting():
        raise ValueError(f"{name} is on {t.device}: the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")


def quantize(
    x: torch.Tensor,
    *,
    scale_mode: str = "row",
    global_scale: torch.Tensor | float | None = None,
    backend: str | None = None,
    check_finite: bool = True,
    decoded: bool = False,
) -> NVFP4Tensor:
    """Fused quantize: x [..., K] -> NVFP4 with per-row (activations, the default) or per-tensor (weights)
    global scale; 1-D blocks of 16 along K. Both backends give the same bits. `decoded` (triton backend): the
    result carries its decoded form for the wide GEMM tiles (`NVFP4Tensor.decoded`) from the same kernel."""
    backend = resolve_backend(backend)
    if backend == "torch":
        return nvfp4.quantize(x, scale_mode=scale_mode, global_scale=global_scale, check_finite=check_finite)
    check_float_input(x, "x", check_finite=check_finite)
    _check_triton_device(x, "x")
    if scale_mode not in ("row", "tensor"):
        raise ValueError(f"scale_mode must be 'row' or 'tensor', got {scale_mode!r}")
    if global_scale is not None:
        global_scale = nvfp4._check_global_scale(global_scale, tuple(x.shape[:-1]), x.device)
    elif scale_mode == "tensor":
        global_scale = nvfp4.global_scale_from_amax(x.abs().amax())
    return _triton("quantize").quantize_triton(x.contiguous(), global_scale, decoded=decoded)


def _decoded_for(x: torch.Tensor) -> bool:
    """Whether the activation x [..., K] (triton backend) should carry its decoded form: its rows meet the
    GEMM's decoded tiles (`kernels.gemm.decodes_activation`), which would otherwise decode it again."""
    return _triton("gemm").decodes_activation(x.numel() // x.shape[-1] if x.shape[-1] else 0)


def _quantize_activation(x: torch.Tensor, backend: str, scale_mode: str = "row") -> NVFP4Tensor:
    """x's NVFP4 as the GEMMs read it (`_gemms`, the o_proj input after an unfused attention): with its
    decoded form when per-row scaled rows meet the decoded tiles (triton)."""
    return quantize(x, scale_mode=scale_mode, backend=backend, check_finite=False,
                    decoded=backend == "triton" and scale_mode == "row" and _decoded_for(x))


def quantize_weights(tensors: list, *, backend: str | None = None, decoded: bool = False,
                     dequantized: bool = False) -> list:
    """Per-tensor-scale NVFP4 of many weights (the learner's re-quantize of its masters), the same bits
    as `quantize(t, scale_mode="tensor")` of each. Triton backend: the amaxes in one multi-tensor
    reduction (max |x| is exact, so the global scales are the same), all the weights in one kernel launch
    (`quantize_many_triton`), then one finiteness check and host sync for all of them (an amax is finite iff
    its tensor is; checked after the launch, so the GPU quantizes while the host waits): no `abs()` /
    `isfinite()` copies of the weights, no sync and no launch per weight; `decoded`: the weights carry
    their decoded form for the wide GEMM tiles (`NVFP4Tensor.decoded`), from the same launch; `dequantized`:
    their bf16 values for the straight-through backward (`NVFP4Tensor.dequantized`, +2 bytes a weight), from
    the same launch too. Torch backend: `quantize` each (its GEMM reads the codes, its backward dequantizes)."""
    backend = resolve_backend(backend)
    if backend == "torch" or not tensors:
        return [quantize(t, scale_mode="tensor", backend=backend) for t in tensors]

    for i, t in enumerate(tensors):
        check_float_input(t, f"tensors[{i}]", check_finite=False)
        _check_triton_device(t, f"tensors[{i}]")
    if len({(t.dtype, t.device) for t in tensors}) > 1:
        raise ValueError("quantize_weights: the tensors must share one dtype and one device")
    amax = torch.stack([a.float() for a in torch._foreach_norm(list(tensors), float("inf"))])
    decoded = decoded and _triton("gemm").OPERANDS_DECODED_ONCE
    out = _triton("quantize").quantize_many_triton([t.contiguous() for t in tensors],
                                                   nvfp4.global_scale_from_amax(amax), decoded, dequantized)
    if not bool(torch.isfinite(amax).all()):
        bad = [i for i, ok in enumerate(torch.isfinite(amax).tolist()) if not ok]
        raise ValueError(f"tensors {bad} contain NaN or Inf values")
    return out


def _check_linear(x, w, bias, name: str = "w"):
    check_float_input(x, "x", check_finite=False)
    if isinstance(w, NVFP4Tensor):
        wshape = w.shape
    elif isinstance(w, torch.Tensor):
        if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{name} must be an NVFP4Tensor or a float32/bfloat16/float16 tensor, got {w.dtype}")
        wshape = w.shape
    else:
        raise TypeError(f"{name} must be an NVFP4Tensor or a torch.Tensor, got {type(w).__name__}")
    if len(wshape) != 2:
        raise ValueError(f"{name} must be 2-D [N, K], got shape {tuple(wshape)}")
    if x.shape[-1] != wshape[1]:
        raise ValueError(f"shape mismatch: x has K={x.shape[-1]} (shape {tuple(x.shape)}) but {name} is {tuple(wshape)}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but {name} is on {w.device}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != wshape[0]):
        raise ValueError(f"bias of {name} must have shape ({wshape[0]},), got {tuple(bias.shape)}")


def _gemms(x: torch.Tensor, ws: list, biases: list, out_dtype, backend: str, scale_mode: str, xq=None):
    """The forward products of x [..., K] with each weight, both backends -> (outs [..., N_w], the quantized x
    or None for plain weights). NVFP4: x is quantized once for all the weights (unless the caller gives `xq`)."""
    if isinstance(ws[0], NVFP4Tensor) and xq is None:
        xq = _quantize_activation(x, backend, scale_mode)
    if backend == "torch":
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        xq2 = xq.rows() if xq is not None else None
        outs = []
        for w, bias in zip(ws, biases):
            out = reference.mm_nvfp4(xq2, w) if xq2 is not None else reference.mm_plain(x2.to(w.dtype), w)
            if bias is not None:
                out = out + bias.float()
            outs.append(out.to(out_dtype).reshape(*lead, w.shape[0]))
        return outs, xq
    gemm_many_triton = _triton("gemm").gemm_many_triton
    _check_triton_device(x, "x")
    if xq is not None:  # (its rows as they are: the kernels read a model's [B, T, K] without a reshape)
        return gemm_many_triton(xq, ws, biases, out_dtype), xq
    return gemm_many_triton(x.to(ws[0].dtype).contiguous(), [w.contiguous() for w in ws], biases, out_dtype), None


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16, *, backend: str | None = None) -> torch.Tensor:
    """NVFP4 -> `dtype`, the same bits on both backends (`nvfp4.dequantize`; the triton backend in one
    kernel pass: 0.56 bytes read and 2 written per bf16 value)."""
    backend = resolve_backend(backend)
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"dequantize needs an NVFP4Tensor, got {type(t).__name__}")
    if backend == "torch":
        return nvfp4.dequantize(t, dtype)
    _check_triton_device(t.data, "t")
    return _triton("quantize").dequantize_triton(t, dtype)


class _Linears(torch.autograd.Function):
    """x @ w_i.T (+ b_i) for n weights of one input: one output per weight."""

    @staticmethod
    def forward(ctx, x, ws, xq, out_dtype, backend, scale_mode, bwd, *params):
        # params: per weight, the tensor that receives its gradient (the high-precision master it was
        # quantized or cast from while training, else a plain w itself, or None for an NVFP4 weight
        # without a master), then the n biases.
        n = len(ws)
        w_tensors, biases = params[:n], params[n:]
        outs, xq = _gemms(x, list(ws), list(biases), out_dtype, backend, scale_mode, xq)
        if not isinstance(ctx, _NoGrad):  # (a forward under no_grad keeps nothing for a backward)
            # the straight-through backward of an NVFP4 linear needs only Q(x); the others need x itself
            keep_x = xq is None or bwd == "nvfp4"
            ctx.save_for_backward(x if keep_x else None, *w_tensors)
            # its rows, without the decoded form, which the backward does not read (2 bytes a value held until it runs)
            ctx.xq = None if keep_x else xq.rows().without_caches()
            ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
            ctx.ws, ctx.bwd, ctx.has_bias, ctx.backend = ws, bwd, [b is not None for b in biases], backend
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        x, *w_tensors = ctx.saved_tensors
        n = len(ctx.ws)
        need_x = ctx.needs_input_grad[0]
        x2 = x.reshape(-1, x.shape[-1]) if x is not None else None
        grad_x, grad_ws, grad_bs = None, [], []
        deq, shared = _dequantizer(ctx.backend, ctx.xq), {}
        for i, (w, w_tensor, grad_out) in enumerate(zip(ctx.ws, w_tensors, grad_outs)):
            need_w = w_tensor is not None and ctx.needs_input_grad[7 + i]
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            gx, gw = _linear_grads(ctx, g2, x2, w, w_tensor, need_x, need_w, deq, shared)
            if need_x:
                gx = gx.reshape(ctx.x_shape).to(ctx.x_dtype)
                grad_x = gx if grad_x is None else grad_x + gx  # the weights' order: fixed
            grad_ws.append(gw.to(w_tensor.dtype) if need_w else None)
            need_b = ctx.has_bias[i] and ctx.needs_input_grad[7 + n + i]
            grad_bs.append((g2.sum(0, dtype=torch.float32) if g2.is_cuda else g2.float().sum(0)) if need_b else None)
        ctx.xq = None
        return grad_x, None, None, None, None, None, None, *grad_ws, *grad_bs


def _linear_grads(ctx, g2, x2, w, w_tensor, need_x: bool, need_w: bool, deq, shared: dict):
    """(grad_x, grad_w) of one weight by the recipe `ctx.bwd` (`minite_core.backward`); `deq`: the dequantize;
    `shared`: what the weights of one `linears` call compute once (fp8: x's e4m3 operand)."""
    if ctx.bwd == "nvfp4" and isinstance(w, NVFP4Tensor):
        return bwd.nvfp4_recipe(g2.float(), x2, w)
    if ctx.bwd == "fp8":
        rows = bwd.e4m3_rows
        if resolve_backend(ctx.backend) == "triton":
            rows = _triton("fp8").e4m3_rows_triton
        return bwd.fp8_recipe(g2, x2, w, ctx.xq, need_x, need_w, deq, rows, ctx.x_dtype, shared)
    if g2.is_cuda:
        return bwd.ste_cuda(g2, x2, w, ctx.xq, ctx.x_dtype if need_x else None, w_tensor.dtype if need_w else None, deq)
    return bwd.ste_cpu(g2.float(), x2, w, ctx.xq, deq)  # CPU: the fixed-order fp32 path (reproducible resumes)


def _dequantizer(backend: str, xq):
    """`dequantize` on `backend` that dequantizes the activation xq once: every weight's wgrad of one
    `linears` call reads the same Q(x); a weight that carries its bf16 values (`NVFP4Tensor.dequantized`, the
    learner's, from its re-quantize) is not dequantized again."""
    done = {}

    def deq(t, dtype):
        if t.dequantized is not None and dtype == t.dequantized.dtype:
            return t.dequantized
        if t is not xq:
            return dequantize(t, dtype, backend=backend)
        if dtype not in done:
            done[dtype] = dequantize(t, dtype, backend=backend)
        return done[dtype]
    return deq


def linear(
    x: torch.Tensor,
    w,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    scale_mode: str = "row",
    backend: str | None = None,
    check_finite: bool = True,
    master: torch.Tensor | None = None,
    backward: str = "ste",
) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) with fp32 accumulation, batch-invariant.

    w is an NVFP4Tensor [N, K] (W4A4: x is quantized per row inside, or per tensor with
    scale_mode="tensor") or a plain float tensor [N, K] (x is cast to w's dtype). Output dtype
    defaults to x's. For training, `master` is the high-precision tensor an NVFP4 `w` was quantized
    from: it receives the weight gradient, computed by `backward` = "ste" (straight-through on the
    dequantized operands in bf16), "nvfp4" (NVIDIA's recipe: stochastic rounding, RHT on wgrad) or "fp8"
    (the straight-through products on e4m3 operands with per-row scales): `minite_core.backward`.
    A plain `w` may have a master too (w must hold master's values in w's dtype, e.g. the rollout's bf16
    copy of an fp32 master): the weight gradient then goes to the master in its dtype, straight from the
    fp32 accumulator (no bf16 rounding of the gradient, no cast of the master in the forward).
    """
    return linears(x, [w], [bias], out_dtype=out_dtype, scale_mode=scale_mode, backend=backend,
                   check_finite=check_finite, masters=[master], backward=backward)[0]


def linears(
    x: torch.Tensor,
    ws: list,
    biases: list | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    scale_mode: str = "row",
    backend: str | None = None,
    check_finite: bool = True,
    masters: list | None = None,
    backward: str = "ste",
    xq: NVFP4Tensor | None = None,
) -> list[torch.Tensor]:
    """[linear(x, w, b, master=m) for w, b, m in zip(ws, biases, masters)], the same bits, in one pass:
    several projections of one input (q/k/v, gate/up) share one activation quantize and, on the triton
    backend, one GEMM launch (`kernels.gemm.gemm_many_triton`). The weights must be all NVFP4 or all plain
    of one dtype; arguments as `linear`'s. `xq` (NVFP4 weights, scale_mode "row"): x's quantize, made by
    the op that produced x (`rms_norm` / `silu_mul` with quantize=True, the bits of `quantize(x)`), so
    that it is not quantized again."""
    backend = resolve_backend(backend)
    ws = list(ws)
    biases = list(biases) if biases is not None else [None] * len(ws)
    masters = list(masters) if masters is not None else [None] * len(ws)
    if not ws or len(biases) != len(ws) or len(masters) != len(ws):
        raise ValueError(f"linears needs one bias and one master (or None) per weight: {len(ws)} weights, "
                         f"{len(biases)} biases, {len(masters)} masters")
    for i, (w, bias) in enumerate(zip(ws, biases)):
        _check_linear(x, w, bias, "w" if len(ws) == 1 else f"ws[{i}]")
    kinds = {"nvfp4" if isinstance(w, NVFP4Tensor) else w.dtype for w in ws}
    if len(kinds) > 1:
        raise ValueError(f"linears: the weights must be all NVFP4 or all of one float dtype, got {sorted(map(str, kinds))}")
    if check_finite and x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("x contains NaN or Inf values")
    if scale_mode not in ("row", "tensor"):
        raise ValueError(f"scale_mode must be 'row' or 'tensor', got {scale_mode!r}")
    if backward not in bwd.BACKWARDS:
        raise ValueError(f"backward must be one of {bwd.BACKWARDS}, got {backward!r}")
    for w, master in zip(ws, masters):
        if master is not None and tuple(master.shape) != tuple(w.shape):
            raise ValueError(f"master weight has shape {tuple(master.shape)}, but w is {tuple(w.shape)}")
    if xq is not None:
        if "nvfp4" not in kinds or scale_mode != "row":
            raise ValueError("linears: xq is the per-row NVFP4 activation of NVFP4 weights (scale_mode 'row')")
        if not isinstance(xq, NVFP4Tensor) or tuple(xq.shape) != tuple(x.shape) or not xq.per_row:
            raise ValueError(f"linears: xq must be the per-row NVFP4Tensor of x {tuple(x.shape)}")
    out_dtype = out_dtype or x.dtype
    w_tensors = [m if m is not None or isinstance(w, NVFP4Tensor) else w for w, m in zip(ws, masters)]
    return list(_call(_Linears, x, tuple(ws), xq, out_dtype, backend, scale_mode, backward, *w_tensors, *biases))


# ------------------------------------------------------------------------------- row-local ops
# The torch backend runs `reference` (elementwise ops and `reduce.tree_sum`); the triton backend runs
# `kernels.rows` (forward and backward kernels). Both are batch-invariant and decode == prefill by
# construction; they agree within a rounding of the output dtype, not bit for bit.


def _check_quantizable(t: torch.Tensor, op: str) -> None:
    if t.shape[-1] % nvfp4.BLOCK:
        raise ValueError(f"{op}(quantize=True): the last dimension ({t.shape[-1]}) must be a multiple of {nvfp4.BLOCK}")


def _with_nvfp4(out, shape, quantize: bool):
    """A row op's Function result -> y, or (y, its NVFP4Tensor) with `quantize`."""
    if not quantize:
        return out
    return out[0], _triton("quantize").as_nvfp4(out[1:], tuple(shape))


def _rms_norm(x, delta, weight, eps: float, backend: str | None, quantize: bool) -> tuple:
    """-> (s, y, yq): s = x + delta (x itself when delta is None), y = rms_norm(s), yq = quantize(y) or None."""
    backend = resolve_backend(backend)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    if quantize:
        _check_quantizable(x, "rms_norm")
    if backend == "triton":
        _check_triton_device(x, "x")
        if weight.device != x.device:
            raise ValueError(f"x is on {x.device} but the rms_norm weight is on {weight.device}")
        out = _call(_triton("rows").RMSNormFunction, x, weight, float(eps), quantize, delta,  # y[, s][, NVFP4]
                    quantize and _decoded_for(x))
        out = out if isinstance(out, tuple) else (out,)
        s, q = (out[1], out[2:]) if delta is not None else (x, out[1:])
        return s, out[0], (_triton("quantize").as_nvfp4(q, tuple(x.shape)) if quantize else None)
    s = x + delta if delta is not None else x
    y = reference.rms_norm(s, weight, eps)
    return s, y, (nvfp4.quantize(y, check_finite=False) if quantize else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, backend: str | None = None,
             quantize: bool = False):
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32 (HF's Qwen3RMSNorm).
    `quantize=True` -> (y, quantize(y)): y and its NVFP4 with per-row global scales (the activation of the
    linears it feeds, `linears(..., xq=)`), on the triton backend from the same kernel."""
    _, y, yq = _rms_norm(x, None, weight, eps, backend, quantize)
    return (y, yq) if quantize else y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                 backend: str | None = None, quantize: bool = False) -> tuple:
    """The residual add and the next RMSNorm in one op: s = x + delta (rounded once to x's dtype, as `x + delta`),
    y = rms_norm(s) -> (s, y, quantize(y) with `quantize`, else None). One kernel on the triton backend."""
    if delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device:
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} {delta.dtype} must match x {tuple(x.shape)} {x.dtype}")
    return _rms_norm(x, delta, weight, eps, backend, quantize)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None, quantize: bool = False):
    """silu(gate) * up in fp32, rounded once to gate's dtype (SwiGLU). `quantize=True` -> (h, quantize(h)),
    as `rms_norm`'s."""
    backend = resolve_backend(backend)
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul operands differ in shape: {tuple(gate.shape)} vs {tuple(up.shape)}")
    if quantize:
        _check_quantizable(gate, "silu_mul")
    if backend == "triton":
        _check_triton_device(gate, "gate")
        if up.device != gate.device:
            raise ValueError(f"gate is on {gate.device} but up is on {up.device}")
        out = _call(_triton("rows").SiluMulFunction, gate, up, quantize, quantize and _decoded_for(gate))
        return _with_nvfp4(out, gate.shape, quantize)
    h = reference.silu_mul(gate, up)
    return (h, nvfp4.quantize(h, check_finite=False)) if quantize else h


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """NeoX rotate-half RoPE: x * cos + rotate_half(x) * sin, x [B, H, T, D], cos/sin [B or 1, 1, T, D].
    torch: in x's dtype, each op rounded (HF's expression); triton: in fp32, rounded once."""
    backend = resolve_backend(backend)
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rope needs x [B, H, T, D] with an even D, got shape {tuple(x.shape)}")
    b, _, t, d = x.shape
    for name, c in (("cos", cos), ("sin", sin)):
        if c.dim() != 4 or c.shape[0] not in (1, b) or tuple(c.shape[1:]) != (1, t, d):
            raise ValueError(f"rope {name} has shape {tuple(c.shape)}, expected ({b}, 1, {t}, {d})")
        if c.device != x.device:
            raise ValueError(f"x is on {x.device} but rope {name} is on {c.device}")
    if backend == "triton":
        _check_triton_device(x, "x")
        return _call(_triton("rows").RopeFunction, x, cos, sin)
    return reference.rope(x, cos, sin)


class QKHeads(NamedTuple):
    """`qk_norm_rope`'s result: the attention's q, k, v [B, H, T, D] (k, v None when written to the cache),
    and the normalized q, k [B, T, H, D] before RoPE (with norm_out, else None)."""
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor, *, backend: str | None = None,
                 cache: tuple | None = None, norm_out: bool = False) -> QKHeads:
    """Qwen3's attention inputs from the projections q [B, T, Hq, D], k and v [B, T, Hkv, D]: RMSNorm over each
    head of q and k (`rms_norm` with the q_norm / k_norm weights), then NeoX RoPE (`rope`, cos/sin
    [B or 1, 1, T, D]); q, k and v returned as [B, H, T, D] views. `cache` = (k_cache, v_cache [slots, Hkv,
    capacity, D], slots [B], positions [B, T]): the rotated k and v are written into each sequence's cache
    row at its positions (inference) and returned as None. The triton backend does all of it in one
    kernel: the norm and rope kernels' arithmetic (`kernels.qk_norm_rope`)."""
    backend = resolve_backend(backend)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"qk_norm_rope shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, t, hkv, d = k.shape
    if q_weight.shape != (d,) or k_weight.shape != (d,):
        raise ValueError(f"q/k norm weights must have shape ({d},), got {tuple(q_weight.shape)}, {tuple(k_weight.shape)}")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.dim() != 4 or c.shape[0] not in (1, b) or tuple(c.shape[1:]) != (1, t, d):
            raise ValueError(f"qk_norm_rope {name} has shape {tuple(c.shape)}, expected ({b}, 1, {t}, {d})")
    if cache is not None:
        k_cache, v_cache, slots, positions = cache
        if (k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[1::2]) != (hkv, d)
                or tuple(slots.shape) != (b,) or tuple(positions.shape) != (b, t)):
            raise ValueError(f"qk_norm_rope cache: k/v caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be "
                             f"[slots, {hkv}, capacity, {d}], slots {tuple(slots.shape)} [{b}], positions "
                             f"{tuple(positions.shape)} [{b}, {t}] (values in range: the caller's, as for attention's kv_rows)")
    if cache is not None and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise ValueError("qk_norm_rope into a KV cache is for inference: it has no backward")
    if backend == "triton":
        kernel = _triton("qk_norm_rope")
        _check_triton_device(q, "q")
        if d & (d - 1) or d < 16:
            raise ValueError(f"the Triton qk_norm_rope needs a power-of-two head_dim >= 16, got {d}")
        if cache is not None:
            qo, _, qn, kn, _, _ = kernel.qk_norm_rope_forward(q, k, v, q_weight, k_weight, eps, cos, sin, cache, norm_out)
            return QKHeads(qo, None, None, qn, kn)
        out = _call(kernel.QKNormRopeFunction, q, k, q_weight, k_weight, float(eps), cos, sin, norm_out)
        return QKHeads(out[0], out[1], v.transpose(1, 2), *(out[2:] if norm_out else (None, None)))
    qn, kn = reference.rms_norm(q, q_weight, eps), reference.rms_norm(k, k_weight, eps)
    qr, kr = reference.rope(qn.transpose(1, 2), cos, sin), reference.rope(kn.transpose(1, 2), cos, sin)
    vt = v.transpose(1, 2)
    if cache is not None:
        k_cache, v_cache, slots, positions = cache
        rows_ = slots.view(-1, 1).expand(positions.shape)
        k_cache[rows_, :, positions] = kr.transpose(1, 2)
        v_cache[rows_, :, positions] = v
        kr = vt = None
    return QKHeads(qr, kr, vt, qn if norm_out else None, kn if norm_out else None)


def log_softmax(logits: torch.Tensor, temperature: float = 1.0, *, backend: str | None = None) -> torch.Tensor:
    """log_softmax(logits / temperature) over the last dimension, fp32."""
    backend = resolve_backend(backend)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if backend == "triton":
        k = _triton("logsoftmax")
        _check_triton_device(logits, "logits")
        return k.scaled(logits, temperature) - k.lse(logits, temperature).unsqueeze(-1)
    return reference.log_softmax(logits, temperature)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *,
                   backend: str | None = None) -> torch.Tensor:
    """log_softmax(logits / temperature)[..., token]: the logprob both engines report for a sampled token.
    The triton backend's is fused (no log-softmax over the vocabulary in the forward) and equals
    `log_softmax(...)[token]` of the same backend bit for bit."""
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} do not match logits {tuple(logits.shape)}")
    if resolve_backend(backend) == "triton":
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        _check_triton_device(logits, "logits")
        out = _call(_triton("logsoftmax").TokenLogprob, logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1),
                    float(temperature))
        return out.reshape(tokens.shape)
    return log_softmax(logits, temperature, backend=backend).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor, *,
              scale: float | None = None, backend: str | None = None, kv_rows: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, quantize: bool = False):
    """Causal GQA attention, q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] -> fp32; see `reference.attention`
    (torch backend) and `kernels.attention` (triton backend). Either way prefill == decode, bit for bit.
    `kv_rows` [B] (inference): k/v are a whole slot cache [S, Hkv, Tk, D], sequence b attends over row
    kv_rows[b]; the same result as passing k[kv_rows], v[kv_rows], without copying the cache rows.
    `out_dtype`: the fp32 result rounded to that dtype (the triton backend rounds in the kernel and lays
    the output out as [B, Tq, Hq, D], returning its [B, Hq, Tq, D] view).
    `quantize=True` (inference, with `out_dtype`) -> (out, the per-row NVFP4 of out as the o_proj reads it,
    [B, Tq, Hq * D]): the bits of `quantize` on it; a triton decode step over a cache makes it in the attention
    kernel itself (`kernels.attention.fuses_quantize`), every other call with `quantize`."""
    backend = resolve_backend(backend)
    rows_ok = q.shape[0] == k.shape[0] if kv_rows is None else tuple(kv_rows.shape) == (q.shape[0],)
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or not rows_ok or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
                         + ("" if kv_rows is None else f", kv_rows {tuple(kv_rows.shape)}"))
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if quantize:
        return _attention_quantized(q, k, v, q_pos, kv_len, scale, backend, kv_rows, out_dtype)
    if backend == "triton":
        kernel = _triton("attention")
        _check_triton_device(q, "q")
        if kv_rows is not None:
            if torch.is_grad_enabled() and q.requires_grad:
                raise ValueError("attention over cache rows (kv_rows) is for inference: it has no backward")
            return kernel.attention_forward(q, k, v, q_pos, kv_len, scale, kv_rows=kv_rows, out_dtype=out_dtype)
        return _call(kernel.AttentionFunction, q, k, v, q_pos, kv_len, scale, out_dtype)
    if kv_rows is not None:
        k, v = k[kv_rows], v[kv_rows]
    out = reference.attention(q, k, v, q_pos, kv_len, scale)
    return out if out_dtype is None else out.to(out_dtype)


def _attention_quantized(q, k, v, q_pos, kv_len, scale: float, backend: str, kv_rows, out_dtype):
    """`attention(..., quantize=True)`: (out, quantize(out as [B, Tq, Hq * D]))."""
    if out_dtype is None or (torch.is_grad_enabled() and q.requires_grad):
        raise ValueError("attention(quantize=True) is for inference (no autograd), with out_dtype set")
    b, hq, tq, d = q.shape
    if hq * d % nvfp4.BLOCK:
        raise ValueError(f"attention(quantize=True): the output rows' width Hq * D ({hq * d}) must be a multiple of {nvfp4.BLOCK}")
    if backend == "triton" and kv_rows is not None:
        kernel = _triton("attention")
        if kernel.fuses_quantize(tq, hq, d, out_dtype):
            _check_triton_device(q, "q")
            out, parts = kernel.attention_forward(q, k, v, q_pos, kv_len, scale, kv_rows=kv_rows, out_dtype=out_dtype,
                                                  quantize=True, decoded=_triton("gemm").decodes_activation(b * tq))
            return out, _triton("quantize").as_nvfp4(parts, (b, tq, hq * d))
    out = attention(q, k, v, q_pos, kv_len, scale=scale, backend=backend, kv_rows=kv_rows, out_dtype=out_dtype)
    return out, _quantize_activation(out.transpose(1, 2).reshape(b, tq, hq * d), backend)
