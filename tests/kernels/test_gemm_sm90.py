"""The W4A4 GEMM as compiled for sm_90, read on the CPU (Triton compiles for a GPU target without one; the
SASS comes from the cuobjdump Triton ships): properties of the machine code that the interpreter cannot
show and that cost speed when lost.

The chunk walk of the wide decoded tile (the learner's GEMM) once flushed a finished K chunk into the
total inside a branch, and Triton then waited for every wgmma (`WARPGROUP.DEPBAR.LE gsb0, 0x0` after each
of a K step's 8 HGMMA): no two MMAs of a tile overlapped. With selects it waits once per dot (the step's
even and odd halves). Chunks of one step drop the selects too; long chunks get a step loop of their own.

The decode of the packed operands (the decode GEMMs' M <= 16 tile): ~6 instructions a code when Triton
works on one element per register; the PTX decode (`gemm._E2M1X8_PTX`) works on words of 8 codes and lets
the hardware's E4M3 -> f16x2 conversion (`F2FP`) place the bits: the K step's loop went from 695
instructions a warp to 320. Compiled in a subprocess: the compiler cannot run under TRITON_INTERPRET."""
from __future__ import annotations

import pytest
from tests.sm90 import run_compile_script

SCRIPT = r"""
import json
import re
import bench.gemm_probe as gp
out = {}
for name, kern, const, cfg, ones, m, *ptrs in gp.sm90_cases():
    wide = "_wide_decoded_w" in name and const["NSEG"] == 1 and const["CHUNKED"]
    key = {1: "wide", 2: "wide_one_step", 3: "wide_long"}.get(const["CHUNKED"]) if wide else None
    if name.startswith("dense_12288x4096_M16_") and "swap_w4" in name:
        key = "narrow"
    if key and key not in out:
        ck = gp.compile_sm90(kern, const, cfg["num_warps"], cfg["num_stages"], ones, *ptrs)
        # the innermost loop that issues the step's MMAs (the long chunks' walk nests its step loop)
        sass = gp.sass_of(ck.asm["cubin"])
        loop = next(lp for lp in gp.loops(sass) if any(op.startswith("HGMMA") for _, op in lp))
        count = lambda p: sum(op.startswith(p) for _, op in loop)  # noqa: E731
        lo, hi = loop[0][0], loop[-1][0]  # the loop's addresses: its MMAs that start from no accumulator
        zero_input = sum(lo <= int(a, 16) <= hi for a in re.findall(r"/\*([0-9a-f]{4,})\*/\s+HGMMA[^;]*, RZ, !UPT", sass))
        out[key] = dict(name=name, instructions=len(loop), hgmma=count("HGMMA"), waits=count("WARPGROUP.DEPBAR"),
                        fsel=count("FSEL"), fadd=count("FADD"), f2fp=count("F2FP"),
                        zero_input=zero_input,
                        ptx_cvt="cvt.rn.f16x2.e4m3x2" in ck.asm["ptx"])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    out = run_compile_script(SCRIPT)
    assert set(out) == {"wide", "wide_one_step", "wide_long", "narrow"}, out
    return out


@pytest.fixture
def wide_walk(compiled) -> dict:
    return compiled["wide"]


def test_the_chunked_wide_walk_waits_once_per_dot_not_per_mma(wide_walk):
    assert wide_walk["hgmma"] == 8, wide_walk  # 128 x 128 x 128 step: two dots of K = 64, 4 x k16 each
    assert wide_walk["waits"] <= 2, wide_walk


def test_the_narrow_tile_decodes_words_with_the_hardware_conversion(compiled):
    narrow = compiled["narrow"]
    assert narrow["ptx_cvt"] and narrow["hgmma"] == 8, narrow
    # 64 x 64 weight bytes + 16 x 64 activation bytes a step over 128 threads: 10 words of 8 codes a thread,
    # 4 conversions a word; scale pairs convert with the same instruction
    assert narrow["f2fp"] >= 40, narrow
    assert narrow["instructions"] <= 360, narrow  # the element-wise decode: 695


def test_one_step_chunks_need_no_selects(compiled):
    """Chunks of one K step (2048 x 512: S = 4 = the step count): each step's chain starts from no
    accumulator (wgmma's zero-input form) and is added into the total: no FSEL resets, 183 loop instructions
    where the select walk takes 273."""
    one = compiled["wide_one_step"]
    assert one["hgmma"] == 8 and one["waits"] <= 2 and one["fsel"] == 0, one
    assert one["instructions"] < compiled["wide"]["instructions"] - 50, (one, compiled["wide"])


def test_one_step_chunks_are_added_into_the_total_not_accumulated_by_the_mma(compiled):
    """The reduction order of `w4a4_tile`: a chunk's chain starts from zero and its sum is added into the total
    with an fp32 add. Triton rewrites `total + dot(a, b)` (a dot from zero) into `dot(a, b, total)`, which
    chains the MMA onto the total: other bits than the split programs', and a loop that looks faster (no
    FADD). The step's two dots keep it from doing so (the odd dot chains onto the even one); a single dot
    of K = 128 over the decoded step would not. So: one zero-input HGMMA a step, and the 64 FADDs of the
    flush (a 128 x 128 fp32 total over 256 threads)."""
    one = compiled["wide_one_step"]
    assert one["zero_input"] == 1 and one["fadd"] == 64, one


def test_long_chunks_run_their_steps_in_a_loop_of_their_own(compiled):
    """Chunks of 16 steps (12288 x 4096): the step loop has one wait (the odd dot stays in flight into the next
    step), no select and no add: the flush runs once a chunk, outside it."""
    long = compiled["wide_long"]
    assert long["hgmma"] == 8 and long["waits"] <= 1 and long["fsel"] == 0 and long["fadd"] == 0, long
    assert long["instructions"] < compiled["wide"]["instructions"] - 100, (long, compiled["wide"])
