"""Where the tests run: without a GPU, the Triton backend runs under the interpreter (TRITON_INTERPRET=1).

The variable must be set before any Triton kernel is defined; tests/conftest.py imports this module at
collection time, before any test module. On a CUDA machine the kernels compile for the GPU and the same
tests run there.
"""
import os

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
