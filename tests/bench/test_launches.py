"""The kernel launches of a decode step (bench/launches.py, counted on the CPU under the interpreter): a
layer is one launch per fused op, as designed; a second layer adds exactly one layer's launches."""
from collections import Counter

import pytest

from tests.backends import HAS_CUDA, HAS_TRITON

pytestmark = [pytest.mark.skipif(HAS_CUDA or not HAS_TRITON, reason="counts interpreter launches on the CPU")]

# One decode layer, by design (ops): add + RMSNorm + quantize, q/k/v GEMM, q/k norm + RoPE + cache write,
# attention (split over the cache: + its combine), quantize of the attention output, o GEMM, add + RMSNorm +
# quantize, gate/up GEMM, SiLU*up + quantize, down GEMM. BF16: no quantize launches.
LAYER = {
    "nvfp4": Counter({"triton _rms_norm_fwd_kernel": 2, "triton _gemm_kernel": 4, "triton _qk_norm_rope_kernel": 1,
                      "triton _attention_kernel": 1, "triton _combine_kernel": 1, "triton _quantize_kernel": 1,
                      "triton _silu_mul_quantize_kernel": 1}),
    "bf16": Counter({"triton _rms_norm_fwd_kernel": 2, "triton _gemm_kernel": 4, "triton _qk_norm_rope_kernel": 1,
                     "triton _attention_kernel": 1, "triton _combine_kernel": 1, "triton _silu_mul_fwd_kernel": 1}),
}


@pytest.mark.parametrize("precision", ["nvfp4", "bf16"])
def test_a_decode_layer_launches_one_kernel_per_fused_op(precision):
    from bench.launches import decode_step_launches

    one, two = decode_step_launches(1, precision, batch=2), decode_step_launches(2, precision, batch=2)
    assert two - one == LAYER[precision] and one - two == Counter()  # nothing else grows with the depth
