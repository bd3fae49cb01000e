"""DPO: the loss against hand-computed values, exact accumulation (the divisor counts pairs), one reference pass per
batch, and the module's config rules."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import max_rel_delta, params_of

from lightning_grpo.config import ConfigError
from lightning_grpo.data.preferences import PreferencePair, builtin_pairs
from lightning_grpo.dpo import DPOConfig, DPOModule
from lightning_grpo.metrics import roll_up
from lightning_grpo.objectives.dpo import DPOObjective
from lightning_grpo.policy import PolicyConfig

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier


def unequal_pairs(n: int = 8) -> list[PreferencePair]:
    """Pairs whose answers differ in length from pair to pair and between chosen and rejected."""
    base = builtin_pairs("arith_small", "train", n, seed=3)
    return [PreferencePair(p.id, p.prompt, p.chosen * (1 + i % 3), p.rejected + "0" * (i % 4)) for i, p in
            enumerate(base)]


def dpo_module(policy_dir, dtype="float64", grad_accum=1, lr=0.5, **dpo):
    module = DPOModule(PolicyConfig(path=str(policy_dir), dtype=dtype),
                       DPOConfig(batch_size=8, grad_accum=grad_accum, max_grad_norm=0.0, **dpo))
    module.configure_model()  # no Trainer: build the policy ourselves
    module.updater.attach(torch.optim.SGD(module.policy.parameters(), lr=lr))
    return module


# -- the loss ------------------------------------------------------------------------------------------------------
def test_sigmoid_loss_and_implicit_rewards_by_hand():
    chosen = torch.tensor([-2.0, -5.0], requires_grad=True)
    rejected = torch.tensor([-3.0, -4.0], requires_grad=True)
    ref_c, ref_r = torch.tensor([-2.5, -5.0]), torch.tensor([-2.5, -4.5])
    loss, denom, stats = DPOObjective(beta=0.5)(chosen, rejected, ref_c, ref_r)
    h = [(-2.0 + 2.5) - (-3.0 + 2.5), (-5.0 + 5.0) - (-4.0 + 4.5)]  # [1.0, -0.5]
    expected = sum(-math.log(1 / (1 + math.exp(-0.5 * x))) for x in h) / 2
    assert float(denom) == 2 and float(loss.detach()) == pytest.approx(expected)
    assert float(stats.accuracy) == 0.5 and float(stats.margin) == pytest.approx(0.5 * sum(h) / 2)
    assert float(stats.chosen_reward) == pytest.approx(0.5 * (0.5 + 0.0) / 2)
    loss.backward()
    sig = [1 / (1 + math.exp(0.5 * x)) for x in h]  # d(-log sigmoid(b h))/dh = -b sigmoid(-b h)
    assert torch.allclose(chosen.grad, torch.tensor([-0.5 * s / 2 for s in sig]))
    assert torch.allclose(rejected.grad, -chosen.grad)


def test_ipo_and_label_smoothing_by_hand():
    c, r, zero = torch.tensor([-1.0]), torch.tensor([-3.0]), torch.zeros(1)
    loss, _, _ = DPOObjective(beta=0.25, loss_type="ipo")(c, r, zero, zero)
    assert float(loss) == pytest.approx((2.0 - 1 / 0.5) ** 2)
    loss, _, _ = DPOObjective(beta=0.5, label_smoothing=0.1)(c, r, zero, zero)
    assert float(loss) == pytest.approx(-0.9 * float(F.logsigmoid(torch.tensor(1.0)))
                                        - 0.1 * float(F.logsigmoid(torch.tensor(-1.0))))


def test_empty_chunk_and_dp_mean_divisor():
    empty = torch.zeros(0, requires_grad=True)
    loss, denom, _ = DPOObjective()(empty, empty, empty.detach(), empty.detach())
    assert float(denom) == 0 and float(loss) == 0
    seen = []
    obj = DPOObjective(dp_mean=lambda t: (seen.append(float(t)), t * 0 + 3.0)[1])
    loss, denom, _ = obj(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2))
    assert seen == [2.0] and float(denom) == 3.0 and float(loss) == pytest.approx(2 * math.log(2) / 3)
    assert not obj.needs_old_logprobs()


# -- exact accumulation ----------------------------------------------------------------------------------------------
VARIANTS = [{}, {"loss_type": "ipo", "length_normalize": True}, {"reference_free": True},
            {"label_smoothing": 0.2, "length_normalize": True}]


@pytest.mark.parametrize("variant", VARIANTS, ids=["sigmoid", "ipo-normalized", "reference-free", "smoothed"])
@pytest.mark.parametrize("grad_accum", [2, 4, 8])
def test_accumulated_step_equals_the_whole_batch_on_unequal_lengths(tiny_policy_dir, grad_accum, variant):
    pairs = unequal_pairs()
    whole, chunked = dpo_module(tiny_policy_dir, **variant), dpo_module(tiny_policy_dir, grad_accum=grad_accum,
                                                                        **variant)
    before = params_of(whole.policy)
    expected = roll_up(whole.update(whole.encode(pairs)), "dpo")
    got = roll_up(chunked.update(chunked.encode(pairs)), "dpo")
    assert max_rel_delta(before, params_of(whole.policy), params_of(chunked.policy)) <= 5e-8
    for name in ("dpo/loss", "dpo/margin", "dpo/chosen_logp", "dpo/pairs", "dpo/denom"):
        assert got[name] == pytest.approx(expected[name], rel=1e-12, abs=1e-15), name
    assert got["dpo/optimizer_steps"] == 1.0


def test_the_reference_is_scored_once_per_batch_before_training(tiny_policy_dir):
    module = dpo_module(tiny_policy_dir, grad_accum=4)
    calls, real = [], module.answer_logprobs

    def answer_logprobs(model, chunk):
        calls.append(("ref" if model is module.ref else "policy", torch.is_grad_enabled(), len(chunk)))
        return real(model, chunk)

    module.answer_logprobs = answer_logprobs
    module.update(module.encode(unequal_pairs()))
    assert calls == [("ref", False, 2)] * 4 + [("policy", True, 2)] * 4


def test_reference_free_builds_no_reference(tiny_policy_dir):
    module = dpo_module(tiny_policy_dir, reference_free=True)
    assert module.ref is None
    batch = module.with_reference(module.encode(unequal_pairs()))
    assert batch.ref_chosen is None


def test_a_non_finite_chunk_skips_the_step(tiny_policy_dir):
    module = dpo_module(tiny_policy_dir, grad_accum=4)
    before, real = params_of(module.policy), module.forward_chunk
    calls = []

    def forward_chunk(chunk, old):
        loss, denom, stats = real(chunk, old)
        calls.append(1)
        return (loss * math.nan if len(calls) == 2 else loss), denom, stats

    module.updater.loop.forward_chunk = forward_chunk
    result = module.update(module.encode(unequal_pairs()))
    assert [s.skipped for s in result.steps] == [True] and result.discarded_chunks == 3 and len(calls) == 2
    assert all(torch.equal(before[k], v) for k, v in params_of(module.policy).items())


def test_batch_of_the_wrong_size_is_refused(tiny_policy_dir):
    module = dpo_module(tiny_policy_dir)
    with pytest.raises(ValueError, match="has 4 pairs on this rank but dpo.batch_size / DP size is 8"):
        module.update(module.encode(unequal_pairs(4)))


# -- config --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"batch_size": 0}, "batch_size=0"),
    ({"grad_accum": 0}, "grad_accum=0"),
    ({"batch_size": 10, "grad_accum": 4}, "grad_accum=4 must divide batch_size=10"),
    ({"beta": 0.0}, "beta=0.0"),
    ({"loss_type": "hinge"}, "loss_type='hinge'"),
    ({"label_smoothing": 0.5}, r"label_smoothing=0.5: must be in \[0, 0.5\)"),
    ({"label_smoothing": 0.1, "loss_type": "ipo"}, "applies to loss_type='sigmoid' only"),
    ({"max_grad_norm": -1.0}, "max_grad_norm=-1.0"),
    ({"max_length": 1}, "max_length=1"),
])
def test_dpo_config_rules(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DPOConfig(**kwargs)


def test_per_rank_rule_names_the_dp_size():
    with pytest.raises(ConfigError, match="6 pairs per train call must split evenly over DP size 4"):
        DPOConfig(batch_size=12, grad_accum=2).validate(4)
    assert DPOConfig(batch_size=16, grad_accum=4).pairs_per_rank(2) == 8


def test_grad_accum_is_the_trainer_side_count_not_the_retired_grpo_knob():
    """DPO keeps grad_accum (train calls per optimizer step); GRPO still refuses rl.grad_accum."""
    from lightning_grpo.config import GRPOConfig

    assert DPOConfig(batch_size=32, grad_accum=32).grad_accum == 32
    with pytest.raises(ConfigError, match="rl.grad_accum is retired for GRPO"):
        GRPOConfig(grad_accum=4)
