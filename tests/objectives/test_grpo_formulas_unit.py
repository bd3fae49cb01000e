"""The GRPO objective against its formulas written out by hand: every divisor, both surrogates, the k3 KL, and the
per-sequence ratio, on a chunk with unequal lengths and an empty row (float64)."""

import pytest
import torch

from lightning_grpo.objectives.grpo import GRPOObjective

EXACT = dict(atol=1e-12, rtol=0)


def clipped_surrogate(t, eps_low=0.2, eps_high=0.2):
    """``[B, T-1]``: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
    ratio = torch.exp(t.logprobs - t.old)
    adv = t.advantages[:, None]
    clip = ratio.clamp(1 - eps_low, 1 + eps_high)
    return -torch.minimum(ratio * adv, clip * adv)


def by_hand(per_token, mask, loss_type, max_len=12):
    """(chunk sum, divisor) of ``per_token`` under ``loss_type``, written with loops over rows."""
    rows = [(per_token[i][mask[i]], int(mask[i].sum())) for i in range(len(mask))]
    seqs = sum(1 for _, n in rows if n > 0)
    if loss_type == "dapo":
        return sum(r.sum() for r, _ in rows), sum(n for _, n in rows)
    if loss_type == "grpo":
        return sum(r.sum() / n for r, n in rows if n > 0), seqs
    if loss_type == "dr_grpo":
        return sum(r.sum() for r, _ in rows), seqs * max_len
    return sum(r.sum() for r, _ in rows), seqs  # seq-mean-token-sum


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "seq-mean-token-sum"])
def test_each_divisor_is_its_formula(chunk_tensors, loss_type):
    t = chunk_tensors
    objective = GRPOObjective(loss_type=loss_type, max_completion_length=12)
    loss, denom, stats = objective(t.logprobs, t.mask, t.advantages, t.old)
    total, divisor = by_hand(clipped_surrogate(t), t.mask, loss_type)
    assert float(denom) == divisor
    torch.testing.assert_close(loss, total / divisor, **EXACT)
    torch.testing.assert_close(loss * denom, total, **EXACT)  # what the accumulator backprops
    assert float(stats.tokens) == 19 and float(stats.seqs) == 4  # the empty row is no sequence


def test_the_gradient_is_the_formulas(chunk_tensors):
    t = chunk_tensors
    loss, _, _ = GRPOObjective()(t.logprobs, t.mask, t.advantages, t.old)
    (grad,) = torch.autograd.grad(loss, t.logprobs)
    ratio = torch.exp(t.logprobs.detach() - t.old)
    adv = t.advantages[:, None].expand_as(ratio)
    inside = ~(((ratio > 1.2) & (adv > 0)) | ((ratio < 0.8) & (adv < 0)))  # where the min picks r A
    expected = torch.where(inside & t.mask, -adv * ratio, torch.zeros_like(ratio)) / 19
    torch.testing.assert_close(grad, expected, **EXACT)


def test_asymmetric_clip_bounds_are_applied_where_they_belong(chunk_tensors):
    t = chunk_tensors
    objective = GRPOObjective(epsilon=0.05, epsilon_high=0.15)
    loss, _, stats = objective(t.logprobs, t.mask, t.advantages, t.old)
    per_token = clipped_surrogate(t, 0.05, 0.15)
    torch.testing.assert_close(loss, per_token[t.mask].sum() / 19, **EXACT)
    ratio = torch.exp(t.logprobs.detach() - t.old)
    adv = t.advantages[:, None]
    low = ((ratio < 0.95) & (adv < 0) & t.mask).sum() / 19
    high = ((ratio > 1.15) & (adv > 0) & t.mask).sum() / 19
    assert float(stats.clip_frac_low) == pytest.approx(float(low)) and float(stats.clip_frac_high) == pytest.approx(
        float(high))
    assert float(low) > 0 and float(high) > 0  # both bounds bind on this chunk


def test_cispo_weighs_each_tokens_logprob_by_the_truncated_ratio(chunk_tensors):
    t = chunk_tensors
    loss, _, _ = GRPOObjective(loss="cispo")(t.logprobs, t.mask, t.advantages, t.old)
    weight = torch.exp(t.logprobs.detach() - t.old).clamp(0.8, 1.2)
    per_token = -(weight * t.advantages[:, None]) * t.logprobs
    torch.testing.assert_close(loss, per_token[t.mask].sum() / 19, **EXACT)


def test_the_k3_kl_is_added_under_the_same_divisor(chunk_tensors):
    t = chunk_tensors
    ref = t.old - 0.1
    loss, _, stats = GRPOObjective(beta=0.04)(t.logprobs, t.mask, t.advantages, t.old, ref)
    delta = ref - t.logprobs
    kl = torch.exp(delta) - delta - 1
    per_token = clipped_surrogate(t) + 0.04 * kl
    torch.testing.assert_close(loss, per_token[t.mask].sum() / 19, **EXACT)
    torch.testing.assert_close(stats.kl, kl[t.mask].sum().detach() / 19, **EXACT)


def test_the_sequence_ratio_is_the_length_normalized_mean(chunk_tensors):
    t = chunk_tensors
    loss, _, _ = GRPOObjective(ratio_level="sequence")(t.logprobs, t.mask, t.advantages, t.old)
    total = 0.0
    for i in range(4):  # row 4 has no token
        m = t.mask[i]
        s = torch.exp((t.logprobs[i][m] - t.old[i][m]).mean())
        a = t.advantages[i]
        total = total - torch.minimum(s * a, s.clamp(0.8, 1.2) * a) * int(m.sum())
    torch.testing.assert_close(loss, total / 19, **EXACT)


def test_an_all_masked_chunk_has_loss_zero_and_divisor_zero(chunk_tensors):
    t = chunk_tensors
    nothing = torch.zeros_like(t.mask)
    loss, denom, _ = GRPOObjective()(t.logprobs, nothing, t.advantages, t.old)
    assert float(loss.detach()) == 0.0 and float(denom) == 0.0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "seq-mean-token-sum"])
def test_every_divisor_is_exact_under_chunking(loss_type):
    """A chunk is a set of whole rows, so each divisor (a sum over rows) defers exactly: 4 chunks == 1 (toy model)."""
    from helpers import max_rel_delta, params_of, synthetic_batch
    from toy import UNEQUAL, make_toy

    from lightning_grpo.update import Split

    batch = synthetic_batch(UNEQUAL, seed=2)
    objective = GRPOObjective(loss_type=loss_type, max_completion_length=24)
    whole = make_toy(Split(rows=8), objective=objective)
    chunked = make_toy(Split(rows=8, n_micro=4), objective=objective)
    before = params_of(whole.model)
    whole.updater.update(batch)
    chunked.updater.update(batch)
    assert max_rel_delta(before, params_of(whole.model), params_of(chunked.model)) <= 1e-12
