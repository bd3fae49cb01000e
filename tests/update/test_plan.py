"""ChunkPlan under a token budget: fewest balanced chunks under a hard cap, DP fillers, exactness, refusals."""

# A test marked slow here has its toy-model twin of the same name in tests/update/test_plan_unit.py
# (the unit tier); the runs here, through a GRPOModule on the tiny Qwen2 policy, are the slow tier's.

import pytest
import torch
from helpers import max_rel_delta, params_of, synthetic_batch

from lightning_grpo.config import GRPOConfig, RolloutConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.update.plan import (
    EMPTY,
    ChunkPlan,
    TokenBudgetError,
    pi_old_source,
    plan_update,
    sequence_lengths,
    take,
    token_chunks,
)

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier

UNEQUAL = [1, 12, 3, 20, 2, 7, 15, 4]  # completion lengths; + 4 prompt tokens: 5 16 7 24 6 11 19 8
BUDGETS = {1: 192, 3: 48, 7: 15}  # chunks each budget gives on UNEQUAL (checked below; 15: the 3 longest sit alone)


def cost(lengths, rows) -> int:
    return len(rows) * max(max(lengths[r] for r in rows), 2)


def partitions(items):
    """Every set partition of ``items`` (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first, *part[i]]] + part[i + 1:]
        yield [[first], *part]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [20, 33, 64])
def test_fewest_chunks_under_the_cap_and_most_balanced_among_them(seed, budget):
    """Exhaustive check on 7 rows: no partition under the cap has fewer chunks, none with as few has a lower max."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 17, (7,), generator=g).tolist()
    chunks = token_chunks(lengths, range(7), budget)
    assert sorted(r for c in chunks for r in c) == list(range(7))  # every row exactly once
    assert all(cost(lengths, c) <= budget for c in chunks)  # a hard cap (every row fits alone here)
    feasible = [p for p in partitions(list(range(7))) if all(cost(lengths, c) <= budget for c in p)]
    fewest = min(len(p) for p in feasible)
    assert len(chunks) == fewest
    assert max(cost(lengths, c) for c in chunks) == min(max(cost(lengths, c) for c in p)
                                                        for p in feasible if len(p) == fewest)
    assert token_chunks(lengths, range(7), budget) == chunks  # deterministic


def test_a_row_over_the_budget_sits_alone_and_is_counted():
    batch = synthetic_batch([2, 30, 3, 4], prompt_len=4)  # lengths 6 34 7 8
    plan, _ = plan_update(batch, n_mini=1, n_micro=1, budget=24)
    assert (1,) in plan.rows[0] and plan.oversized == 1
    assert all(cost(sequence_lengths(batch)[0], c) <= 24 for c in plan.rows[0] if c != (1,))


def test_chunks_pad_only_to_their_own_longest_row():
    batch = synthetic_batch(UNEQUAL, prompt_len=4)
    plan, _ = plan_update(batch, n_mini=1, n_micro=1, budget=BUDGETS[3])
    lengths, _ = sequence_lengths(batch)
    for rows in plan.rows[0]:
        assert plan.chunk(batch, 0, plan.rows[0].index(rows)).input_ids.shape[1] == max(lengths[r] for r in rows)


def test_budgets_give_the_chunk_counts_the_equivalence_test_uses():
    batch = synthetic_batch(UNEQUAL, seed=1)
    assert {k: plan_update(batch, 1, 1, budget=b)[0].n_chunks(0) for k, b in BUDGETS.items()} == {1: 1, 3: 3, 7: 7}


def test_each_rank_takes_the_largest_count_and_fills_with_empty_chunks():
    batch = synthetic_batch(UNEQUAL, prompt_len=4)
    plan, ahead = plan_update(batch, n_mini=2, n_micro=1, budget=24, ahead_rows=list(range(8)), ahead_budget=48,
                              dp_max=lambda t: torch.maximum(t, torch.tensor([5, 6, 6, 0])))  # another rank's counts
    assert [plan.n_chunks(m) for m in (0, 1)] == [5, 6] and ahead.n_chunks(0) == 6
    assert plan.real_chunks == 3 + 3 and plan.empty_chunks == (5 - 3) + (6 - 3)
    assert all(plan.rows[m][-1] == EMPTY for m in (0, 1))
    empty = take(batch, EMPTY)
    assert len(empty) == 1 and not empty.completion_mask.any() and float(empty.advantages.abs().sum()) == 0.0


def test_budget_smaller_than_the_longest_prompt_is_refused_with_the_numbers():
    batch = synthetic_batch([3, 4], prompt_len=30)
    with pytest.raises(TokenBudgetError, match=r"max_tokens_per_micro=20 is smaller than the longest prompt .*30 tok"):
        plan_update(batch, 1, 1, budget=20)
    with pytest.raises(TokenBudgetError, match=r"max_tokens_per_ahead_micro=25 .*30 tokens"):
        plan_update(batch, 1, 1, ahead_rows=[0, 1], ahead_budget=25)


def test_module_refuses_at_the_first_batch(tiny_policy_dir):
    module = budget_module(tiny_policy_dir, budget=20)
    with pytest.raises(TokenBudgetError, match="longest prompt in this collected batch \\(30 tokens\\)"):
        module.updater.update(synthetic_batch([3] * 8, prompt_len=30))


# -- one optimizer step equals the unchunked step ---------------------------------------------------------------------
def budget_module(policy_dir, budget=0, dtype="float32", packed=False, **rl):
    cfg = GRPOConfig(batch_per_replica=8, group_size=2, max_tokens_per_micro=budget, max_grad_norm=0.0, packed=packed,
                     **rl)
    module = GRPOModule(policy=PolicyConfig(path=str(policy_dir), dtype=dtype), rl=cfg, rollout=RolloutConfig())
    module.configure_model()
    module.updater.attach(torch.optim.SGD(module.policy.parameters(), lr=0.1))
    return module


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [("float64", 5e-8), ("float32", 1e-5)])
@pytest.mark.parametrize("n_chunks", [1, 3, 7])
def test_token_budgeted_step_equals_the_unchunked_step(tiny_policy_dir, dtype, tol, n_chunks):
    batch = synthetic_batch(UNEQUAL, seed=1)
    whole, chunked = budget_module(tiny_policy_dir, 0, dtype), budget_module(tiny_policy_dir, BUDGETS[n_chunks], dtype)
    before = params_of(whole.policy)
    whole.updater.update(batch)
    result = chunked.updater.update(batch)
    assert chunked.updater.last_plan.n_chunks(0) == n_chunks and len(result.steps) == 1 and not result.steps[0].skipped
    delta = max_rel_delta(before, params_of(whole.policy), params_of(chunked.policy))
    assert delta <= tol
    if n_chunks == 1:  # one chunk keeps the unchunked expression: bit-identical
        assert delta == 0.0


@pytest.mark.slow
def test_empty_filler_chunks_change_nothing(tiny_policy_dir):
    """A rank padded with empty chunks (another rank needed more) takes exactly the same step."""
    batch = synthetic_batch(UNEQUAL, seed=1)
    plain, padded = budget_module(tiny_policy_dir, 48, "float64"), budget_module(tiny_policy_dir, 48, "float64")
    before = params_of(plain.policy)
    plain.updater.update(batch)
    plan, _ = plan_update(batch, 1, 1, budget=48)
    filled = ChunkPlan(((EMPTY, *plan.rows[0][:2], EMPTY, *plan.rows[0][2:], EMPTY),))
    result = padded.updater.loop.run(batch, filled)
    assert len(result.chunks) == plan.n_chunks(0)  # the fillers report no stats (no trajectory, no token)
    assert sum(float(c.n) for c in result.chunks) == 8
    assert max_rel_delta(before, params_of(plain.policy), params_of(padded.policy)) <= 5e-8


@pytest.mark.slow
def test_poisoned_window_discards_exactly_the_rest_of_a_data_dependent_window(tiny_policy_dir):
    """Windows of 3 and 2 chunks: a NaN in chunk 1 of the first discards 1 call; the second window trains."""
    batch = synthetic_batch([20, 18, 19, 17, 1, 2, 3, 4], seed=3)
    module = budget_module(tiny_policy_dir, 48, mini_batch_per_replica=4)
    plan = ChunkPlan((((0,), (1,), (2,)), ((3,), (4, 5, 6, 7))))  # the shape a budget gives long vs short rows
    seen, real = [], module.forward_chunk

    def forward(chunk, old):
        loss, denom, stats = real(chunk, old)
        seen.append(tuple(chunk.sample_ids.tolist()))
        return (loss * float("nan") if len(seen) == 2 else loss), denom, stats

    module.updater.loop.forward_chunk = forward
    result = module.updater.loop.run(batch, plan)
    assert [s.skipped for s in result.steps] == [True, False]
    assert result.discarded_chunks == 2  # the NaN chunk and the one after it, nothing of the next window
    assert seen == [(0,), (1,), (3,), (4, 5, 6, 7)]
    assert not module.updater.loop.accumulator.discarding()


@pytest.mark.parametrize("rl,reads,expected", [
    ({}, True, "current"),  # one optimizer step per batch: the policy has not moved yet
    ({"mini_batch_per_replica": 8}, True, "ahead"),
    ({"mu_iterations": 2}, True, "ahead"),
    ({"mini_batch_per_replica": 8}, False, "current"),  # an objective without a ratio (distillation alone)
    ({"mini_batch_per_replica": 8, "freeze_pi_old": False}, True, "current"),  # the diagnostic switch
    ({"mini_batch_per_replica": 8, "rollout_correction": {"mode": "bypass"}}, True, "sampler"),
    ({"rollout_correction": {"mode": "bypass"}}, True, "sampler"),
])
def test_pi_old_source_is_decided_from_the_config(rl, reads, expected):
    assert pi_old_source(GRPOConfig(batch_per_replica=16, group_size=2, **rl), reads) == expected
