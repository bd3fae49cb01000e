"""Deferred normalization: chunking is exact, clip order matters, empty windows stay finite."""

import pytest
import torch
from helpers import max_rel_delta, params_of, synthetic_batch

from lightning_grpo.config import GRPOConfig, RolloutConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.update.plan import ChunkPlan

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier

UNEQUAL = [1, 12, 3, 20, 2, 7, 15, 4]  # completion lengths: chunk token counts differ a lot


def make_module(policy_dir, dtype="float32", micro=0, max_grad_norm=0.0):
    rl = GRPOConfig(batch_per_replica=8, group_size=2, micro_batch_per_replica=micro, max_grad_norm=max_grad_norm)
    module = GRPOModule(policy=PolicyConfig(path=str(policy_dir), dtype=dtype), rl=rl, rollout=RolloutConfig())
    module.configure_model()  # no Trainer: build the policy ourselves
    return module


def sgd_update(module, batch, lr=0.1):
    """One loop step with plain SGD: the parameter update is exactly lr x gradient."""
    module.updater.attach(torch.optim.SGD(module.policy.parameters(), lr=lr))
    return module.updater.update(batch)


# Each test marked slow here has its toy-model twin of the same name in tests/update/test_accumulate_unit.py (the unit
# tier, float64 to 1e-12); the float32 chunking, the config refusal and the window rule stay in the fast tier.
@pytest.mark.parametrize("dtype,tol", [pytest.param("float64", 5e-8, marks=pytest.mark.slow), ("float32", 1e-5)])
@pytest.mark.parametrize("n_micro", [2, 4, 8])
def test_chunked_step_equals_unchunked_on_unequal_lengths(tiny_policy_dir, dtype, tol, n_micro):
    batch = synthetic_batch(UNEQUAL, seed=1)
    whole = make_module(tiny_policy_dir, dtype)
    chunked = make_module(tiny_policy_dir, dtype, micro=8 // n_micro)
    before = params_of(whole.policy)
    sgd_update(whole, batch)
    result = sgd_update(chunked, batch)
    assert len(result.steps) == 1 and not result.steps[0].skipped
    assert max_rel_delta(before, params_of(whole.policy), params_of(chunked.policy)) <= tol


@pytest.mark.slow
@pytest.mark.parametrize("n_micro", [2, 4, 8])
def test_naive_mean_of_chunk_means_fails_the_same_tolerance(tiny_policy_dir, n_micro):
    """The gate can tell: averaging per-chunk token means is a different (wrong) update."""
    batch = synthetic_batch(UNEQUAL, seed=1)
    whole, naive = make_module(tiny_policy_dir, "float64"), make_module(tiny_policy_dir, "float64")
    before = params_of(whole.policy)
    sgd_update(whole, batch)
    opt = torch.optim.SGD(naive.policy.parameters(), lr=0.1)
    plan = ChunkPlan.fixed(len(batch), 1, n_micro)
    for mini, micro in plan.walk():
        loss, _, _ = naive.forward_chunk(plan.chunk(batch, mini, micro), None)
        (loss / n_micro).backward()
    opt.step()
    assert max_rel_delta(before, params_of(whole.policy), params_of(naive.policy)) > 1e-3


@pytest.mark.slow
def test_equal_lengths_make_mean_of_means_agree(tiny_policy_dir):
    """Sanity check of the test above: with equal chunk token counts both reductions coincide."""
    batch = synthetic_batch([6] * 8, seed=2)
    whole, naive = make_module(tiny_policy_dir, "float64"), make_module(tiny_policy_dir, "float64")
    before = params_of(whole.policy)
    sgd_update(whole, batch)
    opt = torch.optim.SGD(naive.policy.parameters(), lr=0.1)
    plan = ChunkPlan.fixed(8, 1, 4)
    for mini, micro in plan.walk():
        (naive.forward_chunk(plan.chunk(batch, mini, micro), None)[0] / 4).backward()
    opt.step()
    assert max_rel_delta(before, params_of(whole.policy), params_of(naive.policy)) <= 5e-8


@pytest.mark.slow
def test_scale_then_clip_matches_unchunked_and_clip_then_scale_does_not(tiny_policy_dir):
    batch = synthetic_batch(UNEQUAL, seed=3)
    clip = 1e-3  # far below the natural gradient norm, so clipping binds
    whole = make_module(tiny_policy_dir, "float64", max_grad_norm=clip)
    chunked = make_module(tiny_policy_dir, "float64", micro=2, max_grad_norm=clip)
    before = params_of(whole.policy)
    norm = sgd_update(whole, batch).steps[0].grad_norm
    assert norm > 10 * clip
    sgd_update(chunked, batch)
    assert max_rel_delta(before, params_of(whole.policy), params_of(chunked.policy)) <= 5e-8

    # clip-then-scale: clip the un-normalized accumulated sum, then divide by the divisor.
    wrong = make_module(tiny_policy_dir, "float64")
    opt = torch.optim.SGD(wrong.policy.parameters(), lr=0.1)
    plan, total = ChunkPlan.fixed(8, 1, 4), 0.0
    for mini, micro in plan.walk():
        loss, denom, _ = wrong.forward_chunk(plan.chunk(batch, mini, micro), None)
        (loss * denom).backward()
        total += float(denom)
    torch.nn.utils.clip_grad_norm_(wrong.policy.parameters(), clip)
    for p in wrong.policy.parameters():
        p.grad.mul_(1 / total)
    opt.step()
    assert max_rel_delta(before, params_of(whole.policy), params_of(wrong.policy)) > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("micro", [0, 2])
def test_all_empty_batch_gives_zero_gradient_no_nan_no_skip(tiny_policy_dir, micro):
    batch = synthetic_batch([0] * 8, seed=4)
    module = make_module(tiny_policy_dir, micro=micro)
    module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=1e-2, weight_decay=0.0))
    before = params_of(module.policy)
    result = module.updater.update(batch)
    assert [s.skipped for s in result.steps] == [False]
    assert result.steps[0].grad_norm == 0.0
    assert all(torch.equal(before[k], v) for k, v in params_of(module.policy).items())
    assert module.updater.loop.accumulator.skipped_steps == 0


def test_batch_size_disagreeing_with_config_is_refused_before_backward(tiny_policy_dir):
    module = make_module(tiny_policy_dir)
    module.updater.attach(torch.optim.SGD(module.policy.parameters(), lr=0.1))
    before = params_of(module.policy)
    with pytest.raises(ValueError, match="collected batch has 6 trajectories .* expects 8"):
        module.updater.update(synthetic_batch([3] * 6))
    assert all(p.grad is None for p in module.policy.parameters())
    assert all(torch.equal(before[k], v) for k, v in params_of(module.policy).items())


@pytest.mark.slow
@pytest.mark.parametrize("n_micro", [1, 4])
def test_fractional_dp_divisor_below_one_gives_the_exact_token_mean(tiny_policy_dir, n_micro):
    """A DP-mean divisor in (0, 1) (here: 8 ranks' mean of a few tokens) is divided by as is, only 0 is guarded.

    The reference is the token mean written out: grad of sum(per-token loss) / (tokens / 8), in float64.
    """
    from lightning_grpo.objectives.grpo import GRPOObjective

    batch = synthetic_batch([1, 0, 2, 0, 0, 1, 0, 0], seed=5)  # 4 tokens: the divisor is 0.5, its chunks' 0..0.25
    module = make_module(tiny_policy_dir, "float64", micro=8 // n_micro)
    module.objective = GRPOObjective(dp_mean=lambda t: t / 8)  # as if 7 more ranks held no tokens
    before = params_of(module.policy)
    result = sgd_update(module, batch)
    assert not result.steps[0].skipped and float(result.chunks[0].denom) < 1

    ref = make_module(tiny_policy_dir, "float64")
    logprobs = ref.scorer.logprobs(ref.policy, batch)
    mask = batch.completion_mask[:, 1:]
    per_token = -(torch.exp(logprobs - logprobs.detach()) * batch.advantages.double().unsqueeze(-1))
    (per_token[mask].sum() / (mask.sum() / 8)).backward()
    torch.optim.SGD(ref.policy.parameters(), lr=0.1).step()
    assert max_rel_delta(before, params_of(ref.policy), params_of(module.policy)) <= 5e-8


def test_window_length_changes_only_between_windows():
    """A token-budgeted plan tells the accumulator each window's chunk count; never inside a window."""
    from lightning_grpo.update.accumulate import DeferredAccumulator

    w = torch.nn.Parameter(torch.ones(3))
    acc = DeferredAccumulator([w], torch.optim.SGD([w], lr=0.1), grad_accum=1)
    acc.open_window(3)
    assert acc.train((w * 2).sum(), torch.tensor(3.0)) is None and acc.closes_window is False
    with pytest.raises(RuntimeError, match="windows change length only at a boundary"):
        acc.open_window(2)
    acc.train(w.sum() * float("nan"), torch.tensor(3.0))  # poisons: 1 call of this window left to discard
    with pytest.raises(RuntimeError, match="1 to discard"):
        acc.open_window(2)
    assert acc.discard().skipped and not acc.discarding()
    acc.open_window(2)
    assert acc.state_dict()["window"] == 2
    with pytest.raises(ValueError, match="at least one call"):
        acc.open_window(0)
