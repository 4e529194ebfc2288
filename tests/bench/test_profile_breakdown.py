"""bench/common's profile reading (bench/learner.py --profile): the GPU-busy time is the union of the kernel
intervals, kernel time is summed by family, and the profiler path yields the kernels a step ran (on the CPU
here, with the CPU ops standing in for kernels)."""
import time

import pytest
import torch

from bench.common import kernel_breakdown, kernel_intervals, profiled


def test_busy_time_is_the_union_of_the_kernel_intervals_and_families_sum_their_kernels():
    kernels = [
        ("_gemm_kernel", 0.0, 4.0),
        ("_decode_kernel", 1.0, 2.0),  # inside the GEMM's interval: adds nothing to busy
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 3.0, 6.0),  # overlaps the GEMM's end: busy to 6
        ("void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float>>", 8.0, 9.0),  # after a gap
        ("void multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor<float, 4>>", 10.0, 10.5),
        ("_gemm_kernel", 9.5, 10.0),
    ]
    b = kernel_breakdown(kernels)
    assert b["busy"] == pytest.approx(6.0 + 1.0 + 0.5 + 0.5)  # [0, 6] + [8, 9] + [9.5, 10] + [10, 10.5]
    assert b["kernels"] == 6
    fam = b["families"]
    assert fam["Triton GEMM (W4A4, plain)"] == pytest.approx((4.5, 2))
    assert fam["FP4 decode, dequantize"] == pytest.approx((1.0, 1))
    assert fam["cuBLAS / cuBLASLt GEMM"] == pytest.approx((3.0, 1))
    assert fam["optimizer, grad norm"] == pytest.approx((0.5, 1))
    assert fam["other"] == pytest.approx((1.0, 1))
    assert "attention" not in fam  # families without a kernel are left out
    assert kernel_breakdown([]) == {"busy": 0.0, "kernels": 0, "families": {}}


def test_the_profiler_path_returns_the_kernels_a_step_ran():
    a = torch.randn(256, 256)

    def step():
        (a @ a).relu_()
    t0 = time.perf_counter()
    ks = kernel_intervals(profiled(step, "cpu"), "cpu")
    wall = time.perf_counter() - t0
    names = [k[0] for k in ks]
    assert "aten::mm" in names and "aten::relu_" in names, names
    assert all(0 < end - start < wall for _, start, end in ks)
    assert 0 < kernel_breakdown(ks)["busy"] <= wall


def test_learner_profile_prints_the_busy_time_and_the_families(capsys):
    from bench.learner import profile

    a = torch.randn(128, 128)
    profile("cpu-step", lambda: (a @ a).relu_(), step_s=10.0, device="cpu")
    out = capsys.readouterr().out
    assert "--- cpu-step: step 10000.0 ms (unprofiled median), GPU busy" in out, out
    assert "other" in out and "aten::mm" in out, out
