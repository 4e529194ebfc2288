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
comes before every load and store of every such kernel here (tests/kernels/test_pdl.py checks the PTX).
Completion is transitive (a kernel completes only after its own wait returned, so after its predecessor
completed), and a kernel launched without the attribute (torch's) waits for the whole previous grid.
Nothing changes in what a program computes, so the bits are those of the plain launch.

What a kernel may do before its wait: work on registers, and prefetch into L2 (`prefetch_rows`). The
decode GEMMs (swapped tiles, M <= SWAP_MAX_M) prefetch their weight rows there, so the weight stream, the bytes a
decode step is made of, overlaps the previous kernel instead of starting after it.

Off by default: on the H200 a decode layer's kernels took the same time with and without it, within the
run-to-run noise (docs/benchmarks.md, 2026-12-05); `MINITE_PDL=1` turns it on for sm_90 and later (never
under the Triton interpreter, which cannot run the PTX). bench/gemm.py and bench/rollout.py time both.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_SETTING = os.environ.get("MINITE_PDL", "0")
if _SETTING not in ("0", "1"):
    raise ValueError(f"MINITE_PDL={_SETTING!r}: set it to 1 (programmatic dependent launch on) or 0 (off)")
ENABLED = _SETTING == "1"


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def on(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL."""
    if not ENABLED or device.type != "cuda":
        return False
    from .gemm import interpreting  # (gemm imports this module)
    return not interpreting() and _supported(device.index or 0)


def launch(device: torch.device) -> dict:
    """The launch keywords of a PDL kernel: its PDL constexpr and, when on, Triton's launch attribute."""
    return {"PDL": True, "launch_pdl": True} if on(device) else {"PDL": False}


@triton.jit
def prologue():
    """A PDL kernel's first statement (`if PDL: pdl.prologue()`, so the interpreter never calls it): wait for
    the previous grid, then let the next one launch."""
    gdc_wait()
    gdc_launch_dependents()


@triton.jit
def prefetch_rows(base, rows, n_rows, stride, lo, hi):
    """Prefetch into L2 elements [lo, hi) of rows `rows` (clamped to n_rows - 1) of a row-major tensor at `base`
    (row stride `stride` elements): one request per 128-byte line. Allowed before `prologue`: a prefetch binds
    nothing, and L2 is where every SM's writes meet, so a later load after the wait sees the current bytes."""
    step: tl.constexpr = 1024 // base.dtype.element_ty.primitive_bitwidth  # elements per 128 bytes
    r = base + tl.minimum(rows, n_rows - 1).to(tl.int64) * stride
    for e in range(lo, hi, step):
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [r + e], dtype=tl.int32, is_pure=False, pack=1)
