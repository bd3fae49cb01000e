"""Deferred normalization on the toy model: chunked == unchunked, the clip order, empty and fractional divisors."""

import pytest
import torch
from helpers import max_rel_delta, params_of, synthetic_batch
from toy import UNEQUAL, score

from lightning_grpo.update import ChunkPlan, Split

EXACT = 1e-12  # float64 on a toy model: the chunked and unchunked steps differ only by summation order


def naive_step(toy, batch, n_micro):
    """The wrong reduction: the mean of the chunks' token means."""
    opt = torch.optim.SGD(toy.model.parameters(), lr=0.1)
    plan = ChunkPlan.fixed(len(batch), 1, n_micro)
    for mini, micro in plan.walk():
        loss, _, _ = toy.forward_chunk(plan.chunk(batch, mini, micro), None)
        (loss / n_micro).backward()
    opt.step()


@pytest.mark.parametrize("n_micro", [2, 4, 8])
def test_chunked_step_equals_unchunked_on_unequal_lengths(toy_lm, n_micro):
    batch = synthetic_batch(UNEQUAL, seed=1)
    whole = toy_lm(Split(rows=8))
    chunked = toy_lm(Split(rows=8, n_micro=n_micro))
    before = params_of(whole.model)
    whole.updater.update(batch)
    result = chunked.updater.update(batch)
    assert len(result.steps) == 1 and not result.steps[0].skipped
    assert len(result.chunks) == n_micro
    assert max_rel_delta(before, params_of(whole.model), params_of(chunked.model)) <= EXACT


@pytest.mark.parametrize("n_micro", [2, 4, 8])
def test_naive_mean_of_chunk_means_fails_the_same_tolerance(toy_lm, n_micro):
    """The negative control: a per-chunk mean is a different update, far past the tolerance above."""
    batch = synthetic_batch(UNEQUAL, seed=1)
    whole = toy_lm(Split(rows=8))
    naive = toy_lm(Split(rows=8))
    before = params_of(whole.model)
    whole.updater.update(batch)
    naive_step(naive, batch, n_micro)
    assert max_rel_delta(before, params_of(whole.model), params_of(naive.model)) > 1e-3


def test_equal_lengths_make_mean_of_means_agree(toy_lm):
    """Sanity check of the control: equal chunk token counts make both reductions coincide."""
    batch = synthetic_batch([6] * 8, seed=2)
    whole = toy_lm(Split(rows=8))
    naive = toy_lm(Split(rows=8))
    before = params_of(whole.model)
    whole.updater.update(batch)
    naive_step(naive, batch, 4)
    assert max_rel_delta(before, params_of(whole.model), params_of(naive.model)) <= EXACT


def test_the_unchunked_step_is_the_token_mean_written_out(toy_lm):
    """Against the formula: grad of -sum_t A_i exp(lp - sg(lp)) / tokens, one SGD step."""
    batch = synthetic_batch(UNEQUAL, seed=4)
    toy = toy_lm(Split(rows=8, n_micro=4))
    ref = toy_lm(Split(rows=8))
    before = params_of(toy.model)
    toy.updater.update(batch)
    lp = score(ref.model, batch)  # [B, T-1]
    mask = batch.completion_mask[:, 1:]
    adv = batch.advantages.double().unsqueeze(-1)
    per_token = -(torch.exp(lp - lp.detach()) * adv)
    (per_token[mask].sum() / mask.sum()).backward()
    torch.optim.SGD(ref.model.parameters(), lr=0.1).step()
    assert max_rel_delta(before, params_of(ref.model), params_of(toy.model)) <= EXACT


def test_one_chunk_backprops_the_plain_loss_bit_for_bit(toy_lm):
    """n_micro == 1 keeps the unchunked expression (no loss * denom / sum): identical bits."""
    batch = synthetic_batch(UNEQUAL, seed=4)
    toy = toy_lm(Split(rows=8))
    ref = toy_lm(Split(rows=8))
    toy.updater.update(batch)
    loss, _, _ = ref.forward_chunk(batch.select(slice(0, 8)), None)
    loss.backward()
    torch.optim.SGD(ref.model.parameters(), lr=0.1).step()
    after, expected = params_of(toy.model), params_of(ref.model)
    assert all(torch.equal(after[k], expected[k]) for k in after)


def test_scale_then_clip_matches_unchunked_and_clip_then_scale_does_not(toy_lm):
    batch = synthetic_batch(UNEQUAL, seed=3)
    clip = 1e-3  # far below the natural gradient norm, so clipping binds
    whole = toy_lm(Split(rows=8), max_grad_norm=clip)
    chunked = toy_lm(Split(rows=8, n_micro=4), max_grad_norm=clip)
    before = params_of(whole.model)
    norm = whole.updater.update(batch).steps[0].grad_norm
    assert norm > 10 * clip
    chunked.updater.update(batch)
    assert max_rel_delta(before, params_of(whole.model), params_of(chunked.model)) <= EXACT

    wrong = toy_lm(Split(rows=8))  # clip the un-normalized sum, then divide
    opt = torch.optim.SGD(wrong.model.parameters(), lr=0.1)
    plan = ChunkPlan.fixed(8, 1, 4)
    total = 0.0
    for mini, micro in plan.walk():
        loss, denom, _ = wrong.forward_chunk(plan.chunk(batch, mini, micro), None)
        (loss * denom).backward()
        total += float(denom)
    torch.nn.utils.clip_grad_norm_(wrong.model.parameters(), clip)
    for p in wrong.model.parameters():
        p.grad.mul_(1 / total)
    opt.step()
    assert max_rel_delta(before, params_of(whole.model), params_of(wrong.model)) > 0.5


@pytest.mark.parametrize("n_micro", [1, 2])
def test_all_empty_batch_gives_zero_gradient_no_nan_no_skip(toy_lm, n_micro):
    batch = synthetic_batch([0] * 8, seed=4)
    toy = toy_lm(Split(rows=8, n_micro=n_micro), lr=1e-2, adam=True)
    before = params_of(toy.model)
    result = toy.updater.update(batch)
    assert [s.skipped for s in result.steps] == [False]
    assert result.steps[0].grad_norm == 0.0
    assert all(torch.equal(before[k], v) for k, v in params_of(toy.model).items())
    assert toy.accumulator.skipped_steps == 0


def test_batch_size_disagreeing_with_the_split_is_refused_before_backward(toy_lm):
    toy = toy_lm(Split(rows=8))
    before = params_of(toy.model)
    with pytest.raises(ValueError, match="collected batch has 6 trajectories .* expects 8"):
        toy.updater.update(synthetic_batch([3] * 6))
    assert all(p.grad is None for p in toy.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in params_of(toy.model).items())


@pytest.mark.parametrize("n_micro", [1, 4])
def test_fractional_dp_divisor_below_one_gives_the_exact_token_mean(toy_lm, n_micro):
    """A DP-mean divisor in (0, 1) (8 ranks' mean of 4 tokens) is divided by as is: only 0 is guarded."""
    from lightning_grpo.objectives.grpo import GRPOObjective

    batch = synthetic_batch([1, 0, 2, 0, 0, 1, 0, 0], seed=5)
    eighth = GRPOObjective(dp_mean=_eighth)
    toy = toy_lm(Split(rows=8, n_micro=n_micro), objective=eighth)
    before = params_of(toy.model)
    result = toy.updater.update(batch)
    assert not result.steps[0].skipped and float(result.chunks[0].denom) < 1

    ref = toy_lm(Split(rows=8))
    lp = score(ref.model, batch)
    mask = batch.completion_mask[:, 1:]
    per_token = -(torch.exp(lp - lp.detach()) * batch.advantages.double().unsqueeze(-1))
    (per_token[mask].sum() / (mask.sum() / 8)).backward()
    torch.optim.SGD(ref.model.parameters(), lr=0.1).step()
    assert max_rel_delta(before, params_of(ref.model), params_of(toy.model)) <= EXACT


def _eighth(t):
    """As if 7 more ranks held no tokens."""
    return t / 8
