"""bench/launch_cost.py's dry run on the CPU (the Triton interpreter): every op it times runs, and each gets a
row with its host time (what the GPU run measures; here only the paths are checked); `--cprofile` prints the
named rows' functions; `--stages` (Triton's compiled launch path) is refused on the CPU with a message."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_launch_cost_times_every_op_on_the_cpu():
    r = subprocess.run([sys.executable, "bench/launch_cost.py", "--device", "cpu", "--calls", "1",
                        "--cprofile", "torch add"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("launch ")]
    names = [re.sub(r"\s+[0-9.]+ us$", "", line[len("launch "):]).strip() for line in rows]
    assert len(rows) == 14 and all(re.search(r" [0-9]+\.[0-9] us$", line) for line in rows), r.stdout
    assert {"torch add (floor)", "ops.linears nvfp4 x3, fwd + bwd (masters)",
            "triton _dequantize_kernel (launcher)"} <= set(names), names
    profiled = r.stdout.split("cprofile torch add (floor): 1 calls, functions by own time\n")
    assert len(profiled) == 2 and profiled[1].lstrip().startswith("ncalls") and "add" in profiled[1], r.stdout[-2000:]
    r = subprocess.run([sys.executable, "bench/launch_cost.py", "--device", "cpu", "--stages"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--stages" in r.stderr and "cuda" in r.stderr and "Traceback" not in r.stderr
