"""The collected-batch loop on the toy model: the nesting, poisoned windows, skipped steps, the skip limit."""

import pytest
import torch
from helpers import params_of, synthetic_batch
from toy import LENS, poison

from lightning_grpo.update import Split
from lightning_grpo.update.loop import NonFiniteRunError


def same_params(a, b) -> bool:
    pa, pb = params_of(a.model), params_of(b.model)
    return all(torch.equal(pa[k], pb[k]) for k in pa)


def twelve(toy_lm, n_mini=2, n_micro=3, rows=12):
    return toy_lm(Split(rows=rows, n_mini=n_mini, n_micro=n_micro), lr=1e-2, adam=True)


def test_walk_visits_mini_then_micro_and_steps_once_per_mini(toy_lm):
    toy = twelve(toy_lm)
    seen = []

    def forward(chunk, old):
        seen.append(tuple(chunk.sample_ids.tolist()))
        return toy.forward_chunk(chunk, old)

    toy.loop.forward_chunk = forward
    result = toy.updater.update(synthetic_batch(LENS[:12]))
    assert seen == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]
    assert len(result.steps) == 2 and not any(s.skipped for s in result.steps)
    assert toy.loop.progress.optimizer_steps == 2 and toy.loop.progress.loop_step == 1


@pytest.mark.parametrize("bad_call", [1, 2], ids=["chunk1-of-mini0", "last-chunk-of-mini0"])
def test_nan_in_mini0_abandons_it_and_equals_training_mini1_only(toy_lm, bad_call):
    batch = synthetic_batch(LENS[:12], seed=5)
    clean = synthetic_batch(LENS[:12], seed=6)
    poisoned = twelve(toy_lm)
    calls = poison(poisoned, {bad_call})
    result = poisoned.updater.update(batch)
    assert [s.skipped for s in result.steps] == [True, False]
    assert result.discarded_chunks == 3 - bad_call  # the bad chunk and what was left of its window
    assert calls[0] == 3 + bad_call + 1  # discarded chunks were never forwarded

    only_mini1 = twelve(toy_lm, n_mini=1, rows=6)
    only_mini1.updater.update(batch.select(slice(6, 12)))
    assert same_params(poisoned, only_mini1)

    result = poisoned.updater.update(clean)  # the next loop step is clean and both runs stay identical
    assert not any(s.skipped for s in result.steps) and result.discarded_chunks == 0
    reference = twelve(toy_lm)
    reference.model.load_state_dict(only_mini1.model.state_dict())
    reference.accumulator.optimizer.load_state_dict(only_mini1.accumulator.optimizer.state_dict())
    reference.updater.update(clean)
    assert same_params(poisoned, reference)


def test_nan_in_first_chunk_of_last_mini_does_not_leak_into_next_batch(toy_lm):
    batch = synthetic_batch(LENS[:12], seed=7)
    poisoned = twelve(toy_lm)
    poison(poisoned, {3})
    result = poisoned.updater.update(batch)
    assert [s.skipped for s in result.steps] == [False, True]
    assert result.discarded_chunks == 3
    assert not poisoned.accumulator.discarding()  # the countdown ended inside this batch

    only_mini0 = twelve(toy_lm, n_mini=1, rows=6)
    only_mini0.updater.update(batch.select(slice(0, 6)))
    assert same_params(poisoned, only_mini0)
    result = poisoned.updater.update(synthetic_batch(LENS[:12], seed=8))
    assert [s.skipped for s in result.steps] == [False, False] and result.discarded_chunks == 0


def test_nan_at_n_micro_1_skips_just_that_step(toy_lm):
    toy = twelve(toy_lm, n_mini=3, n_micro=1)
    poison(toy, {1})
    result = toy.updater.update(synthetic_batch(LENS[:12]))
    assert [s.skipped for s in result.steps] == [False, True, False]
    assert result.discarded_chunks == 1


def test_non_finite_gradient_norm_skips_the_step(toy_lm):
    toy = twelve(toy_lm, n_mini=1, n_micro=2)
    before = params_of(toy.model)
    hook = toy.model.embed.weight.register_hook(_times_inf)
    result = toy.updater.update(synthetic_batch(LENS[:12]))
    hook.remove()
    assert [s.skipped for s in result.steps] == [True]
    assert result.steps[0].cause == "gradient"
    assert all(torch.equal(before[k], v) for k, v in params_of(toy.model).items())
    assert all(p.grad is None for p in toy.model.parameters())


def _times_inf(grad):
    return grad * float("inf")


def test_past_max_consecutive_skips_the_run_stops_naming_the_last_non_finite_chunk(toy_lm):
    toy = twelve(toy_lm)  # n_mini = 2, n_micro = 3
    toy.loop.max_consecutive_skips = 4
    poison(toy, set(range(100)))
    before = params_of(toy.model)
    toy.updater.update(synthetic_batch(LENS[:12]))
    toy.updater.update(synthetic_batch(LENS[:12]))
    assert toy.accumulator.consecutive_skips == 4  # at the limit, not past it
    with pytest.raises(NonFiniteRunError, match=r"rl.max_consecutive_skips=4: 5 optimizer steps in a row .* the last: "
                       r"non-finite loss in loop step 3, mini-batch 0, micro-batch 0"):
        toy.updater.update(synthetic_batch(LENS[:12]))
    assert all(torch.equal(before[k], v) for k, v in params_of(toy.model).items())


def test_a_step_taken_resets_the_consecutive_count_and_a_gradient_cause_is_named(toy_lm, monkeypatch):
    toy = twelve(toy_lm)
    toy.loop.max_consecutive_skips = 1
    poison(toy, {0, 6})  # each loop step: mini 0 skipped, mini 1 steps
    toy.updater.update(synthetic_batch(LENS[:12]))
    assert toy.accumulator.consecutive_skips == 0
    toy.updater.update(synthetic_batch(LENS[:12]))
    assert toy.accumulator.consecutive_skips == 0
    toy.loop.forward_chunk = toy.forward_chunk
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", _inf_norm)
    with pytest.raises(NonFiniteRunError, match="non-finite gradient norm at the optimizer step of loop step 3, "
                                                "mini-batch 1"):
        toy.updater.update(synthetic_batch(LENS[:12]))


def _inf_norm(grads):
    return torch.tensor(float("inf"))


def test_a_resumed_loop_continues_the_window_counters(toy_lm):
    """state_dict -> load_state_dict carries the loop counters and the accumulator's window (exact resume)."""
    toy = twelve(toy_lm)
    toy.updater.update(synthetic_batch(LENS[:12]))
    state = toy.updater.state_dict()
    other = twelve(toy_lm)
    other.updater.load_state_dict(state)
    assert other.updater.state_dict() == state
    assert other.updater.loop_step == 1 and other.loop.progress.optimizer_steps == 2
