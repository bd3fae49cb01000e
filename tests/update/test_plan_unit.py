"""Token-budgeted plans on the toy model: any cut is the unchunked step, fillers change nothing, refusals come first."""

import pytest
import torch
from helpers import max_rel_delta, params_of, synthetic_batch
from toy import UNEQUAL

from lightning_grpo.update import EMPTY, ChunkPlan, Split, plan_update
from lightning_grpo.update.plan import TokenBudgetError

EXACT = 1e-12


def budget_for(n_chunks: int, packed: bool = False) -> int:
    """The smallest budget that cuts UNEQUAL (prompt 4) into ``n_chunks`` chunks."""
    batch = synthetic_batch(UNEQUAL, seed=1)
    for budget in range(24, 400):
        plan, _ = plan_update(batch, 1, 1, budget=budget, packed=packed)
        if plan.n_chunks(0) == n_chunks:
            return budget
    raise AssertionError(f"no budget gives {n_chunks} chunks")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("n_chunks", [1, 3, 5])
def test_token_budgeted_step_equals_the_unchunked_step(toy_lm, n_chunks, packed):
    batch = synthetic_batch(UNEQUAL, seed=1)
    whole = toy_lm(Split(rows=8))
    chunked = toy_lm(Split(rows=8, max_tokens_per_micro=budget_for(n_chunks, packed), packed=packed))
    before = params_of(whole.model)
    whole.updater.update(batch)
    result = chunked.updater.update(batch)
    assert chunked.updater.last_plan.n_chunks(0) == n_chunks
    assert len(result.steps) == 1 and not result.steps[0].skipped
    delta = max_rel_delta(before, params_of(whole.model), params_of(chunked.model))
    assert delta <= EXACT
    if n_chunks == 1:  # one chunk keeps the unchunked expression: bit-identical
        assert delta == 0.0


def test_empty_filler_chunks_change_nothing(toy_lm):
    """A rank padded with empty chunks (another rank needed more) takes exactly the same step."""
    batch = synthetic_batch(UNEQUAL, seed=1)
    budget = budget_for(3)
    plain = toy_lm(Split(rows=8, max_tokens_per_micro=budget))
    padded = toy_lm(Split(rows=8, max_tokens_per_micro=budget))
    before = params_of(plain.model)
    plain.updater.update(batch)
    plan, _ = plan_update(batch, 1, 1, budget=budget)
    filled = ChunkPlan(((EMPTY, *plan.rows[0][:2], EMPTY, *plan.rows[0][2:], EMPTY),))
    result = padded.loop.run(batch, filled)
    assert len(result.chunks) == plan.n_chunks(0)  # the fillers report nothing
    assert sum(float(c.n) for c in result.chunks) == 8
    assert max_rel_delta(before, params_of(plain.model), params_of(padded.model)) <= EXACT


def test_the_ranks_max_chunk_count_pads_with_fillers_and_keeps_the_step(toy_lm):
    """Through the Updater: a DataParallel whose max says another rank needs 5 chunks."""
    from lightning_grpo.update import DataParallel

    batch = synthetic_batch(UNEQUAL, seed=1)
    budget = budget_for(3)
    plain = toy_lm(Split(rows=8, max_tokens_per_micro=budget))
    padded = toy_lm(Split(rows=8, max_tokens_per_micro=budget))
    padded.updater.dp = DataParallel(max=_five_chunks)
    before = params_of(plain.model)
    plain.updater.update(batch)
    padded.updater.update(batch)
    assert padded.updater.last_plan.n_chunks(0) == 5 and padded.updater.last_plan.empty_chunks == 2
    assert max_rel_delta(before, params_of(plain.model), params_of(padded.model)) <= EXACT


def _five_chunks(counts):
    out = counts.clone()
    out[0] = torch.maximum(out[0], torch.tensor(5))
    return out


def test_poisoned_window_discards_exactly_the_rest_of_a_data_dependent_window(toy_lm):
    """Windows of 3 and 2 chunks: a NaN in chunk 1 of the first discards 1 call; the second window trains."""
    batch = synthetic_batch([20, 18, 19, 17, 1, 2, 3, 4], seed=3)
    toy = toy_lm(Split(rows=8, n_mini=2, max_tokens_per_micro=48))
    plan = ChunkPlan((((0,), (1,), (2,)), ((3,), (4, 5, 6, 7))))
    seen = []

    def forward(chunk, old):
        loss, denom, stats = toy.forward_chunk(chunk, old)
        seen.append(tuple(chunk.sample_ids.tolist()))
        return (loss * float("nan") if len(seen) == 2 else loss), denom, stats

    toy.loop.forward_chunk = forward
    result = toy.loop.run(batch, plan)
    assert [s.skipped for s in result.steps] == [True, False]
    assert result.discarded_chunks == 2
    assert seen == [(0,), (1,), (3,), (4, 5, 6, 7)]
    assert not toy.accumulator.discarding()


def test_a_budget_under_the_longest_prompt_is_refused_before_any_backward(toy_lm):
    toy = toy_lm(Split(rows=8, max_tokens_per_micro=20))
    with pytest.raises(TokenBudgetError, match=r"rl.max_tokens_per_micro=20 is smaller than the longest prompt .* \(30 tokens\)"):
        toy.updater.update(synthetic_batch([3] * 8, prompt_len=30))
    assert all(p.grad is None for p in toy.model.parameters())
