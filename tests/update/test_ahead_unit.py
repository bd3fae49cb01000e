"""The ahead pass on the toy model: frozen pi_old, walks paired by call order, the probe, inner epochs."""

import copy
import functools
from dataclasses import replace

import pytest
import torch
from helpers import params_of, synthetic_batch
from toy import LENS, score

from lightning_grpo.timing import AHEAD
from lightning_grpo.update import AheadPass, ChunkPlan, ForwardNoisePolicy, Needs, Split
from lightning_grpo.update.ahead import NondeterministicForwardError, PairingError

PI_OLD = Needs(pi_old=True)


def ahead_toy(toy_lm, n_mini=4, n_micro=2, lr=0.1, needs=PI_OLD, **split):
    return toy_lm(Split(rows=16, n_mini=n_mini, n_micro=n_micro, **split), needs, lr=lr, adam=True)


def per_step(result) -> list[list]:
    n = len(result.chunks) // len(result.steps)
    return [result.chunks[i:i + n] for i in range(0, len(result.chunks), n)]


def weighted(chunks, field) -> float:
    tokens = sum(float(c.tokens) for c in chunks)
    return sum(float(getattr(c, field) * c.tokens) for c in chunks) / tokens


def count_scores(toy) -> list[bool]:
    """The model's mode at every ahead-pass score call (True = train mode: the probe)."""
    calls = []
    real = toy.updater.ahead.score

    def counted(chunk):
        calls.append(toy.model.training)
        return real(chunk)

    toy.updater.ahead.score = counted
    return calls


def record_walks(toy):
    """(ahead walk, training walk): sample ids and width of every chunk each pass scored."""
    ahead, train = [], []
    real_score = toy.updater.ahead.score

    def ahead_score(chunk):
        if not toy.model.training:  # the probe's re-score is not part of the walk
            ahead.append((tuple(chunk.sample_ids.tolist()), chunk.input_ids.shape[1]))
        return real_score(chunk)

    def train_forward(chunk, old):
        train.append((tuple(chunk.sample_ids.tolist()), chunk.input_ids.shape[1]))
        return toy.forward_chunk(chunk, old)

    toy.updater.ahead.score = ahead_score
    toy.loop.forward_chunk = train_forward
    return ahead, train


def record_pi_old(toy) -> list:
    """(epoch, sample ids, pi_old handed to the objective) of every training chunk."""
    seen = []

    def forward(chunk, old):
        seen.append((toy.loop.progress.epoch, tuple(chunk.sample_ids.tolist()), old))
        return toy.forward_chunk(chunk, old)

    toy.loop.forward_chunk = forward
    return seen


def shuffled_batch():
    """Unequal lengths with sample ids in a scrambled order (no id matches its row)."""
    batch = synthetic_batch(LENS, seed=3)
    order = torch.randperm(len(LENS), generator=torch.Generator().manual_seed(9))
    return replace(batch, sample_ids=order + 100)


# -- the clip binds only with frozen pi_old -------------------------------------------------------------------------
@pytest.mark.parametrize("skip_first_mini", [True, False], ids=["skip-mini0", "full-walk"])
def test_frozen_pi_old_first_mini_ratio_is_one_and_later_minis_clip(toy_lm, skip_first_mini):
    toy = ahead_toy(toy_lm)
    toy.updater.ahead.skip_first_mini = skip_first_mini
    for seed in (0, 1):  # the probe's loop step and a later one
        result = toy.updater.update(synthetic_batch(LENS, seed=seed))
        assert len(result.steps) == 4 and not any(s.skipped for s in result.steps)
        windows = per_step(result)
        first = [(float(c.ratio_mean), float(c.ratio_max), float(c.clip_frac)) for c in windows[0]]
        assert first == [(1.0, 1.0, 0.0)] * 2  # trained before any update: exactly exp(0)
        assert all(weighted(w, "ratio_mean") != 1.0 for w in windows[1:])
        assert any(weighted(w, "clip_frac") > 0 for w in windows[1:])


def test_without_frozen_pi_old_the_clip_never_binds(toy_lm):
    toy = ahead_toy(toy_lm, needs=Needs())
    calls = count_scores(toy)
    for seed in (0, 1):
        for window in per_step(toy.updater.update(synthetic_batch(LENS, seed=seed))):
            assert weighted(window, "clip_frac") == 0.0 and weighted(window, "ratio_mean") == 1.0
    assert calls == [] and toy.timer.seconds(AHEAD) == 0.0


# -- call-order keying ----------------------------------------------------------------------------------------------
def test_ahead_and_training_walks_visit_identical_chunks(toy_lm):
    toy = ahead_toy(toy_lm)
    toy.updater.ahead.skip_first_mini = False
    ahead, train = record_walks(toy)
    toy.updater.update(shuffled_batch())
    assert ahead == train and len(train) == 8
    assert len({width for _, width in train}) > 1  # chunks are trimmed to unequal widths
    toy.updater.ahead.skip_first_mini = True  # the probe passed: mini-batch 0 leaves the walk
    ahead.clear()
    train.clear()
    toy.updater.update(shuffled_batch())
    assert ahead == train[2:]


def test_non_contiguous_plan_pairs_by_call_order(toy_lm):
    toy = ahead_toy(toy_lm)
    toy.updater.ahead.skip_first_mini = False
    ahead, train = record_walks(toy)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(4)).tolist()
    pairs = [tuple(order[i:i + 2]) for i in range(0, 16, 2)]
    plan = ChunkPlan(tuple(tuple(pairs[2 * mi:2 * mi + 2]) for mi in range(4)))
    batch = shuffled_batch()
    pi_old = toy.updater.ahead.compute(batch, plan, PI_OLD)
    toy.loop.run(batch, plan, pi_old)
    assert ahead == train and len(train) == 8


def test_a_record_that_does_not_fit_its_chunk_is_refused(toy_lm):
    toy = ahead_toy(toy_lm)
    batch = synthetic_batch(LENS)
    plan = ChunkPlan.fixed(16, 4, 2)
    pi_old = toy.updater.ahead.compute(batch, plan, PI_OLD)
    with pytest.raises(PairingError, match="chunk 3 of the training walk"):
        toy.loop.run(batch, plan, pi_old[:3] + [pi_old[4]] + pi_old[4:])
    with pytest.raises(ValueError, match="pi_old has 7 entries for a plan of 8 chunks"):
        toy.loop.run(batch, plan, pi_old[:7])


def test_training_walk_on_a_shuffled_plan_is_caught_by_the_shape_check(toy_lm):
    toy = ahead_toy(toy_lm, n_micro=1, max_tokens_per_micro=40)
    toy.updater.ahead.skip_first_mini = False
    batch = synthetic_batch(LENS, seed=5)
    plan, ahead = toy.updater.plan(batch)
    pi_old = toy.updater.ahead.compute(batch, plan, PI_OLD, ahead)
    assert plan.n_chunks(1) > 1
    shuffled = ChunkPlan(tuple(chunks[::-1] for chunks in plan.rows))
    with pytest.raises(PairingError, match="both walks must use the same ChunkPlan"):
        toy.loop.run(batch, shuffled, pi_old)


def test_ahead_pass_with_its_own_budget_records_what_the_training_chunks_would(toy_lm):
    toy = ahead_toy(toy_lm, n_micro=1, max_tokens_per_micro=40, ahead_budget=80, mu_iterations=2)
    batch = synthetic_batch(LENS, seed=5)
    plan, ahead = toy.updater.plan(batch)
    assert ahead is not None and ahead.n_chunks(0) < plan.real_chunks  # fewer, bigger forwards
    widths = count_scores(toy)
    by_rows = toy.updater.ahead.compute(batch, plan, PI_OLD, ahead)
    assert len(widths) == ahead.n_chunks(0) + 1  # + the probe's train-mode re-score, once
    walked = toy.updater.ahead.compute(batch, plan, PI_OLD)
    assert len(by_rows) == len(walked) == 2 * plan.real_chunks
    for (_, mini, micro), a, b in zip(plan.training_walk(), by_rows, walked):
        mask = plan.chunk(batch, mini, micro).completion_mask[:, 1:]
        assert a.shape == b.shape
        torch.testing.assert_close(a[mask], b[mask], atol=1e-12, rtol=0)


def test_update_computes_one_plan_per_collected_batch_for_both_walks(toy_lm, monkeypatch):
    toy = ahead_toy(toy_lm, n_micro=1, max_tokens_per_micro=40, mu_iterations=2)
    ahead, train = record_walks(toy)
    plans = []
    real_plan = toy.updater.plan

    def plan(batch, needs=None):
        plans.append(real_plan(batch, needs))
        return plans[-1]

    monkeypatch.setattr(toy.updater, "plan", plan)
    toy.updater.update(synthetic_batch(LENS, seed=6))
    assert len(plans) == 1 and toy.updater.last_plan is plans[0][0]
    assert toy.updater.last_plan.real_chunks > 4  # data-dependent chunking really happened
    ahead_rows = sorted(i for ids, _ in ahead for i in ids)
    train_rows = sorted(i for ids, _ in train for i in ids)
    assert ahead_rows == train_rows[::2] == list(range(16))  # each row scored once, trained twice (mu=2)


# -- the one-shot determinism probe --------------------------------------------------------------------------------
def test_probe_catches_dropout_left_on(toy_lm):
    torch.manual_seed(0)
    toy = toy_lm(Split(rows=16, n_mini=4, n_micro=2), PI_OLD, dropout=0.3)
    before = params_of(toy.model)
    with pytest.raises(NondeterministicForwardError) as err:
        toy.updater.update(synthetic_batch(LENS))
    msg = str(err.value)
    assert "of completion tokens moved by more than 0.05 nats" in msg and "any token" in msg
    assert "dropout left on" in msg and "ForwardNoisePolicy" in msg
    assert all(torch.equal(before[k], v) for k, v in params_of(toy.model).items())  # nothing trained
    assert toy.model.training  # the mode it had before the ahead pass


def test_probe_accepts_the_noise_a_policy_declares(toy_lm):
    torch.manual_seed(0)
    toy = toy_lm(Split(rows=16, n_mini=4, n_micro=2), PI_OLD, dropout=0.3)
    toy.model.forward_noise_policy = ForwardNoisePolicy(bound_nats=50.0)
    toy.updater.update(synthetic_batch(LENS))
    assert toy.updater.ahead.probe_passed


def test_probe_passes_a_deterministic_policy_and_runs_once(toy_lm):
    toy = ahead_toy(toy_lm)
    calls = count_scores(toy)
    for seed in range(3):
        toy.updater.update(synthetic_batch(LENS, seed=seed))
    assert calls.count(True) == 1  # one train-mode re-score in the whole run
    assert len(calls) == 1 + 1 + 6 + 6 + 6  # chunk (0, 0) probed, then mini-batch 0 left out
    assert toy.updater.ahead.probe_passed and toy.model.training


def test_probe_state_survives_resume(toy_lm):
    toy = ahead_toy(toy_lm)
    toy.updater.update(synthetic_batch(LENS))
    state = toy.updater.ahead.state_dict()
    resumed = ahead_toy(toy_lm)
    resumed.updater.ahead.load_state_dict(state)
    calls = count_scores(resumed)
    resumed.updater.update(synthetic_batch(LENS, seed=1))
    assert True not in calls and len(calls) == 6  # no second probe, mini-batch 0 skipped from the start
    fresh = AheadPass(toy.model, functools.partial(score, toy.model))
    assert fresh.state_dict() == {"probe": None}


def test_n_mini_1_runs_no_ahead_pass_and_stays_byte_identical(toy_lm):
    toy = ahead_toy(toy_lm, n_mini=1, n_micro=4, needs=Needs())
    reference = ahead_toy(toy_lm, n_mini=1, n_micro=4, needs=Needs())
    calls = count_scores(toy)
    batch = synthetic_batch(LENS)
    toy.updater.update(batch)
    reference.loop.run(batch, ChunkPlan.fixed(16, 1, 4))  # the path before the ahead pass existed
    assert calls == [] and toy.timer.seconds(AHEAD) == 0.0
    a, b = params_of(toy.model), params_of(reference.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- inner epochs (rl.mu_iterations) --------------------------------------------------------------------------------
def epoch_figure(result, field: str, epoch: int) -> float:
    chunks = [c for c, e in zip(result.chunks, result.chunk_epochs) if e == epoch]
    return weighted(chunks, field)


def test_every_epoch_scores_against_the_rollout_policy_and_the_clip_binds_more_in_epoch_2(toy_lm):
    toy = ahead_toy(toy_lm, n_mini=2, n_micro=1, mu_iterations=2, lr=0.03)
    rollout_policy = copy.deepcopy(toy.model)
    seen = record_pi_old(toy)
    batch = synthetic_batch(LENS, seed=11)
    result = toy.updater.update(batch)
    assert len(result.steps) == 4 and toy.loop.progress.optimizer_steps == 4 and toy.loop.progress.epoch == 1
    assert [e for e, _, _ in seen] == [0, 0, 1, 1]
    assert all(old is not None for _, _, old in seen)  # mini-batch 0 is recorded too: epoch 2 trains it again
    by_chunk = {}
    for _, ids, old in seen:
        by_chunk.setdefault(ids, []).append(old)
    for ids, (first, second) in by_chunk.items():
        assert second is first  # one record per collected batch, never per epoch
        with torch.no_grad():
            expected = score(rollout_policy.eval(), batch.select(torch.tensor(ids)))
        torch.testing.assert_close(first, expected, atol=1e-12, rtol=0)  # ... the rollout policy's

    now = toy.updater.ahead.compute(batch, toy.updater.last_plan, PI_OLD)
    assert max(float((a - b).abs().max()) for a, (_, _, b) in zip(now, seen)) > 1e-3  # recomputing would differ
    assert epoch_figure(result, "clip_frac", 1) > epoch_figure(result, "clip_frac", 0)
    assert epoch_figure(result, "kl_old", 1) > epoch_figure(result, "kl_old", 0) > 0


def test_recomputing_pi_old_per_epoch_collapses_the_clip(toy_lm):
    """The failure the test above guards: pi_old taken afresh at each epoch start clips less in epoch 2."""
    frozen = ahead_toy(toy_lm, n_mini=2, n_micro=1, mu_iterations=2, lr=0.03)
    one = ahead_toy(toy_lm, n_mini=2, n_micro=1, lr=0.03)
    batch = synthetic_batch(LENS, seed=11)
    result = frozen.updater.update(batch)
    one.updater.update(batch)
    second = one.updater.update(batch)
    assert weighted(second.chunks, "clip_frac") < epoch_figure(result, "clip_frac", 1)


def test_ahead_pass_records_mini_batch_0_at_mu_2_even_after_the_probe(toy_lm):
    toy = ahead_toy(toy_lm, n_mini=4, n_micro=1, mu_iterations=2)
    toy.updater.update(synthetic_batch(LENS, seed=1))
    ahead = toy.updater.ahead
    assert ahead.probe_passed and not ahead.skips_first_mini(PI_OLD, 2)
    assert ahead.skips_first_mini(PI_OLD, 1)  # a single epoch may skip it
    again = synthetic_batch(LENS, seed=2)
    pi_old = ahead.compute(again, toy.updater.plan(again)[0], PI_OLD)
    assert len(pi_old) == 2 * 4 and all(old is not None for old in pi_old)


def test_later_epochs_reshuffle_the_mini_batch_order_deterministically(toy_lm):
    toy = ahead_toy(toy_lm, n_mini=8, n_micro=1, mu_iterations=3)
    batch = synthetic_batch(LENS)
    plan, _ = toy.updater.plan(batch)
    assert plan.order[0] == tuple(range(8)) and len(plan.order) == 3
    assert all(sorted(o) == list(range(8)) for o in plan.order) and plan.order[1] != plan.order[0]
    assert toy.updater.plan(batch)[0].order == plan.order  # the same seed and loop step: the same order
    toy.loop.progress.loop_step += 1
    assert toy.updater.plan(batch)[0].order != plan.order  # a new one every loop step


def test_mu_with_a_token_budget_walks_the_same_chunks_each_epoch(toy_lm):
    toy = ahead_toy(toy_lm, n_mini=2, n_micro=1, mu_iterations=2, max_tokens_per_micro=40)
    seen = record_pi_old(toy)
    toy.updater.update(synthetic_batch(LENS, seed=4))
    epochs = [sorted(ids for e, ids, _ in seen if e == k) for k in (0, 1)]
    assert epochs[0] == epochs[1] and len(epochs[0]) > 2


@pytest.mark.parametrize("split", [Split(rows=16, n_micro=4), Split(rows=16, max_tokens_per_micro=40),
                                   Split(rows=16, n_micro=2, mu_iterations=2)],
                         ids=["fixed", "token-budget", "inner-epochs"])
def test_chunked_update_with_frozen_pi_old_equals_unchunked(toy_lm, split):
    from helpers import max_rel_delta

    batch = synthetic_batch(LENS, seed=1)
    whole = toy_lm(Split(rows=16, mu_iterations=split.mu_iterations), PI_OLD)
    chunked = toy_lm(split, PI_OLD)
    before = params_of(whole.model)
    whole.updater.update(batch)
    result = chunked.updater.update(batch)
    assert len(result.steps) == split.mu_iterations and chunked.updater.last_plan.real_chunks > 1
    assert max_rel_delta(before, params_of(whole.model), params_of(chunked.model)) < 1e-12
