"""Where the tests run: without a GPU, the Triton backend runs under the interpreter (TRITON_INTERPRET=1).

The variable must be set before any Triton kernel is defined; tests/conftest.py imports this module at
collection time, before any test module. On a CUDA machine the kernels compile for the GPU and the same
tests run there.
"""
import os
import threading

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # the torch backend is still tested
    HAS_TRITON = False

DEVICE = "cuda" if HAS_CUDA else "cpu"


def backend_params():
    """'torch' always; 'triton' marked `interpreter` on CPU, `gpu` on CUDA."""
    mark = pytest.mark.gpu if HAS_CUDA else pytest.mark.interpreter
    skip = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
    return [pytest.param("torch", id="torch"), pytest.param("triton", id="triton", marks=[mark, skip])]


class CudaScalarDivision(torch.overrides.TorchFunctionMode):
    """Division by a Python number as PyTorch's CUDA kernels do it, on the CPU: a multiply by the number's
    reciprocal (off by an ulp now and then); a tensor divisor is still divided."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__truediv__, torch.Tensor.div, torch.div) and isinstance(args[1], (int, float)) \
                and not kwargs:
            return args[0] * (1.0 / args[1])
        return func(*args, **kwargs)


def _interpreter_patches_the_language_once_a_launch():
    """Triton's interpreter (3.x) patches `triton.language` for the interpreter when a kernel launches, and again
    on every call of a `@triton.jit` helper inside it (`InterpretedFunction.__call__` -> `_patch_lang`: an
    `inspect.getmembers` walk over the language modules each time), though the launch's patch holds until it
    ends: ~40% of an interpreter-run GEMM test's time (test_ops' 100 x 224 tile-config test: 47 -> 25-29 s). Here
    a helper's call skips that walk when the modules it sees are those its launch has patched already; anything
    else (another module, no launch) patches as before. Only the test suite's speed changes: the patched
    attributes are the same objects either way. Left alone if this Triton's interpreter is laid out otherwise."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    patch_lang, grid_call = getattr(ti, "_patch_lang", None), getattr(getattr(ti, "GridExecutor", None), "__call__", None)
    if patch_lang is None or grid_call is None or not hasattr(ti, "_LangPatchScope"):
        return
    local = threading.local()  # .launches: the language modules patched by each running launch (innermost last)
    langs: dict[int, set] = {}  # a module's globals -> the language modules among them

    def langs_of(fn) -> set:
        g = fn.__globals__
        if id(g) not in langs:
            langs[id(g)] = {id(v) for v in g.values() if v is ti.tl or v is ti.tl.core}
        return langs[id(g)]

    def patch_once(fn):
        launches, mine = getattr(local, "launches", None), langs_of(fn)
        if launches and launches[-1] and mine <= launches[-1]:
            return ti._LangPatchScope()  # nothing to undo: the launch's own scope restores the language
        if launches:
            launches[-1] |= mine
        return patch_lang(fn)

    def launch(self, *args, **kwargs):
        launches = local.__dict__.setdefault("launches", [])
        launches.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    ti._patch_lang = patch_once
    ti.GridExecutor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON:
    _interpreter_patches_the_language_once_a_launch()
