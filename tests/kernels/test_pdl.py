"""Programmatic dependent launch (`kernels/pdl.py`): a kernel launched with PDL may start while the previous
grid still runs, so it must wait (`griddepcontrol.wait`) before its first global memory access. Checked on
the PTX each such kernel compiles to for sm_90, on the CPU (Triton compiles for a GPU target without one;
on the GPU, `MINITE_PDL=1 bash bench/gpu_session.sh tests` runs the engine tests with PDL on). Compiled in a
subprocess: the compiler cannot run under TRITON_INTERPRET, which this test session sets."""
from __future__ import annotations

import pytest
from tests.sm90 import run_compile_script

# every kernel of the decode step's chain takes PDL (a norm, the GEMMs, q/k norm + RoPE, attention, SiLU * up,
# the activation quantize)
DECODE_CHAIN = {f"minite_core.kernels.{k}" for k in (
    "gemm._gemm_kernel", "rows._rms_norm_fwd_kernel", "rows._silu_mul_fwd_kernel", "rows._silu_mul_quantize_kernel",
    "quantize._quantize_kernel", "qk_norm_rope._qk_norm_rope_kernel", "attention._attention_kernel",
    "attention._combine_kernel")}

SCRIPT = r"""
import importlib, json, pkgutil, re
import triton
import bench.gemm_probe as gp
import minite_core.kernels as kpkg

# the kernels of minite_core.kernels that take PDL
takes = {}
for info in pkgutil.iter_modules(kpkg.__path__):
    mod = importlib.import_module(f"minite_core.kernels.{info.name}")
    for v in vars(mod).values():
        if isinstance(v, triton.runtime.JITFunction) and "PDL" in v.arg_names and v.__name__.startswith("_"):
            takes[f"{v.__module__}.{v.__name__}"] = None
access = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld|st|atom|red|cp\.async)\.(?!param|shared|local|const)\S*")
prefetch = re.compile(r"^\s*(?:@!?%p\d+\s+)?prefetch\.global\.L2\b")
seen = set()
for name, kern, const, cfg, ones, m, *ptrs in gp.sm90_cases():
    key = f"{kern.__module__}.{kern.__name__}"
    if not const.get("PDL") or key in seen:
        continue
    seen.add(key)
    ptx = gp.compile_sm90(kern, const, cfg["num_warps"], cfg["num_stages"], ones, *ptrs).asm["ptx"]
    lines = ptx.splitlines()
    wait = next((i for i, l in enumerate(lines) if "griddepcontrol.wait" in l), None)
    release = next((i for i, l in enumerate(lines) if "griddepcontrol.launch_dependents" in l), None)
    first = next((i for i, l in enumerate(lines) if access.match(l)), None)
    pre = sum(1 for l in lines[:wait] if prefetch.match(l)) if wait is not None else 0
    takes[key] = dict(case=name, wait=wait, release=release, first_access=first, prefetches_before_wait=pre,
                                first_line=lines[first].strip() if first is not None else None)
print(json.dumps(takes))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_compile_script(SCRIPT)


def test_decode_chain_kernels_take_pdl(compiled):
    assert DECODE_CHAIN <= set(compiled), DECODE_CHAIN - set(compiled)


def test_every_pdl_kernel_waits_before_touching_memory(compiled):
    for kernel, r in compiled.items():
        assert r is not None, f"{kernel} takes PDL but bench/gemm_probe.py's sm90_cases() does not compile it"
        assert r["wait"] is not None, f"{kernel} ({r['case']}): no griddepcontrol.wait in its PTX"
        assert r["first_access"] is not None and r["wait"] < r["first_access"], \
            f"{kernel} ({r['case']}): global memory access before the wait: {r['first_line']}"
        assert r["release"] is not None and r["wait"] < r["release"], f"{kernel}: launch_dependents before the wait"


def test_decode_gemm_prefetches_its_weights_before_waiting(compiled):
    # the first GEMM case is a decode one (M = 1, swapped tiles): its weight rows go to L2 before the wait
    r = compiled["minite_core.kernels.gemm._gemm_kernel"]
    assert "swap" in r["case"], r["case"]
    assert r["prefetches_before_wait"] > 0, r


def test_a_bad_minite_pdl_value_is_named():
    import os
    import subprocess
    import sys

    env = dict(os.environ, MINITE_PDL="yes")
    r = subprocess.run([sys.executable, "-c", "import minite_core.kernels.pdl"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "MINITE_PDL='yes'" in r.stderr
