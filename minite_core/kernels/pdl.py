"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode step is a chain of ~10 small kernels a layer (norm, GEMM, q/k norm + RoPE, attention, ...), each
running a few microseconds; between two of them the GPU drains the first grid, flushes its writes, then
launches and ramps up the next (~1-2 us a boundary even inside a CUDA graph). With PDL the next kernel is
launched while the previous one still runs: it is launched with the programmatic-serialization attribute
(Triton's `launch_pdl=True`), its programs become resident and wait in `griddepcontrol.wait` until the
previous grid has completed and its memory is visible; the previous grid lets it launch early with
`griddepcontrol.launch_dependents`. The launch and the ramp-up of one kernel hide behind the tail of the
one before.

The rule that keeps it correct: a kernel launched with PDL calls `wait` before it touches global memory
(reads of what an earlier kernel wrote, and writes to what an earlier kernel may still read), so `prologue`
is the first statement of every such kernel here. Completion is transitive (a kernel completes only after
its own wait returned, so after its predecessor completed), and a kernel launched without the attribute
(torch's) waits for the whole previous grid as usual. Nothing changes in what a program computes, so the
bits are those of the plain launch.

Off under the Triton interpreter (it cannot run the PTX) and on GPUs before sm_90; `MINITE_PDL=0` turns it
off (bench/gemm.py and bench/rollout.py time both).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = os.environ.get("MINITE_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def on(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL."""
    from .gemm import interpreting  # gemm imports this module
    return ENABLED and device.type == "cuda" and not interpreting() and _supported(device.index or 0)


def launch(device: torch.device) -> dict:
    """The launch keywords of a PDL kernel: its PDL constexpr and, when on, Triton's launch attribute."""
    return {"PDL": True, "launch_pdl": True} if on(device) else {"PDL": False}


@triton.jit
def prologue():
    """A PDL kernel's first statement (`if PDL: pdl.prologue()`, so the interpreter never calls it): wait for
    the previous grid, then let the next one launch."""
    gdc_wait()
    gdc_launch_dependents()
