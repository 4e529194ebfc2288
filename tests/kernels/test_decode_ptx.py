"""The GPU's FP4 decode (`gemm._E2M1X8_PTX`, inline PTX that the interpreter cannot run), checked on the CPU
by executing its text: a small evaluator of the PTX instructions it uses runs it on every 16-bit pair of
packed bytes, and the outputs must be the E2M1 values times 2^-6 (`nvfp4.E2M1_VALUES`), in the order
Triton hands the operands over. On a GPU the same asm runs inside every W4A4 kernel, and the kernel tests
(tests/core/test_ops.py: every code and scale byte, dequantize == the definition) check it there.

The evaluator's reading of the two non-obvious instructions: `mov.b32 {a, b}, x` puts x's low 16 bits in
a; `cvt.rn.f16x2.e4m3x2 d, h` converts h's low byte into d's low half (the order Triton's own fp8 -> f16
conversion relies on). Triton packs element 0 of a group into the low bits of a register, for operands and
results alike.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from minite_core import nvfp4
from minite_core.kernels import gemm

MASK32 = 0xFFFFFFFF


def _e4m3_to_f16_bits(byte: np.ndarray) -> np.ndarray:
    f = torch.from_numpy(byte.astype(np.uint8)).view(torch.float8_e4m3fn).to(torch.float16)
    return f.view(torch.int16).numpy().astype(np.uint32) & 0xFFFF


def run_ptx(asm: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute `asm` (the subset of PTX the decode uses) on uint32 arrays; operands $n are given in `inputs`."""
    regs: dict[str, np.ndarray] = {k: v.astype(np.uint32) for k, v in inputs.items()}

    def val(tok: str) -> np.ndarray | int:
        tok = tok.strip()
        if tok.startswith("0x"):
            return int(tok, 16)
        if tok.isdigit():
            return int(tok)
        return regs[tok]

    body = asm.strip().removeprefix("{").removesuffix("}")
    for line in filter(None, (ln.strip() for ln in body.split(";"))):
        if line.startswith(".reg"):
            continue
        m = re.fullmatch(r"(\S+)\s+(.*)", line)
        op, args = m.group(1), m.group(2)
        if op == "mov.b32" and args.startswith("{"):  # split a 32-bit register into its halves
            lo, hi, src = re.fullmatch(r"\{\s*(\S+),\s*(\S+)\s*\},\s*(\S+)", args).groups()
            x = val(src)
            regs[lo], regs[hi] = x & 0xFFFF, x >> 16
            continue
        d, *srcs = [a.strip() for a in args.split(",")]
        if op == "shl.b32":
            regs[d] = (val(srcs[0]).astype(np.uint64) << val(srcs[1])).astype(np.uint64) & MASK32
        elif op == "shr.b32":
            regs[d] = val(srcs[0]) >> val(srcs[1])
        elif op == "and.b32":
            regs[d] = val(srcs[0]) & val(srcs[1])
        elif op == "or.b32":
            regs[d] = val(srcs[0]) | val(srcs[1])
        elif op == "cvt.rn.f16x2.e4m3x2":
            h = val(srcs[0])
            regs[d] = _e4m3_to_f16_bits(h & 0xFF) | (_e4m3_to_f16_bits(h >> 8) << 16)
        else:
            raise AssertionError(f"the evaluator does not know {op!r}: extend it with the instruction's PTX semantics")
        regs[d] = np.asarray(regs[d]).astype(np.uint32)
    return regs


def _halves_as_f16(x: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    lo = torch.from_numpy((x & 0xFFFF).astype(np.int32)).to(torch.int16).view(torch.float16)
    hi = torch.from_numpy((x >> 16).astype(np.int32)).to(torch.int16).view(torch.float16)
    return lo, hi


def test_the_word_decode_gives_every_code_times_2_to_the_minus_6():
    # element 0 of the pack: every 16-bit value (two packed bytes); element 1: the same values reversed
    e0 = np.arange(1 << 16, dtype=np.uint32)
    e1 = e0[::-1].copy()
    out = run_ptx(gemm._E2M1X8_PTX.value, {"$4": e0 | (e1 << 16)})
    values = nvfp4.E2M1_VALUES * 2.0**-6
    for elem, pair in ((0, e0), (1, e1)):
        b0, b1 = torch.from_numpy((pair & 0xFF).astype(np.int64)), torch.from_numpy((pair >> 8).astype(np.int64))
        even, odd = out[f"${elem}"], out[f"${2 + elem}"]  # outputs: even (2 registers), then odd (2 registers)
        for got, want_lo, want_hi in ((even, b0 & 0xF, b1 & 0xF), (odd, b0 >> 4, b1 >> 4)):
            lo, hi = _halves_as_f16(got)
            # exact, and the sign of zero too (code 8 is -0)
            assert torch.equal(lo.float(), values[want_lo]) and torch.equal(hi.float(), values[want_hi])
            assert torch.equal(torch.signbit(lo), want_lo >= 8) and torch.equal(torch.signbit(hi), want_hi >= 8)


def test_the_split_is_the_low_half_first():
    x = np.array([0x3C00BC00, 0x00017BFF], dtype=np.uint32)
    out = run_ptx(gemm._SPLIT_F16X2_PTX.value, {"$2": x})
    assert list(out["$0"]) == [0xBC00, 0x7BFF] and list(out["$1"]) == [0x3C00, 0x0001]


def test_the_evaluator_rejects_what_it_cannot_execute():
    with pytest.raises(AssertionError, match="does not know"):
        run_ptx("{ xor.b32 $0, $1, 0x1; }", {"$1": np.zeros(1, dtype=np.uint32)})


@pytest.mark.parametrize("setting, interpret, message", [
    ("words", "0", "MINITE_FP4_DECODE='words'"),
    ("ptx", "1", "cannot run PTX"),
])
def test_a_decode_setting_that_cannot_work_is_named(setting, interpret, message):
    import os
    import subprocess
    import sys

    env = dict(os.environ, MINITE_FP4_DECODE=setting, TRITON_INTERPRET=interpret)
    r = subprocess.run([sys.executable, "-c", "import minite_core.kernels.gemm"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]


def test_a_gpu_without_the_conversion_gets_a_clear_error(monkeypatch):
    """The E4M3 -> f16x2 conversion needs sm_89: an older GPU is told what to set instead of a ptxas error."""
    monkeypatch.setattr(gemm, "_DECODE", "ptx")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    gemm.decode_supported.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="MINITE_FP4_DECODE=bits"):
            gemm.check_decode(torch.device("cuda", 0))
        gemm.check_decode(torch.device("cpu"))  # nothing to check off the GPU
    finally:
        gemm.decode_supported.cache_clear()


def test_packed_bytes_at_odd_addresses_are_refused_on_the_gpu(monkeypatch):
    """The PTX decode loads the packed bytes two at a time: a view whose rows start at odd addresses (never
    made by `nvfp4`, but a user may slice one) is a named ValueError, not a misaligned load."""
    monkeypatch.setattr(gemm, "_DECODE", "ptx")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gemm.decode_supported.cache_clear()
    try:
        data = torch.zeros(4, 9, dtype=torch.uint8)[:, 1:]  # rows of 8 bytes (K = 16), 9 bytes apart
        scale = torch.ones(4, 1).to(torch.float8_e4m3fn)
        odd = nvfp4.NVFP4Tensor(data, scale, torch.tensor(1.0), (4, 16))
        with pytest.raises(ValueError, match="odd byte addresses"):
            gemm.check_decode(torch.device("cuda", 0), odd)
        gemm.check_decode(torch.device("cuda", 0), nvfp4.NVFP4Tensor(data.clone(), scale, torch.tensor(1.0), (4, 16)))
    finally:
        gemm.decode_supported.cache_clear()
