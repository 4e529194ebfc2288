"""bench/gemm.py's learner-layer table runs the learner's autograd path for every engine it names (on the
CPU: the Triton backend under the interpreter, tiny widths and 136 rows (the wide tiles, which read the decoded weights), a timer that runs each case once), so
the device session does not find its errors: every engine's forward and forward + backward are timed."""
import pytest
import torch

from tests.backends import HAS_CUDA, HAS_TRITON

pytestmark = [pytest.mark.skipif(HAS_CUDA or not HAS_TRITON, reason="the GPU runs the bench itself")]


def test_learner_layer_runs_every_engine_forward_and_backward():
    from bench.gemm import learner_layer

    calls = []

    def once(fn):
        fn()
        calls.append(fn)
        return 1e-3
    # 136 rows: the wide tiles (M > 128), which read the weights' decoded form; the CUDA-graph timer has no
    # CPU counterpart (the forward it would time is the one `once` runs)
    rows = learner_layer(m=136, timer=once, device="cpu", layers={"tiny": (32, 32, 16, 64)},
                         graph_timer=lambda fn: 1e-3)
    engines = ("cublas-bf16", "minite-bf16", "minite-nvfp4", "minite-nvfp4-fp8")
    assert len(rows) == 1 and len(calls) == 2 * len(engines)
    assert set(rows[0]) == {"model", "M"} | {f"{e}-{p}" for e in engines for p in ("fwd", "fwd-graph", "fwd-bwd")}


def test_backward_parts_times_each_piece_of_the_straight_through_backward():
    """bench/gemm.py's backward-parts table: each piece the STE backward runs (`backward.cuda_mm`, the
    dequantizes), timed once per layer at tiny widths."""
    from bench.gemm import backward_parts

    calls = []

    def once(fn):
        out = fn()
        calls.append(out)
        return 1e-3
    rows = backward_parts(m=24, timer=once, device="cpu", layers={"tiny": (32, 32, 16, 64)})
    assert len(rows) == 1 and rows[0]["M"] == 24
    assert set(rows[0]) == {"model", "M", "deq-w", "deq-x", "dgrad", "wgrad-fp32", "wgrad-bf16"}
    deq_w, deq_x, dgrad, wgrad32, wgrad16 = calls
    assert len(deq_w) == len(dgrad) == len(wgrad32) == 7 and len(deq_x) == 4
    assert {t.dtype for t in deq_w + deq_x + dgrad + wgrad16} == {torch.bfloat16}
    assert {t.dtype for t in wgrad32} == {torch.float32}
    assert [tuple(t.shape) for t in wgrad32] == [tuple(t.shape) for t in deq_w]  # grad_w is [N, K] like W
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(wgrad32, wgrad16))  # one rounding apart


def test_quantize_sweep_gets_the_default_bits_from_every_launch_setting():
    """bench/gemm.py's quantize sweep: each (warps, chunk) setting quantizes x to the default's bits (NB, the
    chunk, changes the walk: K = 2080, 130 blocks, gives 4, 2 and 1 whole chunks and a part chunk at NB = 32,
    64 and 128), and the module's settings are restored after."""
    from bench.gemm import QUANTIZE_SWEEP, quantize_sweep
    from minite_core.kernels import quantize as qmod

    saved = qmod.QUANTIZE_WARPS, qmod.QUANTIZE_MAX_NB
    x = (torch.randn(5, 2080, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    rows = quantize_sweep(x, lambda fn: (fn(), 1e-6)[1])
    assert [(r["warps"], r["max_nb"]) for r in rows] == QUANTIZE_SWEEP
    assert all(r["same_bits"] for r in rows)
    assert (qmod.QUANTIZE_WARPS, qmod.QUANTIZE_MAX_NB) == saved
