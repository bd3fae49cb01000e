"""Roll-up: token-weighted loss, summed counts, mean/max per-step figures."""

import math

import pytest
import torch
from helpers import synthetic_batch

from lightning_grpo.metrics import roll_up
from lightning_grpo.objectives.chunk_stats import ChunkStats
from lightning_grpo.objectives.grpo import GRPOObjective
from lightning_grpo.rank_metrics import combine_ranks
from lightning_grpo.update.accumulate import StepOutcome
from lightning_grpo.update.loop import LoopResult
from lightning_grpo.update.plan import ChunkPlan


def chunk_stats(batch, n_micro, old_shift=0.3):
    """Objective stats of each chunk, with pi_old shifted so the loss depends on the token mix."""
    obj, plan, out = GRPOObjective(), ChunkPlan.fixed(len(batch), 1, n_micro), []
    g = torch.Generator().manual_seed(0)
    lp_all = -torch.rand(batch.input_ids.shape, generator=g)[:, 1:]
    for mini, micro in plan.walk():
        rows = slice(plan.rows[mini][micro][0], plan.rows[mini][micro][-1] + 1)
        chunk = plan.chunk(batch, mini, micro)
        width = chunk.input_ids.shape[1] - 1
        lp = lp_all[rows, :width]
        out.append(obj(lp, chunk.completion_mask[:, 1:], chunk.advantages, old_logprobs=lp - old_shift)[2])
    return out


@pytest.mark.parametrize("n_micro", [2, 4])
def test_unequal_lengths_roll_up_to_batch_loss_and_plain_mean_does_not(n_micro):
    batch = synthetic_batch([1, 14, 2, 9, 3, 20, 1, 5], seed=9)
    whole = roll_up(LoopResult(chunks=chunk_stats(batch, 1), steps=[StepOutcome(1.0, 1e-3, False)]))
    stats = chunk_stats(batch, n_micro)
    parts = roll_up(LoopResult(chunks=stats, steps=[StepOutcome(1.0, 1e-3, False)]))
    assert parts["grpo/loss"] == pytest.approx(whole["grpo/loss"], rel=1e-6)
    plain = sum(float(s.loss) for s in stats) / len(stats)
    assert abs(plain - whole["grpo/loss"]) > 1e-3 * abs(whole["grpo/loss"])
    for count in ("grpo/n", "grpo/tokens", "grpo/denom"):
        assert parts[count] == whole[count]  # counts sum, exactly
    assert parts["grpo/clip_frac"] == pytest.approx(whole["grpo/clip_frac"], rel=1e-6)


def test_equal_lengths_both_reductions_agree():
    batch = synthetic_batch([6] * 8, seed=10)
    whole = roll_up(LoopResult(chunks=chunk_stats(batch, 1)))
    stats = chunk_stats(batch, 4)
    plain = sum(float(s.loss) for s in stats) / len(stats)
    assert roll_up(LoopResult(chunks=stats))["grpo/loss"] == pytest.approx(whole["grpo/loss"], rel=1e-6)
    assert plain == pytest.approx(whole["grpo/loss"], rel=1e-6)


def test_step_figures_are_mean_and_max_over_stepped_windows():
    steps = [StepOutcome(1.0, 1e-3, False), StepOutcome(float("nan"), 1e-3, True), StepOutcome(3.0, 2e-3, False)]
    m = roll_up(LoopResult(steps=steps, discarded_chunks=2))
    assert m["grpo/grad_norm"] == 2.0 and m["grpo/grad_norm_max"] == 3.0
    assert m["grpo/lr"] == pytest.approx(1.5e-3) and m["grpo/lr_max"] == 2e-3
    assert (m["grpo/optimizer_steps"], m["grpo/skipped_windows"], m["grpo/discarded_chunks"]) == (2, 1, 2)


def test_a_fully_skipped_loop_step_logs_every_name_nan_or_zero_never_absent():
    """Issue 20: a missing key made Lightning re-log the previous step's cached value (and a resumed run a blank)."""
    clean = roll_up(LoopResult(chunks=chunk_stats(synthetic_batch([3, 5, 2, 4]), 2),
                               steps=[StepOutcome(1.0, 1e-3, False)]))
    skipped = roll_up(LoopResult(steps=[StepOutcome(math.nan, 1e-3, True, cause="loss")] * 2, discarded_chunks=4,
                                 consecutive_skips=5), stats=ChunkStats)  # no chunk: the objective's stats name them
    assert skipped.keys() == clean.keys()
    for name in ("grpo/loss", "grpo/clip_frac", "grpo/ratio_mean", "grpo/ratio_max", "grpo/kl", "grpo/grad_norm",
                 "grpo/grad_norm_max", "grpo/lr", "grpo/lr_max"):
        assert math.isnan(skipped[name]), name
    assert all(skipped[name] == 0.0 for name in ("grpo/denom", "grpo/tokens", "grpo/n"))
    assert (skipped["grpo/skipped_windows"], skipped["grpo/consecutive_skips"], skipped["grpo/optimizer_steps"]) == (
        2.0, 5.0, 0.0)


def test_combine_ranks_keeps_a_skipped_steps_token_weighted_figures_nan():
    skipped = roll_up(LoopResult(steps=[StepOutcome(math.nan, 1e-3, True, cause="loss")]), stats=ChunkStats)
    out = combine_ranks(skipped, lambda t, op: t * 2 if op == "sum" else t, world_size=2, rows=4)
    assert math.isnan(out["grpo/clip_frac"]) and math.isnan(out["grpo/loss"]) and out["grpo/tokens"] == 0.0
