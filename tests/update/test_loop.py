"""The collected-batch loop: nesting, the poisoned-window countdown, and no leak across batches."""

from types import SimpleNamespace

import pytest
import torch
from helpers import params_of, synthetic_batch

from lightning_grpo.config import GRPOConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.update.loop import NonFiniteRunError

# Every test here has its toy-model twin of the same name in tests/update/test_loop_unit.py (the unit tier): these
# runs through a GRPOModule on the tiny Qwen2 policy are the slow tier's.
pytestmark = pytest.mark.slow

LENS = [3, 9, 1, 6, 12, 2, 5, 8, 4, 10, 7, 11]  # 12 trajectories: n_mini=2 x n_micro=3 x 2 rows


def make(policy_dir, batch=12, mini=6, micro=2):
    rl = GRPOConfig(batch_per_replica=batch, group_size=2, mini_batch_per_replica=mini, micro_batch_per_replica=micro)
    module = GRPOModule(policy=PolicyConfig(path=str(policy_dir)), rl=rl)
    module.configure_model()  # no Trainer: build the policy ourselves
    module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=1e-2))
    return module


def poison(module, calls: set[int]):
    """Make the forward of the given call numbers (in walk order, counted over the module's life) non-finite."""
    real, count = module.forward_chunk, [0]

    def forward_chunk(chunk, old):
        loss, denom, stats = real(chunk, old)
        k, count[0] = count[0], count[0] + 1
        return (loss * float("nan"), denom, stats) if k in calls else (loss, denom, stats)

    module.updater.loop.forward_chunk = forward_chunk
    return count


def assert_same_params(a, b):
    pa, pb = params_of(a.policy), params_of(b.policy)
    assert all(torch.equal(pa[k], pb[k]) for k in pa), "parameters differ"


def test_walk_visits_mini_then_micro_and_steps_once_per_mini(tiny_policy_dir):
    module = make(tiny_policy_dir)
    seen = []
    real = module.forward_chunk
    module.updater.loop.forward_chunk = lambda c, o: (seen.append(tuple(c.sample_ids.tolist())), real(c, o))[1]
    batch = synthetic_batch(LENS)
    result = module.updater.update(batch)
    assert seen == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]
    assert len(result.steps) == 2 and not any(s.skipped for s in result.steps)
    assert module.updater.loop.progress.optimizer_steps == 2 and module.updater.loop.progress.loop_step == 1


@pytest.mark.parametrize("bad_call", [1, 2], ids=["chunk1-of-mini0", "last-chunk-of-mini0"])
def test_nan_in_mini0_abandons_it_and_equals_training_mini1_only(tiny_policy_dir, bad_call):
    batch, clean = synthetic_batch(LENS, seed=5), synthetic_batch(LENS, seed=6)
    poisoned = make(tiny_policy_dir)
    calls = poison(poisoned, {bad_call})
    result = poisoned.updater.update(batch)
    assert [s.skipped for s in result.steps] == [True, False]
    assert result.discarded_chunks == 3 - bad_call  # the bad chunk and what was left of its window
    assert calls[0] == 3 + bad_call + 1  # discarded chunks were never forwarded

    only_mini1 = make(tiny_policy_dir, batch=6, mini=0, micro=2)
    only_mini1.updater.update(batch.select(slice(6, 12)))
    assert_same_params(poisoned, only_mini1)

    # The next loop step is clean: no skip, and both runs stay identical.
    result = poisoned.updater.update(clean)
    assert not any(s.skipped for s in result.steps) and result.discarded_chunks == 0
    reference = make(tiny_policy_dir)
    reference.policy.load_state_dict(only_mini1.policy.state_dict())
    reference.updater.loop.accumulator.optimizer.load_state_dict(only_mini1.updater.loop.accumulator.optimizer.state_dict())
    reference.updater.update(clean)
    assert_same_params(poisoned, reference)


def test_nan_in_first_chunk_of_last_mini_does_not_leak_into_next_batch(tiny_policy_dir):
    batch, clean = synthetic_batch(LENS, seed=7), synthetic_batch(LENS, seed=8)
    poisoned = make(tiny_policy_dir)
    poison(poisoned, {3})
    result = poisoned.updater.update(batch)
    assert [s.skipped for s in result.steps] == [False, True]
    assert result.discarded_chunks == 3
    assert not poisoned.updater.loop.accumulator.discarding()  # the countdown ended inside this batch

    only_mini0 = make(tiny_policy_dir, batch=6, mini=0, micro=2)
    only_mini0.updater.update(batch.select(slice(0, 6)))
    assert_same_params(poisoned, only_mini0)

    result = poisoned.updater.update(clean)
    assert [s.skipped for s in result.steps] == [False, False] and result.discarded_chunks == 0


def test_nan_at_n_micro_1_skips_just_that_step(tiny_policy_dir):
    module = make(tiny_policy_dir, batch=12, mini=4, micro=4)  # n_mini=3, n_micro=1
    poison(module, {1})
    result = module.updater.update(synthetic_batch(LENS))
    assert [s.skipped for s in result.steps] == [False, True, False]
    assert result.discarded_chunks == 1


def test_non_finite_gradient_norm_skips_the_step(tiny_policy_dir):
    module = make(tiny_policy_dir, batch=12, mini=0, micro=6)
    before = params_of(module.policy)
    emb = module.policy.get_input_embeddings().weight
    hook = emb.register_hook(lambda g: g * float("inf"))
    result = module.updater.update(synthetic_batch(LENS))
    hook.remove()
    assert [s.skipped for s in result.steps] == [True]
    assert all(torch.equal(before[k], v) for k, v in params_of(module.policy).items())
    assert all(p.grad is None for p in module.policy.parameters())


def test_past_max_consecutive_skips_the_run_stops_naming_the_last_non_finite_chunk(tiny_policy_dir):
    """Issue 20: global_step counts only steps taken, so an always-NaN run never reached max_steps."""
    module = make(tiny_policy_dir)  # n_mini = 2, n_micro = 3
    module.updater.loop.max_consecutive_skips = 4
    poison(module, set(range(100)))  # every chunk's loss is NaN
    before = params_of(module.policy)
    module.updater.update(synthetic_batch(LENS))
    module.updater.update(synthetic_batch(LENS))
    assert module.updater.loop.accumulator.consecutive_skips == 4  # 4 windows skipped: at the limit, not past it
    with pytest.raises(NonFiniteRunError, match=r"rl.max_consecutive_skips=4: 5 optimizer steps in a row .* the last: "
                       r"non-finite loss in loop step 3, mini-batch 0, micro-batch 0"):
        module.updater.update(synthetic_batch(LENS))
    assert_same_params(module, SimpleNamespace(policy=_with(module.policy, before)))


def test_a_step_taken_resets_the_consecutive_count_and_a_gradient_cause_is_named(tiny_policy_dir):
    module = make(tiny_policy_dir)
    module.updater.loop.max_consecutive_skips = 1
    poison(module, {0, 6})  # loop step 1: mini 0 skipped (its micro 0), mini 1 steps; loop step 2: the same (micro 2)
    module.updater.update(synthetic_batch(LENS))
    assert module.updater.loop.accumulator.consecutive_skips == 0
    module.updater.update(synthetic_batch(LENS))
    assert module.updater.loop.accumulator.consecutive_skips == 0  # mini 1 stepped again
    module.updater.loop.forward_chunk = module.forward_chunk
    real_norm = torch.nn.utils.get_total_norm  # the accumulator's norm at the step
    torch.nn.utils.get_total_norm = lambda grads: torch.tensor(float("inf"))
    try:
        with pytest.raises(NonFiniteRunError, match="non-finite gradient norm at the optimizer step of loop step 3, "
                                                    "mini-batch 1"):
            module.updater.update(synthetic_batch(LENS))
    finally:
        torch.nn.utils.get_total_norm = real_norm


def _with(model, params):
    """A copy of ``model`` holding ``params``."""
    import copy

    other = copy.deepcopy(model)
    other.load_state_dict({**other.state_dict(), **params})
    return other
