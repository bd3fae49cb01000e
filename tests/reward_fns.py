"""Reward functions loaded by import path in test_rewards.py (``reward_fns:...``)."""


def length_reward(rollouts):
    return [float(len(r.text)) for r in rollouts]


def fails_on_seven(rollouts):
    return [1.0 / (r.prompt.id != 7) for r in rollouts]


def one_short(rollouts):
    return [0.0] * (len(rollouts) - 1)


def nan_at_two(rollouts):
    return [float("nan") if r.prompt.id == 2 else 0.0 for r in rollouts]


def fails_as_batch(rollouts):
    if len(rollouts) > 1:
        raise RuntimeError("reward server rejected the batch")
    return [0.0]


NOT_CALLABLE = 3
