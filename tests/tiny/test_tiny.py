"""The tiny-policy factory (``lightning_grpo/tiny/``): warm starts and how much of a task they teach.

Tiny builds themselves (cache key, seeds) are covered through ``policy.resolve_path`` in test_policy.py.
"""

import pytest
import torch

from lightning_grpo.data.tasks import ArithTask, get_task
from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.tiny.build import build_tiny_policy
from lightning_grpo.tiny.warm import greedy_accuracy, warm_start


@pytest.fixture
def policy(tiny_policy_dir):
    return load_policy(PolicyConfig(path=str(tiny_policy_dir)))


def test_warm_start_lowers_the_loss_and_leaves_rng_and_mode_alone(policy):
    model, tok = policy
    model.eval()
    rng_before = torch.get_rng_state()
    short = warm_start(model, tok, "arith", steps=1, seed=0, batch_size=8)
    longer = warm_start(model, tok, ArithTask(), steps=12, seed=0, batch_size=8, lr=1e-2)
    assert longer.steps == 12 and longer.seconds > 0
    assert longer.loss < short.loss
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert not model.training


def test_greedy_accuracy_is_a_fraction(policy):
    model, tok = policy
    acc = greedy_accuracy(model, tok, ArithTask().items(10, seed=0), max_new_tokens=3)
    assert 0.0 <= acc <= 1.0


@pytest.mark.slow
def test_default_warm_start_teaches_part_of_arith(tmp_path):
    """A 30-step warm start of the default tiny policy solves some, not all, of arith_small (GRPO's headroom)."""
    model, tok = load_policy(PolicyConfig(path=str(build_tiny_policy(tmp_path))))
    warm_start(model, tok, "arith_small", steps=30, seed=0)
    acc = greedy_accuracy(model, tok, get_task("arith_small").items(256, seed=99))
    assert 0.15 <= acc <= 0.9
