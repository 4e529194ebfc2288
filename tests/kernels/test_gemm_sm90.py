"""The W4A4 GEMM as compiled for sm_90, read on the CPU (Triton compiles for a GPU target without one; the
SASS comes from the cuobjdump Triton ships): properties of the machine code that the interpreter cannot
show and that cost speed when lost.

The chunk walk of the wide decoded tile (the learner's GEMM) once flushed a finished K chunk into the
total inside a branch, and Triton then waited for every wgmma (`WARPGROUP.DEPBAR.LE gsb0, 0x0` after each
of a K step's 8 HGMMA): no two MMAs of a tile overlapped. With selects it waits once per dot (the step's
even and odd halves). Compiled in a subprocess: the compiler cannot run under TRITON_INTERPRET."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json
import bench.gemm_probe as gp
out = {}
for name, kern, const, cfg, ones, m, *ptrs in gp.sm90_cases():
    if "_wide_decoded_w" in name and const["CHUNKED"] and const["NSEG"] == 1 and name not in out:
        ck = gp.compile_sm90(kern, const, cfg["num_warps"], cfg["num_stages"], ones, *ptrs)
        loop = gp.main_loop(gp.sass_of(ck.asm["cubin"]))
        out[name] = dict(hgmma=sum(op.startswith("HGMMA") for _, op in loop),
                         waits=sum(op.startswith("WARPGROUP.DEPBAR") for _, op in loop))
        break
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def wide_walk() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out) == 1, out
    return next(iter(out.values()))


def test_the_chunked_wide_walk_waits_once_per_dot_not_per_mma(wide_walk):
    assert wide_walk["hgmma"] == 8, wide_walk  # 128 x 128 x 128 step: two dots of K = 64, 4 x k16 each
    assert wide_walk["waits"] <= 2, wide_walk
