"""Kernels compiled for sm_90 on a CPU machine (Triton compiles for a GPU target without one), read by tests
that check their PTX or SASS. The compiler cannot run under TRITON_INTERPRET, which the test session sets,
so a script runs in a subprocess without it and prints its findings as JSON on its last line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_compile_script(script: str):
    """Run `script` (Python, from the repository root, `bench.gemm_probe` importable) without
    TRITON_INTERPRET -> the JSON of its last output line."""
    # TRITON_STORE_BINARY_ONLY (the GPU session sets it) would drop the PTX a test reads from the cache
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_STORE_BINARY_ONLY")}
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
