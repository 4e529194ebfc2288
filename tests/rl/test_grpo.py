"""GRPO pieces against hand-computed values: advantages, the clipped surrogate and its gradient, the
rollout corrections (exactly the identity when the engines agree), aggregation, and the addition task."""
import math

import pytest
import torch

from minite_core.rl import GRPOConfig, group_advantages, grpo_loss, rollout_weights


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, 4)
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(a[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (s + 1e-4))
    assert torch.equal(a[4:], torch.zeros(4))
    assert torch.equal(group_advantages(r, 4, scale_rewards="none")[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    b = math.sqrt(sum((x - 0.75) ** 2 for x in r.tolist()) / 7)  # TRL's "batch": the whole batch's std
    assert torch.allclose(group_advantages(r, 4, scale_rewards="batch")[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (b + 1e-4))
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(r, 4, scale_rewards=True)
    with pytest.raises(ValueError, match="groups"):
        group_advantages(r[:7], 4)


def _batch():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logp, mask, torch.tensor([2.0, -1.0])


@pytest.mark.parametrize("correction", [None, "tis", "mis_token", "mis_seq"])
def test_aligned_engines_make_the_correction_the_identity(correction):
    logp, mask, adv = _batch()
    cfg = GRPOConfig(num_generations=2, rollout_correction=correction)
    w, rho = rollout_weights(logp.detach(), logp.detach().clone(), mask, cfg)
    assert torch.equal(w, torch.ones_like(w)) and torch.equal(rho, torch.ones_like(rho))
    loss, m = grpo_loss(logp, logp.detach().clone(), adv, mask, cfg)
    # on-policy, ratio = 1: loss = -mean over sequences of the mean advantage over their tokens
    assert loss.item() == pytest.approx(-(2.0 + -1.0) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-2 / 3, -2 / 3, -2 / 3], [0.5, 0.5, 0.0]]) / 2)
    assert m["sampling/importance_sampling_ratio/min"] == m["sampling/importance_sampling_ratio/max"] == 1.0
    assert m["sampling/sampling_logp_difference/max"] == 0.0 and m["clip_ratio"] == 0.0


def test_corrections_when_the_rollout_disagrees():
    logp, mask, adv = _batch()
    rollout = logp.detach() - math.log(3.0)  # rho = 3 everywhere
    rollout[1, 0] = logp[1, 0].detach() + math.log(2.0)  # rho = 1/2 on one token
    cfg = GRPOConfig(num_generations=2, tis_cap=2.0)
    w, rho = rollout_weights(logp.detach(), rollout, mask, cfg)
    assert torch.allclose(rho[0], torch.full((3,), 3.0)) and rho[1, 0].item() == pytest.approx(0.5)
    assert torch.allclose(w[0], torch.full((3,), 2.0))  # TIS truncates at the cap
    cfg.rollout_correction = "mis_token"
    w, _ = rollout_weights(logp.detach(), rollout, mask, cfg)
    assert w[0].tolist() == [0.0, 0.0, 0.0] and w[1, 0] == 1.0 and w[1, 1] == 0.0
    cfg.rollout_correction = "mis_seq"
    w, _ = rollout_weights(logp.detach(), rollout, mask, cfg)
    assert w[0].tolist() == [0.0, 0.0, 0.0]  # geometric mean 3 > cap
    assert w[1, :2].tolist() == [1.0, 1.0]  # geometric mean sqrt(1/2 * 3) within [1/2, 2]
    _, m = grpo_loss(logp, rollout, adv, mask, GRPOConfig(num_generations=2))
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(3.0)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(3.0))


def test_loss_types_and_kl():
    logp, mask, adv = _batch()
    tok = grpo_loss(logp, logp.detach(), adv, mask, GRPOConfig(num_generations=2, loss_type="dapo"))[0]
    assert tok.item() == pytest.approx(-(2.0 * 3 - 1.0 * 2) / 5)
    dr = grpo_loss(logp, logp.detach(), adv, mask, GRPOConfig(num_generations=2, loss_type="dr_grpo",
                                                               max_completion_length=4))[0]
    assert dr.item() == pytest.approx(-(2.0 * 3 - 1.0 * 2) / (2 * 4))
    ref = logp.detach() + 0.1
    loss, m = grpo_loss(logp, logp.detach(), adv, mask, GRPOConfig(num_generations=2, beta=0.5), logp_ref=ref)
    assert m["kl"] == pytest.approx(math.exp(0.1) - 0.1 - 1, rel=1e-5)
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(logp, logp.detach(), adv, mask, GRPOConfig(num_generations=2, beta=0.5))


def test_config_validation():
    for bad in (dict(loss_type="ppo"), dict(rollout_correction="is"), dict(num_generations=1), dict(tis_cap=0.5)):
        with pytest.raises(ValueError):
            GRPOConfig(**bad).validate()
