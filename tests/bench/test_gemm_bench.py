"""bench/gemm.py's learner-layer table runs the learner's autograd path for every engine it names (on the
CPU: the Triton backend under the interpreter, tiny widths and 136 rows (the wide tiles, which read the decoded weights), a timer that runs each case once), so
the device session does not find its errors: every engine's forward and forward + backward are timed."""
import pytest

from tests.backends import HAS_CUDA, HAS_TRITON

pytestmark = [pytest.mark.skipif(HAS_CUDA or not HAS_TRITON, reason="the GPU runs the bench itself")]


def test_learner_layer_runs_every_engine_forward_and_backward():
    from bench.gemm import learner_layer

    calls = []

    def once(fn):
        fn()
        calls.append(fn)
        return 1e-3
    rows = learner_layer(m=136, timer=once, device="cpu", layers={"tiny": (32, 32, 16, 64)})  # the wide tiles (M > 128)
    engines = ("cublas-bf16", "minite-bf16", "minite-nvfp4", "minite-nvfp4-fp8")
    assert len(rows) == 1 and len(calls) == 2 * len(engines)
    assert set(rows[0]) == {"model", "M"} | {f"{e}-{p}" for e in engines for p in ("fwd", "fwd-bwd")}
