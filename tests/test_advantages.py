import math

import pytest
import torch

from lightning_grpo.advantages import group_advantages

EPS = 1e-4
# Group 0 has one success in four: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5.
# Group 1 is all ones: std 0, advantages 0 whatever the scale.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
CENTRED = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0])


def test_group_scale_hand_computed():
    adv, _ = group_advantages(REWARDS, 4, "group", eps=EPS)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / torch.tensor([0.5 + EPS] * 4 + [EPS] * 4)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    assert adv[0].item() == pytest.approx(1.49970006, abs=1e-6)


def test_batch_scale_uses_unbiased_batch_std():
    adv, stats = group_advantages(REWARDS, 4, "batch", eps=EPS)
    # mean 5/8; sum of squares 5 * 0.375^2 + 3 * 0.625^2 = 1.875; unbiased var 1.875 / 7.
    std = math.sqrt(1.875 / 7)
    torch.testing.assert_close(adv, CENTRED / (std + EPS), rtol=0, atol=1e-6)
    assert stats["reward/std"].item() == pytest.approx(std, abs=1e-6)


def test_batch_scale_accepts_a_global_std():
    adv, _ = group_advantages(REWARDS, 4, "batch", eps=EPS, batch_std=2.0)
    torch.testing.assert_close(adv, CENTRED / (2.0 + EPS), rtol=0, atol=1e-7)


def test_none_scale_only_centres():
    adv, _ = group_advantages(REWARDS, 4, "none")
    torch.testing.assert_close(adv, CENTRED, rtol=0, atol=0)


def test_stats_and_frac_zero_std():
    _, stats = group_advantages(REWARDS, 4)
    assert stats["reward/mean"].item() == pytest.approx(0.625)
    assert stats["reward/min"].item() == 0.0 and stats["reward/max"].item() == 1.0
    assert stats["reward/group_std"].item() == pytest.approx(0.25)  # mean of 0.5 and 0
    assert stats["reward/frac_zero_std"].item() == pytest.approx(0.5)


def test_frac_zero_std_counts_equal_non_binary_rewards():
    # 0.1 * 3 groups: float std of equal values may not be exactly 0; max == min is the test.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.7, 0.2])
    adv, stats = group_advantages(rewards, 3)
    assert stats["reward/frac_zero_std"].item() == pytest.approx(0.5)
    assert torch.all(adv[:3] == 0)


def test_groups_are_contiguous_rows():
    rewards = torch.tensor([0.0, 1.0, 5.0, 7.0])
    adv, _ = group_advantages(rewards, 2, "none")
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -1.0, 1.0]))


@pytest.mark.parametrize(
    "rewards, group_size, scale, match",
    [
        (torch.zeros(6), 4, "group", "multiple of group_size=4"),
        (torch.zeros(0), 2, "group", "non-empty"),
        (torch.zeros(2, 2), 2, "group", "shape"),
        (torch.zeros(4), 1, "group", "group_size=1"),
        (torch.zeros(4), 2, "std", "scale='std'"),
    ],
)
def test_bad_input_is_a_clear_error(rewards, group_size, scale, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size, scale)
