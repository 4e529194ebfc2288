"""The W4A4 GEMM as compiled for sm_90, read on the CPU (Triton compiles for a GPU target without one; the
SASS comes from the cuobjdump Triton ships): properties of the machine code that the interpreter cannot
show and that cost speed when lost.

The chunk walk of the wide decoded tile (the learner's GEMM) once flushed a finished K chunk into the
total inside a branch, and Triton then waited for every wgmma (`WARPGROUP.DEPBAR.LE gsb0, 0x0` after each
of a K step's 8 HGMMA): no two MMAs of a tile overlapped. With selects it waits once per dot (the step's
even and odd halves). Compiled in a subprocess: the compiler cannot run under TRITON_INTERPRET."""
from __future__ import annotations

import pytest
from tests.sm90 import run_compile_script

SCRIPT = r"""
import json
import bench.gemm_probe as gp
out = {}
for name, kern, const, cfg, ones, m, *ptrs in gp.sm90_cases():
    if "_wide_decoded_w" in name and const["CHUNKED"] and const["NSEG"] == 1:
        ck = gp.compile_sm90(kern, const, cfg["num_warps"], cfg["num_stages"], ones, *ptrs)
        loop = gp.main_loop(gp.sass_of(ck.asm["cubin"]))
        out[name] = dict(hgmma=sum(op.startswith("HGMMA") for _, op in loop),
                         waits=sum(op.startswith("WARPGROUP.DEPBAR") for _, op in loop))
        break
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def wide_walk() -> dict:
    out = run_compile_script(SCRIPT)
    assert len(out) == 1, out
    return next(iter(out.values()))


def test_the_chunked_wide_walk_waits_once_per_dot_not_per_mma(wide_walk):
    assert wide_walk["hgmma"] == 8, wide_walk  # 128 x 128 x 128 step: two dots of K = 64, 4 x k16 each
    assert wide_walk["waits"] <= 2, wide_walk
