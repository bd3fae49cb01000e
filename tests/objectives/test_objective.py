"""GRPO objective against hand-computed values."""

import math

import pytest
import torch

from lightning_grpo.objectives.grpo import GRPOObjective

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier


def test_ratio_one_gives_minus_token_mean_advantage():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, -4.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.tensor([1.0, -2.0])
    loss, denom, stats = GRPOObjective()(lp, mask, adv)
    # tokens: 2 of row 0 (adv 1), 1 of row 1 (adv -2): -(1 + 1 - 2) / 3 = 0
    assert float(denom) == 3 and float(loss) == pytest.approx(0.0)
    loss.backward()
    expected = -torch.tensor([[1.0, 1.0, 0.0], [-2.0, 0.0, 0.0]]) / 3
    assert torch.allclose(lp.grad, expected)
    assert float(stats.ratio_mean) == 1.0 and float(stats.clip_frac) == 0.0


def test_clipping_binds_on_the_right_side():
    obj = GRPOObjective(epsilon=0.2, epsilon_high=0.3)
    old = torch.zeros(1, 4)
    lp = torch.log(torch.tensor([[1.5, 1.1, 0.5, 0.9]]))  # ratios
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss_pos, _, s_pos = obj(lp, mask, torch.tensor([1.0]), old_logprobs=old)
    # A > 0: min(r, clip(r, 0.8, 1.3)) = [1.3, 1.1, 0.5, 0.9]; clipped only where r > 1.3.
    assert float(loss_pos) == pytest.approx(-(1.3 + 1.1 + 0.5 + 0.9) / 4)
    assert float(s_pos.clip_frac) == pytest.approx(0.25)
    loss_neg, _, s_neg = obj(lp, mask, torch.tensor([-1.0]), old_logprobs=old)
    # A < 0: min(-r, -clip(r)) = -max(r, clip) -> [1.5, 1.1, 0.8, 0.9]; clipped only where r < 0.8.
    assert float(loss_neg) == pytest.approx((1.5 + 1.1 + 0.8 + 0.9) / 4)
    assert float(s_neg.clip_frac) == pytest.approx(0.25)
    assert float(s_pos.ratio_max) == pytest.approx(1.5)


def test_k3_kl_term():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _, stats = GRPOObjective(beta=0.1)(lp, mask, torch.tensor([0.0]), ref_logprobs=ref)
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 1.0)]
    assert float(loss) == pytest.approx(0.1 * sum(k3) / 2)
    assert float(stats.kl) == pytest.approx(sum(k3) / 2)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        GRPOObjective(beta=0.1)(lp, mask, torch.tensor([0.0]))


def test_empty_chunk_has_zero_divisor_and_zero_loss():
    lp = torch.randn(2, 3, requires_grad=True)
    loss, denom, stats = GRPOObjective()(lp, torch.zeros(2, 3, dtype=torch.bool), torch.ones(2))
    assert float(denom) == 0 and float(loss) == 0 and math.isfinite(float(loss))
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2, 3))


def test_divisor_is_the_dp_mean():
    calls = []
    obj = GRPOObjective(dp_mean=lambda t: (calls.append(float(t)), t * 0 + 5.0)[1])
    lp = torch.zeros(1, 3, requires_grad=True)
    loss, denom, _ = obj(lp, torch.ones(1, 3, dtype=torch.bool), torch.ones(1))
    assert calls == [3.0] and float(denom) == 5.0 and float(loss) == pytest.approx(-3 / 5)
    assert GRPOObjective().needs_old_logprobs()


def test_fractional_dp_divisor_is_used_as_is():
    """Under DP the divisor is a mean and may lie in (0, 1) (fewer tokens than ranks): loss * denom is the chunk sum."""
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[True, False, False], [False, False, False]])  # one token on this rank
    loss, denom, _ = GRPOObjective(dp_mean=lambda t: t / 4)(lp, mask, torch.tensor([2.0, 1.0]))  # 4 ranks, 1 token
    assert float(denom) == 0.25
    assert float(loss) == pytest.approx(-2.0 / 0.25) and float(loss * denom) == pytest.approx(-2.0)
