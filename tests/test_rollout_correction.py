"""rl.rollout_correction: each mode against an independent float64 implementation, exactness under every split for
every allowed loss x ratio x correction combination, the metrics, and the refusals."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import max_rel_delta, params_of, synthetic_batch, with_sampler_logprobs
from test_loss_family import COMBOS, aggregate, bare
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_grpo.config import ConfigError, GRPOConfig, RolloutConfig, VLLMConfig
from lightning_grpo.correction import RolloutCorrection, derived_metrics
from lightning_grpo.distributed import single_process
from lightning_grpo.metrics import roll_up
from lightning_grpo.objectives import ObjectiveParts, build_objective
from lightning_grpo.objectives.chunk_stats import CorrectedChunkStats
from lightning_grpo.objectives.grpo import GRPOObjective
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.rank_metrics import combine_ranks
from lightning_grpo.rollout.replay import ReplayEngine
from lightning_grpo.run_check import check_run
from lightning_grpo.update import Needs, Split

pytestmark = pytest.mark.heavy  # 172 tiny-policy updates: ~120 s (the formulas: tests/objectives, unit tier): CI and `make test-integration`

EPS, EPS_HIGH, MAX_LEN = 0.2, 0.28, 6
MODES = [("tis", "token"), ("tis", "sequence"), ("mask", "token"), ("mask", "sequence"), ("mask", "geometric"),
         ("icepop", "token"), ("icepop", "sequence"), ("bypass", "token")]
"""Every allowed (mode, level) pair (test_refusals has the others)."""


def band_of(mode: str, level: str) -> tuple[float, float] | None:
    """mask: tighter than the default so the test tensors reject some rows (geometric: verl's tight kind of band)."""
    return None if mode != "mask" else (0.9, 1.1) if level == "geometric" else (0.6, 1.5)


def cfg(mode: str, level: str = "token") -> RolloutCorrection:
    threshold = 1.3 if mode == "tis" else None  # only tis reads it (refused with another mode)
    return RolloutCorrection(mode=mode, level=level, threshold=threshold, band=band_of(mode, level))


def reference_loss(lp, old, roll, mask, adv, mode, level, loss_type="dapo", threshold=1.3):
    """The corrected step loss written per sequence (float64 loops) from the papers' and verl's formulas.

    rho = pi_old / pi_rollout per token (verl rollout_corr_math, "decoupled"); sequence: prod_t rho_t; geometric:
    exp(mean_t log rho_t). tis (Yao et al. 2025): surrogate x min(rho, C). mask (verl rollout_rs): tokens whose rho
    leaves [low, high] leave the loss and the divisor. icepop (Ling team 2025, eq. of IcePop): surrogate x rho inside
    [0.5, 5], 0 outside, divisor unchanged. bypass (verl bypass_mode): pi_old := pi_rollout, no weight.
    Surrogate -min(r A, clip(r, 1-eps, 1+eps_high) A) with r = pi / pi_old per token. Aggregation as TRL loss_type.
    """
    per_seq = []
    for i in range(lp.shape[0]):
        keep = mask[i]
        lp_i, old_i, roll_i = lp[i][keep], old[i][keep], roll[i][keep]
        if mode == "bypass":
            old_i = roll_i
        r = torch.exp(lp_i - old_i)
        sur = -torch.minimum(r * adv[i], torch.clamp(r, 1 - EPS, 1 + EPS_HIGH) * adv[i])
        log_rho = old_i - roll_i
        rho = {"token": torch.exp(log_rho), "sequence": torch.exp(log_rho.sum()) * torch.ones_like(log_rho),
               "geometric": torch.exp(log_rho.mean()) * torch.ones_like(log_rho)}[level]
        if mode == "tis":
            sur = sur * torch.clamp(rho, max=threshold)
        elif mode == "mask":
            low, high = band_of(mode, level)
            sur = sur[(rho >= low) & (rho <= high)]
        elif mode == "icepop":
            sur = sur * torch.where((rho >= 0.5) & (rho <= 5.0), rho, torch.zeros_like(rho))
        if len(sur):
            per_seq.append(sur)
    return aggregate(per_seq, loss_type)


def hand_tensors(seed: int = 0):
    """6 sequences (one empty), rho spread around 1 so every mode bites on some tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = [5, 1, 7, 0, 3, 6]
    mask = torch.zeros(6, 8, dtype=torch.bool)
    for i, n in enumerate(lens):
        mask[i, :n] = True
    lp = (-torch.rand(6, 8, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = lp.detach() + torch.randn(6, 8, generator=g, dtype=torch.float64) * 0.2
    roll = old + torch.randn(6, 8, generator=g, dtype=torch.float64) * 0.35
    roll[0, 0] += 2.0  # rho = e^-2: below every band
    roll[2, 1] -= 2.0  # rho = e^2: above every band and threshold
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    return lp, old, roll, mask, adv


def objective(mode, level="token", loss_type="dapo", **kw):
    return GRPOObjective(EPS, EPS_HIGH, loss_type=loss_type, max_completion_length=MAX_LEN,
                         correction=cfg(mode, level), **kw)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "seq-mean-token-sum"])
@pytest.mark.parametrize("mode,level", MODES)
def test_formula_value_and_gradient_match_the_reference(mode, level, loss_type):
    lp, old, roll, mask, adv = hand_tensors()
    obj = objective(mode, level, loss_type)
    old_in = roll if mode == "bypass" else old  # the module hands the sampler's logprobs in as pi_old for bypass
    loss, _, stats = obj(lp, mask, adv, old_in, None, roll)
    (grad,) = torch.autograd.grad(loss, lp)
    lp_ref = lp.detach().clone().requires_grad_()
    ref = reference_loss(lp_ref, old, roll, mask, adv, mode, level, loss_type)
    (grad_ref,) = torch.autograd.grad(ref, lp_ref)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-12)
    assert torch.allclose(grad, grad_ref, rtol=1e-12, atol=1e-15)
    assert isinstance(stats, CorrectedChunkStats) and float(stats.sampled) == float(mask.sum())
    if mode in ("tis", "mask", "icepop"):
        assert 0 < float(stats.outside) < 1  # the hand tensors put some rho outside the band / over the threshold


def test_correction_off_is_the_uncorrected_loss_bit_for_bit():
    lp, old, roll, mask, adv = hand_tensors()
    plain = GRPOObjective(EPS, EPS_HIGH)(lp, mask, adv, old)
    off = GRPOObjective(EPS, EPS_HIGH, correction=RolloutCorrection())(lp, mask, adv, old, None, roll)
    assert torch.equal(plain[0], off[0]) and type(off[2]).__name__ == "ChunkStats"


def test_tis_weighs_each_tokens_gradient_by_its_truncated_rho():
    """d loss / d lp_t = w_t x (uncorrected gradient): the weight carries no gradient of its own."""
    lp, old, roll, mask, adv = hand_tensors(3)
    (g_plain,) = torch.autograd.grad(GRPOObjective(EPS, EPS_HIGH)(lp, mask, adv, old)[0], lp)
    (g_tis,) = torch.autograd.grad(objective("tis")(lp, mask, adv, old, None, roll)[0], lp)
    w = torch.exp(old - roll).clamp(max=1.3)
    assert torch.allclose(g_tis, g_plain * w * mask, rtol=1e-12, atol=1e-15)


def test_a_long_sequence_rho_never_overflows():
    lp, old, roll, mask, adv = hand_tensors()
    far = roll - 50.0  # rho = e^50 per token: the product is e^350 without the bound
    loss, _, stats = objective("tis", "sequence")(lp, mask, adv, old, None, far)
    assert torch.isfinite(loss) and float(stats.is_weight_max) == 1.3


# -- one update: chunked equals unchunked, for every allowed combination ----------------------------------------------
@pytest.fixture(scope="module")
def float64_policy_dir(tmp_path_factory):
    """A tiny GPT-2, float64 end to end (no float32 upcast inside, unlike Qwen2's RMSNorm and softmax), so the
    chunked update meets the unchunked one at float64 rounding whatever the divisors (rejection changes them)."""
    path = tmp_path_factory.mktemp("gpt2-float64")
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=80, n_positions=64, bos_token_id=1, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0,
                        eos_token_id=2, torch_dtype="float64")
    GPT2LMHeadModel(config).double().save_pretrained(path)
    return path


def sampler_as_pi_old(updater) -> None:
    """What ``GRPOModule.forward_chunk`` does under bypass: the sampler's logprobs stand in for a missing pi_old."""
    forward = updater.loop.forward_chunk
    updater.loop.forward_chunk = lambda c, old: forward(c, c.rollout_logprobs[:, 1:] if old is None else old)


CORRECTED = [(*combo, mode, level) for combo in COMBOS for mode, level in MODES]


@pytest.mark.parametrize("loss_type,ratio_level,loss,mode,level", CORRECTED)
def test_chunked_update_equals_unchunked_in_float64(float64_policy_dir, loss_type, ratio_level, loss, mode, level):
    """Two inner epochs against a frozen pi_old (bypass: the sampler's), fixed chunks and a token budget."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float64_policy_dir, dtype=torch.float64)
    batch = with_sampler_logprobs(synthetic_batch([1, 12, 3, 20, 2, 7, 15, 4], seed=1), model, sigma=0.5)
    obj = GRPOObjective(0.01, 0.01, loss_type=loss_type, ratio_level=ratio_level, loss=loss, max_completion_length=32,
                        correction=cfg(mode, level))
    needs = Needs(pi_old=mode != "bypass")
    runs = {name: bare(float64_policy_dir, Split(rows=8, mu_iterations=2, **kw), obj, needs, lr=1.0)
            for name, kw in (("whole", {}), ("fixed", {"n_micro": 4}), ("budget", {"max_tokens_per_micro": 40}))}
    if mode == "bypass":
        for u in runs.values():
            sampler_as_pi_old(u)
    before = params_of(runs["whole"].policy)
    metrics = {name: roll_up(u.update(batch)) for name, u in runs.items()}
    assert runs["budget"].last_plan.real_chunks > 1
    for name in ("fixed", "budget"):
        delta = max_rel_delta(before, params_of(runs["whole"].policy), params_of(runs[name].policy))
        assert delta <= 5e-8, f"{name}: {delta:.2e}"
        for metric in ("grpo/loss", "grpo/denom", "correction/is_weight_mean", "correction/outside_frac",
                       "correction/logprob_gap_mean", "correction/tokens"):
            assert metrics[name][metric] == pytest.approx(metrics["whole"][metric], rel=1e-10, abs=1e-14), metric
    if mode != "bypass":
        assert metrics["whole"]["correction/outside_frac"] > 0  # the correction acted on some tokens


@pytest.mark.parametrize("mode,level", MODES)
def test_one_chunk_is_bit_identical_to_the_whole_batch_objective_call(float64_policy_dir, mode, level):
    from transformers import AutoModelForCausalLM

    from lightning_grpo.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(float64_policy_dir, dtype=torch.float64).train()
    batch = with_sampler_logprobs(synthetic_batch([1, 12, 3, 20, 2, 7, 15, 4], seed=1), model, sigma=0.5)
    obj = objective(mode, level)
    updater = bare(float64_policy_dir, Split(rows=8), obj, Needs())
    if mode == "bypass":
        sampler_as_pi_old(updater)
    updater.update(batch)
    logprobs = token_logprobs(model, batch.input_ids, batch.attention_mask, positions=batch.completion_mask[:, 1:])
    rollout = batch.rollout_logprobs[:, 1:]
    obj(logprobs, batch.completion_mask[:, 1:], batch.advantages, rollout if mode == "bypass" else None, None,
        rollout)[0].backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), updater.policy.parameters()))


# -- the peers' modes, re-implemented from their source (docs/objectives.md's mapping table) ---------------------------
def ppo_surrogate(lp, old, adv):
    """``[B, T]`` -min(r A, clip(r) A), r = pi / pi_old: TRL's and verl's default policy loss alike."""
    r = torch.exp(lp - old)
    return -torch.minimum(r * adv[:, None], torch.clamp(r, 1 - EPS, 1 + EPS_HIGH) * adv[:, None])


def trl_loss(lp, old, roll, mask, adv, mode, clip_min, clip_max):
    """TRL GRPOTrainer's vLLM importance sampling correction, ``*_mask`` modes (huggingface/trl
    trl/trainer/grpo_trainer.py): rho = exp(old - sampler) per token, or exp of its row sum; outside
    [clip_min, clip_max] set to 0, else kept as the weight; the surrogate times it; loss_type dapo on one process
    divides by the completion tokens (the mask is untouched)."""
    m = mask.to(lp.dtype)
    diff = (old - roll) * m
    if mode == "sequence_mask":
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    per_token = ppo_surrogate(lp, old, adv) * ratio
    return (per_token * m).sum() / m.sum()


def verl_loss(lp, old, roll, mask, adv, option, spec):
    """verl's rollout rejection sampling (volcengine/verl verl/trainer/ppo/rollout_corr_helper.py,
    compute_rollout_rejection_mask), K1 options: k1 = -log(old / sampler) per token, summed or averaged over the row;
    kept when log(lower) <= k1 <= log(upper) (``spec`` = "lower_upper"); rejected tokens leave the response mask,
    so the token-mean divides by the kept tokens."""
    lower, upper = (float(x) for x in spec.split("_"))
    m = mask.to(lp.dtype)
    k1 = -((old - roll).clamp(-20, 20))
    if option == "token_k1":
        stat = k1
    elif option == "seq_sum_k1":
        stat = (k1 * m).sum(-1, keepdim=True).expand_as(k1)
    else:  # seq_mean_k1
        stat = ((k1 * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(k1)
    keep = m * ((stat >= math.log(lower)) & (stat <= math.log(upper))).to(lp.dtype)
    return (ppo_surrogate(lp, old, adv) * keep).sum() / keep.sum()


def peer_tensors():
    """``hand_tensors`` with two tokens in the slivers an asymmetric band [0.7, 1.4] and verl's reading of it
    ([1/1.4, 1/0.7]) disagree on: rho = 0.705 and rho = 1.42."""
    lp, old, roll, mask, adv = hand_tensors(5)
    roll[4, 0] = old[4, 0] - math.log(0.705)
    roll[5, 2] = old[5, 2] - math.log(1.42)
    return lp, old, roll, mask, adv


def ours(lp, old, roll, mask, adv, **correction):
    obj = GRPOObjective(EPS, EPS_HIGH, loss_type="dapo", correction=RolloutCorrection(**correction))
    return obj(lp, mask, adv, old, None, roll)[0]


def value_and_grad(loss, lp):
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


def rel_diff(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("trl_mode,level", [("token_mask", "token"), ("sequence_mask", "sequence")])
@pytest.mark.parametrize("clip_min,clip_max", [(None, 3.0), (0.6, 1.5)])
def test_trls_mask_modes_are_icepop_with_their_band(trl_mode, level, clip_min, clip_max):
    """TRL's *_mask keep the ratio as the weight inside [clip_min, clip_max] and keep the divisor: our icepop (band
    [clip_min or 0, clip_max]) at the same level, in value and gradient; our mask (rejection: weight 1, the divisor
    shrinks) is another loss (measured: the gradients differ by more than 10%)."""
    lp, old, roll, mask, adv = peer_tensors()
    band = (clip_min or 0.0, clip_max)
    want, want_grad = value_and_grad(trl_loss(lp, old, roll, mask, adv, trl_mode, clip_min, clip_max), lp)
    got, got_grad = value_and_grad(ours(lp, old, roll, mask, adv, mode="icepop", level=level, band=band), lp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-15)
    _, rejected = value_and_grad(ours(lp, old, roll, mask, adv, mode="mask", level=level, band=band), lp)
    assert rel_diff(rejected, want_grad) > 0.1


@pytest.mark.parametrize("option,level", [("token_k1", "token"), ("seq_sum_k1", "sequence"),
                                          ("seq_mean_k1", "geometric")])
@pytest.mark.parametrize("spec", ["0.5_2.0", "0.7_1.4", "0.8_1.1"])
def test_verls_k1_rejection_is_mask_with_the_reciprocal_band(option, level, spec):
    """verl bounds -log rho: its "L_U" keeps rho in [1/U, 1/L], our mask's band [1/U, 1/L], in value and gradient."""
    lp, old, roll, mask, adv = peer_tensors()
    lower, upper = (float(x) for x in spec.split("_"))
    want, want_grad = value_and_grad(verl_loss(lp, old, roll, mask, adv, option, spec), lp)
    got, got_grad = value_and_grad(ours(lp, old, roll, mask, adv, mode="mask", level=level,
                                        band=(1 / upper, 1 / lower)), lp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-15)


def test_an_asymmetric_verl_band_read_as_ours_is_another_loss():
    """The mapping's trap: verl's 0.7_1.4 is not our band [0.7, 1.4] (rho 0.705 and 1.42 land on opposite sides)."""
    lp, old, roll, mask, adv = peer_tensors()
    _, verl_grad = value_and_grad(verl_loss(lp, old, roll, mask, adv, "token_k1", "0.7_1.4"), lp)
    _, literal = value_and_grad(ours(lp, old, roll, mask, adv, mode="mask", band=(0.7, 1.4)), lp)
    assert rel_diff(literal, verl_grad) > 0.1

# -- metrics ----------------------------------------------------------------------------------------------------------
def test_metrics_are_the_whole_batchs_and_combine_over_ranks_exactly():
    lp, old, roll, mask, adv = hand_tensors(5)
    obj = objective("tis")
    whole = obj(lp.detach(), mask, adv, old, None, roll)[2]
    halves = [obj(lp.detach()[s], mask[s], adv[s], old[s], None, roll[s])[2] for s in (slice(0, 2), slice(2, 6))]
    m = mask.to(torch.float64)
    gap = (old - roll) * m
    w = torch.exp(old - roll).clamp(max=1.3) * m
    assert float(whole.logprob_gap) == pytest.approx(float(gap.abs().sum() / m.sum()), rel=1e-12)
    assert float(whole.mult_prob_error) == pytest.approx(float((torch.exp(gap.abs()) * m).sum() / m.sum()), rel=1e-12)
    assert float(whole.is_weight) == pytest.approx(float(w.sum() / m.sum()), rel=1e-12)

    def rolled(stats):
        return roll_up(SimpleNamespace(chunks=[stats], steps=[], chunk_epochs=[0], consecutive_skips=0,
                                       discarded_chunks=0))

    combined = combine_two([rolled(s) for s in halves])  # two "ranks" with unequal token counts
    expect = rolled(whole)
    for name in ("correction/is_weight_mean", "correction/is_weight_max", "correction/outside_frac",
                 "correction/logprob_gap_mean", "correction/trainer_logprob_mean", "correction/tokens"):
        assert combined[name] == pytest.approx(expect[name], rel=1e-12), name
    derived = derived_metrics(combined)
    assert derived["correction/ess"] == pytest.approx(float(w.sum() ** 2 / (m.sum() * (w * w).sum())), rel=1e-12)
    assert derived["correction/rollout_ppl"] == pytest.approx(math.exp(-float((roll * m).sum() / m.sum())), rel=1e-12)
    assert 0 < derived["correction/ess"] <= 1


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_entropy_under_mask_is_the_mean_over_every_completion_token(level):
    """mode=mask rejects tokens from the loss, not from grpo/entropy (docs: the completion tokens); main averaged it
    over the kept tokens only. Whole batch, and two ranks of unequal shares combined, against the hand mean."""
    lp, old, roll, mask, adv = hand_tensors(5)
    ent = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    obj = objective("mask", level)
    whole = obj(lp.detach(), mask, adv, old, None, roll, entropy=ent)[2]
    assert float(whole.sampled) > float(whole.tokens)  # some tokens are rejected
    want = float((ent * mask).sum() / mask.sum())
    assert float(whole.entropy) == pytest.approx(want, rel=1e-12)

    def rolled(stats):
        return roll_up(SimpleNamespace(chunks=[stats], steps=[], chunk_epochs=[0], consecutive_skips=0,
                                       discarded_chunks=0))

    halves = [obj(lp.detach()[s], mask[s], adv[s], old[s], None, roll[s], entropy=ent[s])[2]
              for s in (slice(0, 2), slice(2, 6))]
    assert rolled(whole)["grpo/entropy"] == pytest.approx(want, rel=1e-12)
    assert combine_two([rolled(h) for h in halves])["grpo/entropy"] == pytest.approx(want, rel=1e-12)


def combine_two(tables: list[dict]) -> dict:
    """``combine_ranks`` as rank 0 of two sees it: each all-reduce returns the sum (or max) of both ranks' tensors."""
    sent: list[list[torch.Tensor]] = [[], []]
    for r in (0, 1):  # what each rank sends, call by call
        combine_ranks(tables[r], lambda t, op, r=r: sent[r].append(t.clone()) or t, 2, rows=3)
    calls = iter(zip(*sent))

    def reduce(t, op):
        a, b = next(calls)
        return torch.maximum(a, b) if op == "max" else a + b

    return combine_ranks(tables[0], reduce, 2, rows=3)


# -- the module path: build, sampler logprobs requested, refusals -----------------------------------------------------
def test_builder_passes_the_correction_and_the_sampler_is_asked_for_logprobs():
    rl = GRPOConfig(rollout_correction={"mode": "mask", "level": "geometric", "band": [0.9, 1.1]})
    obj = build_objective("grpo", ObjectiveParts(rl, single_process, RolloutConfig().max_new_tokens))
    assert obj.correction.bounds == (0.9, 1.1) and obj.stats is CorrectedChunkStats
    assert rl.needs_sampler_logprobs and not rl.pi_old_is_sampler
    plain = ObjectiveParts(GRPOConfig(), single_process, RolloutConfig().max_new_tokens)
    assert build_objective("grpo", plain).correction is None


@pytest.mark.parametrize("kw,names", [
    ({"mode": "tis", "level": "geometric"}, "level='geometric' with mode='tis'"),
    ({"mode": "icepop", "level": "geometric"}, "level='geometric' with mode='icepop'"),
    ({"mode": "bypass", "level": "sequence"}, "level='sequence' with mode='bypass'"),
    ({"mode": "tis", "band": [0.5, 2.0]}, "only mask and icepop use a band"),
    ({"mode": "mask", "band": [1.2, 2.0]}, "band=(1.2, 2.0)"),
    ({"mode": "tis", "threshold": 0.5}, "threshold=0.5"),
    # issue 47: a threshold beside a mode that never reads it was accepted without a word
    ({"mode": "mask", "threshold": 3.0}, "threshold=3.0 with mode='mask': only tis truncates at a threshold; set band"),
    ({"mode": "icepop", "threshold": 3.0}, "threshold=3.0 with mode='icepop'"),
    ({"mode": "off", "threshold": 2.0}, "threshold=2.0 with mode='off': only tis truncates at a threshold; drop"),
    ({"mode": "bypass", "threshold": 1.5}, "threshold=1.5 with mode='bypass'"),
    ({"mode": "ratio"}, "mode='ratio'"),
])
def test_refusals_name_the_knob(kw, names):
    with pytest.raises(ConfigError, match=r"rl.rollout_correction") as err:
        GRPOConfig(rollout_correction=kw)
    assert names in str(err.value)


def test_the_retired_knob_points_to_bypass():
    with pytest.raises(ConfigError, match="rl.rollout_correction.mode=bypass"):
        GRPOConfig(use_rollout_logprobs_for_loss=True)


def test_raw_vllm_logprobs_under_a_warped_sampler_are_refused_for_every_mode():
    raw = RolloutConfig(engine="vllm", vllm=VLLMConfig(logprobs_mode="raw_logprobs"), temperature=0.7)
    with pytest.raises(ConfigError, match="rl.rollout_correction.mode='tis'"):
        check_run(PolicyConfig(), GRPOConfig(rollout_correction={"mode": "tis"}), raw)


def test_replay_records_without_sampler_logprobs_are_refused_naming_the_field(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt_id": 0, "prompt_ids": [1, 2], "completion_ids": [3], "reward": 1.0}\n')
    ReplayEngine(path)  # nothing needs them
    with pytest.raises(ValueError, match=r"r.jsonl:1: the record has no 'logprobs' field.*mode='tis'"):
        ReplayEngine(path, need_logprobs="rl.rollout_correction.mode='tis'")


def test_a_chunk_without_sampler_logprobs_is_refused():
    lp, old, _, mask, adv = hand_tensors()
    with pytest.raises(ValueError, match="needs the sampler's logprobs"):
        objective("tis")(lp, mask, adv, old)
