"""Drift statistics, and the misalignment knobs: each, turned on in the rollout engine only, makes
its logprobs drift from the aligned learner's; with every knob off the drift is exactly zero."""
import math

import pytest
import torch
from tests.helpers_hf import save_hf_checkpoint

from minite_core.consistency import drift_stats
from minite_core.engine import Learner, RolloutEngine, SamplingParams
from minite_core.model import load_model
from minite_core.knobs import KNOBS

pytest.importorskip("transformers")  # the checkpoints are written by HF itself


def test_drift_stats_by_hand():
    a = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    b = torch.tensor([-1.0, -2.5, -0.5, -2.0])
    s = drift_stats([a[:2], a[2:]], [b[:2], b[2:]], rollout_argmax=[1, 2, 3, 4], learner_argmax=[1, 2, 0, 4])
    r = [0.0, -0.5, 0.0, 1.0]
    assert s.tokens == 4 and s.max_abs_diff == 1.0 and s.mean_abs_diff == pytest.approx(0.375)
    assert s.kl_k3 == pytest.approx(sum(math.exp(x) - x - 1 for x in r) / 4)
    assert s.bitwise_equal_ratio == 0.5 and s.token_mismatch_ratio == 0.25
    assert s.ppl_ratio == pytest.approx(math.exp((-6.0 + 6.5) / 4))
    assert drift_stats(a, a).kl_k3 == 0.0 and drift_stats(a, a).bitwise_equal_ratio == 1.0
    with pytest.raises(ValueError, match="length"):
        drift_stats(a, b[:3])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # wide enough (K = 256, 512) that a library matmul's sums of NVFP4 products are not exact by luck
    path = save_hf_checkpoint(tmp_path_factory.mktemp("knobs"), hidden_size=256, intermediate_size=512, head_dim=64)
    return path


def _drift(ckpt, knobs, precision="nvfp4"):
    rollout_model = load_model(ckpt, precision=precision, knobs=knobs)
    learner = Learner(load_model(ckpt, precision=precision))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (12,), generator=g)]
    outs = RolloutEngine(rollout_model, max_slots=5, max_seq_len=64).generate(
        prompts, SamplingParams(max_tokens=10, seed=1))
    lps = learner.batch_logprobs([o.prompt_ids for o in outs], [o.token_ids for o in outs])
    return drift_stats([o.logprobs for o in outs], lps)


def test_aligned_engines_have_zero_drift(ckpt):
    s = _drift(ckpt, {})
    assert s.max_abs_diff == 0.0 and s.bitwise_equal_ratio == 1.0 and s.kl_k3 == 0.0


@pytest.mark.parametrize("knob,value,precision", [
    ("matmul", "library", "nvfp4"), ("matmul", "library", "bf16"), ("attention", "sdpa", "nvfp4"),
    ("attention", "sdpa", "bf16"), ("act_scale", "tensor", "nvfp4"),  # activation scales exist in NVFP4 only
    ("kv_cache_dtype", "fp8_e4m3", "nvfp4"), ("kv_cache_dtype", "fp8_e4m3", "bf16")])
def test_each_knob_in_one_engine_drifts(ckpt, knob, value, precision):
    s = _drift(ckpt, {knob: value}, precision)
    assert s.max_abs_diff > 0 and s.bitwise_equal_ratio < 1.0, s


def test_bad_knobs_are_named(ckpt):
    with pytest.raises(ValueError, match="unknown knob"):
        load_model(ckpt, knobs={"flash": True})
    with pytest.raises(ValueError, match="matmul"):
        load_model(ckpt, knobs={"matmul": "cublas"})
    assert set(KNOBS) == {"matmul", "attention", "act_scale", "kv_cache_dtype"}
