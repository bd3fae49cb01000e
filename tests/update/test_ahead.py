"""Frozen pi_old across the window: the ahead pass, its gates, call-order keying and the one-shot probe."""

# A test marked slow here has its toy-model twin of the same name in tests/update/test_ahead_unit.py
# (the unit tier); the runs here, through a GRPOModule on the tiny Qwen2 policy, are the slow tier's.

from dataclasses import replace

import pytest
import torch
from helpers import SMALL, clone, params_of, synthetic_batch

from lightning_grpo.config import ConfigError, GRPOConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.timing import AHEAD, UPDATE
from lightning_grpo.tiny.build import build_tiny_policy
from lightning_grpo.update.ahead import (
    AheadPass,
    ForwardNoisePolicy,
    NondeterministicForwardError,
    PairingError,
)
from lightning_grpo.update.plan import ChunkPlan, batch_needs

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier

LENS = [3, 9, 1, 6, 12, 2, 5, 8, 4, 10, 7, 11, 6, 2, 9, 3]  # 16 unequal completions


def make(policy_dir, batch=16, mini=4, micro=2, lr=1e-2, **rl):
    cfg = GRPOConfig(batch_per_replica=batch, group_size=2, mini_batch_per_replica=mini,
                     micro_batch_per_replica=micro, **rl)
    module = GRPOModule(policy=PolicyConfig(path=str(policy_dir)), rl=cfg)
    module.configure_model()  # no Trainer: build the policy ourselves
    module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=lr))
    return module


def count_scores(module) -> list[bool]:
    """Record the model's mode at every ahead-pass score call (True = train mode: the probe)."""
    calls, real = [], module.updater.ahead.score

    def score(chunk):
        calls.append(module.policy.training)
        return real(chunk)

    module.updater.ahead.score = score
    return calls


def per_step(result) -> list[list]:
    """Chunk stats of each optimizer step (none skipped here: every window's n_micro chunks stepped)."""
    n_micro = len(result.chunks) // len(result.steps)
    return [result.chunks[i:i + n_micro] for i in range(0, len(result.chunks), n_micro)]


def window_stats(window) -> tuple[float, float, float]:
    """Token-weighted clip fraction, ratio mean, and the max ratio of one optimizer step's chunks."""
    tokens = sum(float(c.tokens) for c in window)
    clip = sum(float(c.clip_frac * c.tokens) for c in window) / tokens
    ratio = sum(float(c.ratio_mean * c.tokens) for c in window) / tokens
    return clip, ratio, max(float(c.ratio_max) for c in window)


@pytest.fixture(scope="module")
def dropout_policy_dir(tmp_path_factory):
    # Attention dropout 0.3: at 0.1 the probe's 12 tokens all moved by < 0.05 nats on some seeds (padded or packed)
    return build_tiny_policy(tmp_path_factory.mktemp("dropout-policy"), replace(SMALL, dropout=0.3))


# -- the clip binds only with frozen pi_old -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("skip_first_mini", [True, False], ids=["skip-mini0", "full-walk"])
def test_frozen_pi_old_first_mini_ratio_is_one_and_later_minis_clip(tiny_policy_dir, skip_first_mini):
    module = make(tiny_policy_dir)  # n_mini=4 x n_micro=2
    module.updater.ahead.skip_first_mini = skip_first_mini
    for seed in (0, 1):  # the probe's loop step and a later one
        with module.timer.phase(UPDATE):  # as training_step times it
            result = module.updater.update(synthetic_batch(LENS, seed=seed))
        assert len(result.steps) == 4 and not any(s.skipped for s in result.steps)
        windows = per_step(result)
        first = [(float(c.ratio_mean), float(c.ratio_max), float(c.clip_frac)) for c in windows[0]]
        assert first == [(1.0, 1.0, 0.0)] * 2  # trained before any update: exactly exp(0)
        later = [window_stats(w) for w in windows[1:]]
        assert all(ratio != 1.0 for _, ratio, _ in later)
        assert any(clip > 0 for clip, _, _ in later), later
    assert 0 < module.timer.seconds(AHEAD) < module.timer.seconds(UPDATE)  # the updater times it on the module's


@pytest.mark.slow
def test_without_frozen_pi_old_the_clip_never_binds(tiny_policy_dir):
    module = make(tiny_policy_dir, freeze_pi_old=False)
    calls = count_scores(module)
    for seed in (0, 1):
        result = module.updater.update(synthetic_batch(LENS, seed=seed))
        for window in per_step(result):
            assert window_stats(window) == (0.0, 1.0, 1.0)  # pi_old = current: ratio returns to 1 every mini-batch
    assert calls == [] and module.timer.seconds(AHEAD) == 0.0


# -- call-order keying ----------------------------------------------------------------------------------------------
def shuffled_batch():
    """Unequal lengths with sample ids in a scrambled order (no id matches its row)."""
    batch = synthetic_batch(LENS, seed=3)
    return replace(batch, sample_ids=torch.randperm(len(LENS), generator=torch.Generator().manual_seed(9)) + 100)


def record_walks(module):
    """(ahead walk, training walk): sample ids and width of every chunk each pass scored."""
    ahead, train = [], []
    score, forward = module.updater.ahead.score, module.updater.loop.forward_chunk

    def ahead_score(chunk):
        if not module.policy.training:  # the probe's re-score is not part of the walk
            ahead.append((tuple(chunk.sample_ids.tolist()), chunk.input_ids.shape[1]))
        return score(chunk)

    def train_forward(chunk, old):
        train.append((tuple(chunk.sample_ids.tolist()), chunk.input_ids.shape[1]))
        return forward(chunk, old)

    module.updater.ahead.score, module.updater.loop.forward_chunk = ahead_score, train_forward
    return ahead, train


@pytest.mark.slow
def test_ahead_and_training_walks_visit_identical_chunks(tiny_policy_dir):
    module = make(tiny_policy_dir)
    module.updater.ahead.skip_first_mini = False
    ahead, train = record_walks(module)
    module.updater.update(shuffled_batch())
    assert ahead == train and len(train) == 8
    assert len({width for _, width in train}) > 1  # chunks are trimmed to unequal widths

    module.updater.ahead.skip_first_mini = True  # the probe passed: mini-batch 0 leaves the walk
    ahead.clear(), train.clear()
    module.updater.update(shuffled_batch())
    assert ahead == train[2:]


@pytest.mark.slow
def test_non_contiguous_plan_pairs_by_call_order(tiny_policy_dir):
    module = make(tiny_policy_dir)
    module.updater.ahead.skip_first_mini = False
    ahead, train = record_walks(module)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(4)).tolist()
    plan = ChunkPlan(tuple(tuple(tuple(order[(mi * 2 + mc) * 2:(mi * 2 + mc) * 2 + 2]) for mc in range(2))
                           for mi in range(4)))
    batch = shuffled_batch()
    pi_old = module.updater.ahead.compute(batch, plan, module.updater.needs)
    module.updater.loop.run(batch, plan, pi_old)
    assert ahead == train and len(train) == 8


@pytest.mark.slow
def test_a_record_that_does_not_fit_its_chunk_is_refused(tiny_policy_dir):
    module = make(tiny_policy_dir)
    batch = synthetic_batch(LENS)
    plan = ChunkPlan.fixed(16, 4, 2)
    pi_old = module.updater.ahead.compute(batch, plan, module.updater.needs)
    with pytest.raises(PairingError, match="chunk 3 of the training walk"):
        module.updater.loop.run(batch, plan, pi_old[:3] + [pi_old[4]] + pi_old[4:])  # chunk 3 gets chunk 4's record
    with pytest.raises(ValueError, match="pi_old has 7 entries for a plan of 8 chunks"):
        module.updater.loop.run(batch, plan, pi_old[:7])


# -- the one-shot determinism probe --------------------------------------------------------------------------------
@pytest.mark.slow
def test_probe_catches_dropout_left_on(dropout_policy_dir):
    torch.manual_seed(0)
    module = make(dropout_policy_dir)
    before = params_of(module.policy)
    with pytest.raises(NondeterministicForwardError) as err:
        module.updater.update(synthetic_batch(LENS))
    msg = str(err.value)
    assert "of completion tokens moved by more than 0.05 nats" in msg and "any token" in msg
    assert "dropout left on" in msg and "MoE routing" in msg and "ForwardNoisePolicy" in msg
    assert all(torch.equal(before[k], v) for k, v in params_of(module.policy).items())  # nothing trained
    assert module.policy.training  # the mode it had before the ahead pass


@pytest.mark.slow
def test_probe_accepts_the_noise_a_policy_declares(dropout_policy_dir):
    torch.manual_seed(0)
    module = make(dropout_policy_dir)
    module.policy.forward_noise_policy = ForwardNoisePolicy(bound_nats=5.0)
    module.updater.update(synthetic_batch(LENS))
    assert module.updater.ahead.probe_passed


@pytest.mark.slow
def test_probe_passes_a_deterministic_policy_and_runs_once(tiny_policy_dir):
    module = make(tiny_policy_dir)
    calls = count_scores(module)
    for seed in range(3):
        module.updater.update(synthetic_batch(LENS, seed=seed))
    assert calls.count(True) == 1  # one train-mode re-score in the whole run
    # Step 1 probed chunk (0, 0) then left mini-batch 0; later steps score only minis 1..3 (6 chunks).
    assert len(calls) == 1 + 1 + 6 + 6 + 6
    assert module.updater.ahead.probe_passed and module.policy.training  # its mode before the ahead pass


@pytest.mark.slow
def test_probe_state_survives_resume(tiny_policy_dir):
    module = make(tiny_policy_dir)
    module.updater.update(synthetic_batch(LENS))
    state = module.updater.ahead.state_dict()
    resumed = make(tiny_policy_dir)
    resumed.updater.ahead.load_state_dict(state)
    calls = count_scores(resumed)
    resumed.updater.update(synthetic_batch(LENS, seed=1))
    assert True not in calls and len(calls) == 6  # no second probe, and mini-batch 0 skipped from the start
    assert AheadPass(module.policy, module.updater.ahead.score).state_dict() == {"probe": None}


def test_noise_policy_is_validated():
    with pytest.raises(ValueError, match="bound_nats=0"):
        ForwardNoisePolicy(bound_nats=0)
    with pytest.raises(ValueError, match="max_fraction=1.0"):
        ForwardNoisePolicy(max_fraction=1.0)


# -- the gates ------------------------------------------------------------------------------------------------------
class _NoRatio:
    def needs_old_logprobs(self) -> bool:
        return False


class _Ratio:
    def needs_old_logprobs(self) -> bool:
        return True


@pytest.mark.parametrize("rl,objective,expected", [
    ({"mini_batch_per_replica": 4}, _Ratio(), True),
    ({"mini_batch_per_replica": 0}, _Ratio(), False),  # n_mini == 1: pi_old == current, exactly
    ({"mini_batch_per_replica": 4, "rollout_correction": {"mode": "bypass"}}, _Ratio(), False),  # sampler pi_old
    ({"mini_batch_per_replica": 4}, _NoRatio(), False),  # e.g. distillation: no ratio to clip
    ({"mini_batch_per_replica": 4, "freeze_pi_old": False}, _Ratio(), False),  # the diagnostic switch
    ({"mini_batch_per_replica": 0, "mu_iterations": 2}, _Ratio(), True),  # inner epochs: several steps per batch
    ({"mini_batch_per_replica": 0, "mu_iterations": 2, "rollout_correction": {"mode": "bypass"}}, _Ratio(), False),
])
def test_ahead_pass_gate(rl, objective, expected):
    assert batch_needs(GRPOConfig(batch_per_replica=16, group_size=2, **rl), objective).pi_old is expected


def test_freeze_pi_old_must_be_a_bool():
    with pytest.raises(ConfigError, match="freeze_pi_old='yes': must be true or false"):
        GRPOConfig(freeze_pi_old="yes")


@pytest.mark.slow
def test_n_mini_1_runs_no_ahead_pass_and_stays_byte_identical(tiny_policy_dir):
    module = make(tiny_policy_dir, mini=0, micro=4)  # n_mini=1, n_micro=4
    reference = clone(module)
    reference.updater.attach(torch.optim.AdamW(reference.policy.parameters(), lr=1e-2))
    calls = count_scores(module)
    batch = synthetic_batch(LENS)
    module.updater.update(batch)
    reference.updater.loop.run(batch, ChunkPlan.fixed(16, 1, 4))  # the path before the ahead pass existed
    assert calls == [] and module.timer.seconds(AHEAD) == 0.0
    a, b = params_of(module.policy), params_of(reference.policy)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rollout_logprobs_path_runs_no_ahead_pass(tiny_policy_dir):
    module = make(tiny_policy_dir, rollout_correction={"mode": "bypass"})
    calls = count_scores(module)
    result = module.updater.update(synthetic_batch(LENS, with_logprobs=True))
    assert calls == [] and len(result.steps) == 4


def test_report_logs_ahead_time_and_share(tiny_policy_dir):
    module = make(tiny_policy_dir)
    with module.timer.phase(UPDATE):
        result = module.updater.update(synthetic_batch(LENS))
    ahead = module.timer.seconds(AHEAD)
    module.report(result, {})
    m = module.last_metrics
    assert m["time/ahead"] == ahead > 0
    assert 0 < m["time/ahead_share"] < 1 and m["grpo/clip_frac"] > 0
    assert module.timer.seconds(AHEAD) == 0.0  # the row took this step's times; the next step starts from 0


# -- regression run on the built-in task ----------------------------------------------------------------------------
def arith_run(freeze: bool, steps: int = 30) -> tuple[float, float, list[float], list[float]]:
    """The quickstart's shipped policy and task, then GRPO at n_mini=8:
    (greedy val accuracy before, after, sampled reward per loop step, clip_frac per loop step)."""
    from lightning_grpo.config import RolloutConfig
    from lightning_grpo.data.prompts import PromptStream
    from lightning_grpo.data.rewards import RewardSpec
    from lightning_grpo.data.tasks import TASKS
    from lightning_grpo.metrics import roll_up
    from lightning_grpo.rollout.hf import HFEngine
    from lightning_grpo.tiny.warm import greedy_accuracy

    torch.manual_seed(0)
    rl = GRPOConfig(batch_per_replica=64, group_size=8, mini_batch_per_replica=8, freeze_pi_old=freeze)
    # The quickstart's policy (shipped, warm-started on arith_small as the config does): a 400-step warm start of a
    # fresh policy on arith (greedy 0.26) learned on one machine and fell to 0.05-0.10 on others within 30 steps.
    policy = PolicyConfig(path="tiny:quickstart", warm_start="arith_small", warm_start_steps=30)
    module = GRPOModule(policy=policy, rl=rl, rollout=RolloutConfig(max_new_tokens=4), rewards=[RewardSpec("arith")])
    module.configure_model()
    task = TASKS["arith_small"]()
    val = task.items(64, 1, "val")
    before = greedy_accuracy(module.policy, module.tokenizer, val, max_new_tokens=4)
    module.policy.train()  # as under a Trainer
    module.engine = HFEngine(module.policy, module.tokenizer)
    module.collector = module.configure_collector()
    module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=3e-4))
    stream = PromptStream(task.items(400, 0, "train"), seed=0)
    rewards, clip = [], []
    for step in range(steps):
        batch, _ = module.collect(stream.step(step, rl.prompts_per_batch))
        rewards.append(float(batch.rewards.mean()))
        clip.append(roll_up(module.updater.update(batch))["grpo/clip_frac"])
    return before, greedy_accuracy(module.policy, module.tokenizer, val, max_new_tokens=4), rewards, clip


@pytest.mark.slow
def test_regression_n_mini_8_on_arith_learns_with_frozen_pi_old_and_never_clips_without():
    pytest.importorskip("lightning_grpo.rollout.hf")
    pytest.importorskip("lightning_grpo.data.prompts")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same numbers on every run here, and no fight over 2 shared cores
    try:
        before, after, rewards, clip = arith_run(freeze=True)
        _, _, _, clip_unfrozen = arith_run(freeze=False)
    finally:
        torch.set_num_threads(threads)
    assert after >= before > 0, (before, after)  # greedy held-out accuracy (measured: 0.28 -> 0.28-0.48 over 4 seeds)
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first, rewards  # 640 sampled rows per window: the reward rises (measured 0.22 -> 0.27 at worst)
    assert sum(c > 0 for c in clip) >= 5, clip  # the trust region is active
    assert clip_unfrozen == [0.0] * len(clip_unfrozen)  # pi_old follows the policy: the clip never binds


# -- token budgets: one cached plan, the ahead pass's own bigger chunks ------------------------------------------------
def budget_make(policy_dir, budget=40, ahead=0, mu=1):
    return make(policy_dir, micro=0, max_tokens_per_micro=budget, max_tokens_per_ahead_micro=ahead, mu_iterations=mu)


@pytest.mark.slow
def test_ahead_pass_with_its_own_budget_records_what_the_training_chunks_would(tiny_policy_dir):
    """Bigger no-grad chunks (default 2x the budget), laid out per row as the training chunks: the same pi_old."""
    module = budget_make(tiny_policy_dir, mu=2)  # mu = 2: every chunk is recorded
    assert module.rl.ahead_budget == 80
    batch = synthetic_batch(LENS, seed=5)
    plan, ahead = module.updater.plan(batch)
    assert ahead is not None and ahead.n_chunks(0) < plan.real_chunks  # fewer, bigger forwards
    widths = count_scores(module)
    by_rows = module.updater.ahead.compute(batch, plan, module.updater.needs, ahead)
    assert len(widths) == ahead.n_chunks(0) + 1  # + the probe's train-mode re-score, once
    walked = module.updater.ahead.compute(batch, plan, module.updater.needs)  # the training chunks themselves
    assert len(by_rows) == len(walked) == 2 * plan.real_chunks
    for (_, mini, micro), a, b in zip(plan.training_walk(), by_rows, walked):
        mask = plan.chunk(batch, mini, micro).completion_mask[:, 1:]
        assert a.shape == b.shape
        torch.testing.assert_close(a[mask], b[mask], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_training_walk_on_a_shuffled_plan_is_caught_by_the_shape_check(tiny_policy_dir):
    module = budget_make(tiny_policy_dir, budget=40)
    module.updater.ahead.skip_first_mini = False
    batch = synthetic_batch(LENS, seed=5)
    plan, ahead = module.updater.plan(batch)
    pi_old = module.updater.ahead.compute(batch, plan, module.updater.needs, ahead)
    assert plan.n_chunks(1) > 1
    shuffled = ChunkPlan(tuple(chunks[::-1] for chunks in plan.rows))  # same chunks, another call order
    with pytest.raises(PairingError, match="both walks must use the same ChunkPlan"):
        module.updater.loop.run(batch, shuffled, pi_old)


@pytest.mark.slow
def test_update_computes_one_plan_per_collected_batch_for_both_walks(tiny_policy_dir):
    module = budget_make(tiny_policy_dir, budget=40, mu=2)
    ahead, train = record_walks(module)
    plans, real_plan = [], module.updater.plan
    module.updater.plan = lambda batch, needs=None: plans.append(real_plan(batch, needs)) or plans[-1]
    module.updater.update(synthetic_batch(LENS, seed=6))
    assert len(plans) == 1 and module.updater.last_plan is plans[0][0]
    assert module.updater.last_plan.real_chunks > module.rl.n_mini  # data-dependent chunking really happened
    rows = lambda walk: sorted(i for ids, _ in walk for i in ids)
    assert rows(ahead) == rows(train)[::2] == list(range(16))  # each row scored once, trained twice (mu=2)
