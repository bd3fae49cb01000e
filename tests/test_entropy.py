"""Entropy of the policy (issue 28 item 4): the fused head's value and gradient against float64 references, the bonus
and the top-entropy mask exact under any chunking; and the length metrics (item 5) with their rank reductions."""

import math

import pytest
import torch
from helpers import max_rel_delta, params_of, synthetic_batch
from test_loss_family import UNEQUAL
from torch import nn
from transformers import AutoModelForCausalLM

from lightning_grpo.config import ConfigError, GRPOConfig, RolloutConfig
from lightning_grpo.distributed import single_process
from lightning_grpo.fused_head import KEEP_BYTES
from lightning_grpo.logprobs import token_logprobs
from lightning_grpo.metrics import length_metrics, roll_up
from lightning_grpo.objectives import ObjectiveParts, build_objective
from lightning_grpo.objectives.entropy import top_entropy_mask
from lightning_grpo.objectives.grpo import GRPOObjective
from lightning_grpo.rank_metrics import combine_ranks, rank_reduction
from lightning_grpo.scoring import ChunkScorer
from lightning_grpo.update import AheadPass, Needs, Split, Updater

TEMPERATURE = 0.7


class FullLogits(nn.Module):
    """The same model seen without ``get_decoder``: ``token_logprobs`` takes the plain (full logits) path."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kw):
        return self.model(**kw)


def reference_entropy(model, batch) -> torch.Tensor:
    """``[B, T-1]`` -sum p log p of softmax(logits / T) from the full float64 logits, 0 off the completion."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].double()
    ent = torch.distributions.Categorical(logits=logits / TEMPERATURE).entropy()
    return ent * batch.completion_mask[:, 1:]


@pytest.fixture(scope="module")
def model64(tiny_policy_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float64).train()


def score(model, batch, entropy, **kw):
    return token_logprobs(model, batch.input_ids, batch.attention_mask, positions=batch.completion_mask[:, 1:],
                          temperature=TEMPERATURE, entropy=entropy, **kw)


@pytest.mark.parametrize("keep_bytes", [KEEP_BYTES, 0])  # logits kept from forward, or every chunk recomputed
def test_entropy_matches_the_full_softmax_on_both_paths(model64, keep_bytes):
    batch = synthetic_batch(UNEQUAL, seed=1)
    want = reference_entropy(model64, batch).detach()
    lp, fused = score(model64, batch, "value", keep_bytes=keep_bytes, chunk_bytes=8 * 2 * 256)  # several chunks
    plain_lp, plain = score(FullLogits(model64), batch, "value")
    torch.testing.assert_close(fused, want, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(plain, want, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lp, plain_lp, rtol=1e-13, atol=1e-13)
    assert not fused.requires_grad and float(fused.min()) >= 0
    assert torch.equal(lp, score(model64, batch, None, keep_bytes=keep_bytes, chunk_bytes=8 * 2 * 256))  # unchanged
    with torch.no_grad():  # the scoring-only path (ahead pass) gives the same figures
        assert torch.equal(score(model64, batch, "value", keep_bytes=keep_bytes, chunk_bytes=8 * 2 * 256)[1], fused)


def test_the_bonus_gradient_matches_autograd_in_float64(model64):
    """entropy='grad' (the checkpointed head pass) against autograd through the full logits, every parameter."""
    batch = synthetic_batch(UNEQUAL, seed=2)
    weights = torch.randn(batch.completion_mask[:, 1:].shape, dtype=torch.float64)
    grads = []
    for model in (model64, FullLogits(model64)):
        model64.zero_grad(set_to_none=True)
        lp, ent = score(model, batch, "grad", chunk_bytes=8 * 2 * 256)
        ((ent + 0.5 * lp) * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model64.named_parameters()})
    for name, want in grads[1].items():
        torch.testing.assert_close(grads[0][name], want, rtol=1e-11, atol=1e-13), name


# -- the objective --------------------------------------------------------------------------------------------------
LP = [[-1.0, -0.5, -2.0, -0.7, -0.1], [-0.3, -1.1, -0.9, -0.2, -0.6], [-1.5, -0.4, -0.8, -1.2, -0.9]]
ENT = [[0.9, 0.1, 2.0, 0.4, 0.3], [1.1, 0.2, 0.2, 0.2, 0.5], [0.3, 0.6, 0.2, 1.7, 0.8]]
MASK = [[True, True, True, True, True], [True, True, True, False, False], [True, True, True, True, False]]
ADV = [1.0, -2.0, 0.5]


def reference_mask(ent, mask, q):
    """Each row keeps its ceil(q * n) largest entropies (Wang et al. 2025, per sequence), a plain loop."""
    out = torch.zeros_like(ent)
    for i in range(ent.shape[0]):
        values = sorted(ent[i][mask[i]].tolist(), reverse=True)
        k = math.ceil(round(q * len(values), 9))
        for t in range(ent.shape[1]):
            out[i, t] = float(bool(mask[i, t]) and k > 0 and ent[i, t] >= values[k - 1])
    return out


@pytest.mark.parametrize("q", [0.2, 0.5, 0.6, 1.0])
def test_top_entropy_mask_keeps_each_rows_top_share(q):
    ent, mask = torch.tensor(ENT, dtype=torch.float64), torch.tensor(MASK)
    torch.testing.assert_close(top_entropy_mask(ent, mask, q), reference_mask(ent, mask, q), rtol=0, atol=0)
    empty = top_entropy_mask(ent, torch.zeros_like(mask), q)  # a DP filler row keeps nothing
    assert float(empty.sum()) == 0


@pytest.mark.parametrize("coef,q", [(0.0, 1.0), (0.01, 1.0), (0.0, 0.4), (0.05, 0.5)])
def test_bonus_and_mask_match_the_formula(coef, q):
    """dapo: loss = [sum_t keep_t * ppo_t + beta k3_t - coef H_t] / tokens, with keep from the detached entropy."""
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    ent = torch.tensor(ENT, dtype=torch.float64, requires_grad=True)
    mask, adv = torch.tensor(MASK), torch.tensor(ADV, dtype=torch.float64)
    old = lp.detach() - 0.1
    obj = GRPOObjective(0.2, 0.28, entropy_coef=coef, top_entropy_quantile=q)
    loss, denom, stats = obj(lp, mask, adv, old, entropy=ent)
    r = torch.exp(lp - old)
    ppo = -torch.minimum(r * adv[:, None], r.clamp(0.8, 1.28) * adv[:, None])
    keep = reference_mask(ent.detach(), mask, q)
    want = ((ppo * keep - coef * ent) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, want, rtol=1e-15, atol=1e-15)
    got_grads, want_grads = (torch.autograd.grad(x, (lp, ent), allow_unused=True, materialize_grads=True)
                             for x in (loss, want))
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-15, atol=1e-16)
    assert float(stats.entropy) == pytest.approx(float((ent * mask).sum() / mask.sum()), rel=1e-15)
    assert float(denom) == int(mask.sum())


def test_default_loss_is_unchanged_and_entropy_only_logged():
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    mask, adv = torch.tensor(MASK), torch.tensor(ADV, dtype=torch.float64)
    ent = torch.tensor(ENT, dtype=torch.float64)
    with_ent, without = GRPOObjective()(lp, mask, adv, lp.detach() - 0.1, entropy=ent), GRPOObjective()(
        lp, mask, adv, lp.detach() - 0.1)
    assert torch.equal(with_ent[0], without[0]) and math.isnan(float(without[2].entropy))
    with pytest.raises(ValueError, match="needs the policy's entropy"):
        GRPOObjective(entropy_coef=0.1)(lp, mask, adv)


# -- one update: chunked equals unchunked with the bonus and the mask -------------------------------------------------
def updater(policy_dir, split: Split, obj: GRPOObjective, lr: float = 1.0) -> Updater:
    """An Updater over a float64 policy, scored through the module's ChunkScorer (logprobs and entropy)."""
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float64).train()
    scorer = ChunkScorer(model, None, None, False, 1.0, KEEP_BYTES)
    updater = Updater(model, lambda chunk, old: obj.chunk_loss(chunk, scorer.policy_view(chunk), old), split,
                      Needs(pi_old=True), ahead=AheadPass(model, lambda c: scorer.logprobs(model, c)))
    updater.attach(torch.optim.SGD(model.parameters(), lr=lr))
    return updater


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_chunked_update_with_entropy_equals_unchunked_in_float64(tiny_policy_dir, loss_type):
    batch = synthetic_batch(UNEQUAL, seed=1)
    obj = GRPOObjective(0.01, 0.01, loss_type=loss_type, entropy_coef=0.05, top_entropy_quantile=0.5)
    runs = {name: updater(tiny_policy_dir, Split(rows=8, mu_iterations=2, **kw), obj)
            for name, kw in (("whole", {}), ("fixed", {"n_micro": 4}), ("budget", {"max_tokens_per_micro": 40}))}
    before = params_of(runs["whole"].policy)
    metrics = {name: roll_up(u.update(batch)) for name, u in runs.items()}
    assert runs["budget"].last_plan.real_chunks > 1 and metrics["whole"]["grpo/entropy"] > 0
    for name in ("fixed", "budget"):
        delta = max_rel_delta(before, params_of(runs["whole"].policy), params_of(runs[name].policy))
        print(f"{loss_type} {name}: max relative delta {delta:.2e}")
        assert delta <= 5e-8
        for metric in ("grpo/loss", "grpo/entropy"):
            assert metrics[name][metric] == pytest.approx(metrics["whole"][metric], rel=1e-12), metric


def test_one_chunk_with_entropy_is_bit_identical_to_the_whole_batch_call(tiny_policy_dir):
    batch = synthetic_batch(UNEQUAL, seed=1)
    obj = GRPOObjective(entropy_coef=0.05, top_entropy_quantile=0.3)
    run = updater(tiny_policy_dir, Split(rows=8), obj, lr=0.1)
    run.update(batch)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float64).train()
    lp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, positions=batch.completion_mask[:, 1:],
                             entropy="grad")
    obj(lp, batch.completion_mask[:, 1:], batch.advantages, entropy=ent)[0].backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), run.policy.parameters()))


# -- config -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,names", [
    ({"entropy_coef": -0.1}, "entropy_coef=-0.1"),
    ({"entropy_coef": math.inf}, "entropy_coef=inf"),
    ({"top_entropy_quantile": 0.0}, "top_entropy_quantile=0.0"),
    ({"top_entropy_quantile": 1.5}, "top_entropy_quantile=1.5"),
])
def test_refusals_name_the_knob(kw, names):
    with pytest.raises(ConfigError) as err:
        GRPOConfig(**kw)
    assert any(p.startswith(names) for p in err.value.problems), err.value.problems


@pytest.mark.parametrize("knob,value", [("entropy_coef", 0.01), ("top_entropy_quantile", 0.2)])
def test_opd_refuses_the_entropy_knobs(knob, value):
    from lightning_grpo.objectives.opd import OPDConfig
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.run_check import check_run

    opd = OPDConfig(teacher=PolicyConfig(path="teacher"))
    with pytest.raises(ConfigError) as err:
        check_run(PolicyConfig(), GRPOConfig(**{knob: value}), RolloutConfig(), opd, "opd")
    assert [p for p in err.value.problems if p.startswith(f"rl.{knob}={value!r}")]


def test_builder_passes_the_entropy_knobs():
    rl = GRPOConfig(entropy_coef=0.003, top_entropy_quantile=0.2)
    obj = build_objective("grpo", ObjectiveParts(rl, single_process, RolloutConfig().max_new_tokens))
    assert (obj.entropy_coef, obj.top_entropy_quantile) == (0.003, 0.2)


# -- length metrics (item 5) ------------------------------------------------------------------------------------------
def test_length_metrics_of_hand_built_rollouts():
    m = length_metrics(torch.tensor([3, 8, 8, 5]), ["stop", "length", "length", "stop"])
    assert m == {"completion/len_mean": 6.0, "completion/len_min": 3.0, "completion/len_max": 8.0,
                 "completion/stop_frac": 0.5, "completion/clipped_frac": 0.5, "completion/terminated_len_mean": 4.0}
    none = length_metrics(torch.tensor([8, 8]), ["length", "length"])
    assert math.isnan(none["completion/terminated_len_mean"]) and none["completion/clipped_frac"] == 1.0


def two_ranks(a: dict, b: dict) -> dict:
    """``combine_ranks`` of rank 0 holding ``a`` while rank 1 holds ``b``: rank 1's tensors recorded, then replayed."""
    seen = []
    combine_ranks(b, lambda t, op: seen.append(t) or t, world_size=2, rows=4)
    other = iter(seen)
    return combine_ranks(a, lambda t, op: t + next(other) if op == "sum" else torch.maximum(t, next(other)),
                         world_size=2, rows=4)


def test_length_metrics_combine_over_ranks():
    a = length_metrics(torch.tensor([3, 8, 8, 5]), ["stop", "length", "length", "stop"])
    b = length_metrics(torch.tensor([2, 7, 6, 8]), ["stop", "stop", "stop", "length"])
    whole = length_metrics(torch.tensor([3, 8, 8, 5, 2, 7, 6, 8]), ["stop", "length", "length", "stop",
                                                                        "stop", "stop", "stop", "length"])
    got = two_ranks(a, b)
    for name, want in whole.items():
        assert got[name] == pytest.approx(want, rel=1e-12), name
    nan = length_metrics(torch.tensor([8, 8, 8, 8]), ["length"] * 4)
    assert two_ranks(nan, b)["completion/terminated_len_mean"] == pytest.approx(b["completion/terminated_len_mean"])
    assert math.isnan(two_ranks(nan, nan)["completion/terminated_len_mean"])
    assert [rank_reduction(n) for n in ("completion/len_min", "completion/len_max", "grpo/entropy")] == [
        "min", "max", "token"]


def test_the_entropy_dots_stay_float32_under_bf16_autocast():
    """The fused head's entropy sums ``exp(x) * x`` over the vocabulary with a batched dot. Under bf16 autocast (what
    ``precision: bf16-mixed`` runs) that dot must not be cast to bf16: it cost a third of a bf16 update and rounded the
    logged entropy to bf16. Equal bit for bit inside and outside autocast."""
    from lightning_grpo.fused_head import _exp_dots

    x = torch.randn(12, 3000, generator=torch.Generator().manual_seed(0)) * 4
    x = x - x.amax(-1, keepdim=True)
    plain = _exp_dots(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = _exp_dots(x)
    assert under.dtype == torch.float32 and torch.equal(under, plain)
