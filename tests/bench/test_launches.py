"""The kernel launches of a decode step (bench/launches.py, counted on the CPU under the interpreter): a
layer is one launch per fused op, as designed; a second layer adds exactly one layer's launches."""
from collections import Counter

import pytest

from tests.backends import HAS_CUDA, HAS_TRITON

pytestmark = [pytest.mark.skipif(HAS_CUDA or not HAS_TRITON, reason="counts interpreter launches on the CPU")]

# One decode layer, by design (ops): add + RMSNorm + quantize, q/k/v GEMM, q/k norm + RoPE + cache write,
# attention (split over the cache: + its combine, which also quantizes the attention output in NVFP4), o GEMM,
# add + RMSNorm + quantize, gate/up GEMM, SiLU*up + quantize, down GEMM. BF16: the same launches, no quantize.
LAYER = {
    "nvfp4": Counter({"triton _rms_norm_fwd_kernel": 2, "triton _gemm_kernel": 4, "triton _qk_norm_rope_kernel": 1,
                      "triton _attention_kernel": 1, "triton _combine_kernel": 1, "triton _silu_mul_quantize_kernel": 1}),
    "bf16": Counter({"triton _rms_norm_fwd_kernel": 2, "triton _gemm_kernel": 4, "triton _qk_norm_rope_kernel": 1,
                     "triton _attention_kernel": 1, "triton _combine_kernel": 1, "triton _silu_mul_fwd_kernel": 1}),
}


@pytest.mark.parametrize("precision", ["nvfp4", "bf16"])
def test_a_decode_layer_launches_one_kernel_per_fused_op(precision):
    from bench.launches import decode_step_launches

    one, two = decode_step_launches(1, precision, batch=2), decode_step_launches(2, precision, batch=2)
    assert two - one == LAYER[precision] and one - two == Counter()  # nothing else grows with the depth


# One learner-step layer (bench/learner_host.py; the GPU's backward recipe, M > 128 so the GEMMs take the wide
# tiles), by design: forward as the decode layer but the attention in SDPA (the bench's knob), and no decode
# launch: the wide GEMMs' fp16 operands come decoded from the kernels that quantized them (`NVFP4Tensor.decoded`:
# the activations from the norms / SiLU*up / quantize, the weights from the re-quantize, which the step's
# first forward, before any re-quantize, lacks); backward: the four
# RMSNorms (input, post-attention, q, k), RoPE of q and k, SiLU*up, and in NVFP4 the dequantize of the 4 quantized
# inputs (the 7 weights' bf16 values come from the re-quantize: `NVFP4Tensor.dequantized`); AdamW in torch;
# re-quantize: one launch for all the weights, whatever the depth.
LEARNER_LAYER = {
    "nvfp4": {"forward": Counter({"triton _rms_norm_fwd_kernel": 2, "triton _gemm_kernel": 4,
                                  "triton _qk_norm_rope_kernel": 1, "triton _quantize_kernel": 1,
                                  "triton _silu_mul_quantize_kernel": 1}),
              "backward": Counter({"triton _dequantize_kernel": 4, "triton _rms_norm_bwd_kernel": 4,
                                   "triton _rope_kernel": 2, "triton _silu_mul_bwd_kernel": 1}),
              "adamw": Counter(), "requantize": Counter()},
    "bf16": {"forward": Counter({"triton _rms_norm_fwd_kernel": 2, "triton _gemm_kernel": 4, "triton _qk_norm_rope_kernel": 1,
                                 "triton _silu_mul_fwd_kernel": 1}),
             "backward": Counter({"triton _rms_norm_bwd_kernel": 4, "triton _rope_kernel": 2, "triton _silu_mul_bwd_kernel": 1}),
             "adamw": Counter(), "requantize": Counter()},
}


@pytest.mark.parametrize("precision", ["nvfp4", "bf16"])
def test_a_learner_layer_launches_its_kernels_once_and_requantize_launches_one(precision):
    from bench.learner_host import learner_step_host

    one, two = learner_step_host(1, precision, repeats=1), learner_step_host(2, precision, repeats=1)
    for phase, want in LEARNER_LAYER[precision].items():
        triton = lambda c: Counter({k: v for k, v in c.items() if k.startswith("triton ")})  # noqa: E731
        assert triton(two[phase][1]) - triton(one[phase][1]) == want, phase
        assert triton(one[phase][1]) - triton(two[phase][1]) == Counter(), phase
    requant = {k: v for k, v in two["requantize"][1].items() if k.startswith("triton ")}
    assert requant == ({"triton _quantize_many_kernel": 1} if precision == "nvfp4" else {}), requant


@pytest.mark.parametrize("precision", ["nvfp4", "bf16"])
def test_a_rollout_prefill_layer_launches_the_decode_layers_kernels_and_nvfp4_one_quantize_more(precision):
    """bench/rollout_host.py's eager forwards (the engine's, over a KV cache): a decode layer launches the decode
    design's kernels (LAYER); a prefill layer the same but the attention's combine (its prompt spans two query
    tiles: the tile launch, no split over the keys), and in NVFP4 one more, the o_proj input's quantize (the
    attention fuses it only for a decode step's single query)."""
    from bench.rollout_host import forwards, rollout_forwards_host

    one, two = (rollout_forwards_host(forwards(n, precision, batch=2, prompt=20), repeats=1) for n in (1, 2))

    def layer(phase):
        triton = lambda c: Counter({k: v for k, v in c.items() if k.startswith("triton ")})  # noqa: E731
        a, b = triton(one[phase][1]), triton(two[phase][1])
        assert a - b == Counter(), phase
        return b - a

    assert layer("decode") == LAYER[precision]
    prefill = LAYER[precision] - Counter({"triton _combine_kernel": 1})
    assert layer("prefill") == prefill + (Counter({"triton _quantize_kernel": 1}) if precision == "nvfp4" else Counter())
