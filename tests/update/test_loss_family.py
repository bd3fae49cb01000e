"""The GRPO loss family (rl.loss_type x rl.ratio_level x rl.loss): each formula against an independent float64
implementation, chunking exactness of every allowed combination, the default unchanged, and the refusals."""


import pytest
import torch
from helpers import max_rel_delta, params_of, synthetic_batch
from transformers import AutoModelForCausalLM

from lightning_grpo.config import LOSS_TYPES, ConfigError, GRPOConfig, RolloutConfig
from lightning_grpo.distributed import single_process
from lightning_grpo.logprobs import token_logprobs
from lightning_grpo.metrics import roll_up
from lightning_grpo.objectives import ObjectiveParts, PolicyView, build_objective
from lightning_grpo.objectives.grpo import GRPOObjective
from lightning_grpo.update import AheadPass, Needs, Split, Updater
from lightning_grpo.update.plan import plan_update

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier

UNEQUAL = [1, 12, 3, 20, 2, 7, 15, 4]  # test_accumulate's batch: chunk token counts differ a lot
COMBOS = [(t, r, f) for t in LOSS_TYPES for r in ("token", "sequence") for f in ("ppo_clip", "cispo")
          if not (f == "cispo" and r == "sequence")]  # the one refused combination (test_refusals)
EPS, EPS_HIGH, MAX_LEN = 0.2, 0.28, 6

# -- hand-made tensors: 3 sequences of 3, 1 and 4 tokens; ratios on both sides of the clip range ----------------------
LP = [[-1.0, -0.5, -2.0, -0.7], [-0.3, -1.1, -0.9, -0.2], [-1.5, -0.4, -0.8, -1.2]]
OLD = [[-1.4, -0.5, -1.8, -9.0], [0.0, -3.0, -3.0, -3.0], [-1.2, -0.6, -1.3, -1.9]]  # ratio e^(lp - old)
# token ratios e^[.4, 0, -.2], e^-.3, e^[-.3, .2, .5, .7]; sequence ratios e^.067, e^-.3 (A < 0: low), e^.275 (high)
MASK = [[True, True, True, False], [True, False, False, False], [True, True, True, True]]
ADV = [1.0, -2.0, 0.5]
REF = [[-1.2, -0.4, -2.5, -0.7], [-0.6, -1.1, -0.9, -0.2], [-1.0, -0.9, -0.3, -1.0]]


def reference_loss(lp, old, mask, adv, loss_type, ratio_level, loss, beta=0.0, ref=None):
    """The step loss written per sequence from the papers and TRL's GRPOTrainer._compute_loss (float64 loops).

    Ratio: token r_t = exp(lp_t - old_t); sequence (GSPO, arXiv 2507.18071; TRL importance_sampling_level="sequence")
    s = exp(mean_t(lp_t - old_t)) for every token. Surrogate: ppo_clip -min(r A, clip(r, 1-eps, 1+eps_high) A);
    cispo (MiniMax-M1, arXiv 2506.13585) -sg(clip(r, 1-eps, 1+eps_high)) A lp_t. k3 KL exp(ref-lp) - (ref-lp) - 1.
    Aggregation (TRL loss_type): dapo sum / tokens; grpo mean_i(mean_t); dr_grpo sum / (sequences x max length);
    seq-mean-token-sum (verl loss_agg_mode) mean_i(sum_t).
    """
    per_seq = []
    for i in range(lp.shape[0]):
        keep = mask[i]
        lp_i, old_i = lp[i][keep], old[i][keep]
        if ratio_level == "token":
            r = torch.exp(lp_i - old_i)
        else:
            r = torch.exp((lp_i - old_i).sum() / len(lp_i)) * torch.ones_like(lp_i)
        c = torch.clamp(r, 1 - EPS, 1 + EPS_HIGH)
        if loss == "cispo":
            per = -c.detach() * adv[i] * lp_i
        else:
            per = -torch.minimum(r * adv[i], c * adv[i])
        if beta:
            d = ref[i][keep] - lp_i
            per = per + beta * (torch.exp(d) - d - 1)
        per_seq.append(per)
    return aggregate(per_seq, loss_type)


def aggregate(per_seq: list, loss_type: str, max_len: int = MAX_LEN):
    """The step loss from each sequence's per-token losses, as TRL's loss_type (verl's seq-mean-token-sum)."""
    n, tokens = len(per_seq), sum(len(p) for p in per_seq)
    if loss_type == "dapo":
        return sum(p.sum() for p in per_seq) / tokens
    if loss_type == "grpo":
        return sum(p.mean() for p in per_seq) / n
    if loss_type == "dr_grpo":
        return sum(p.sum() for p in per_seq) / (n * max_len)
    return sum(p.sum() for p in per_seq) / n


def hand_tensors():
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    return lp, torch.tensor(OLD, dtype=torch.float64), torch.tensor(MASK), torch.tensor(ADV, dtype=torch.float64)


def objective(loss_type="dapo", ratio_level="token", loss="ppo_clip", beta=0.0, **kw):
    return GRPOObjective(EPS, EPS_HIGH, beta, loss_type=loss_type, ratio_level=ratio_level, loss=loss,
                         max_completion_length=MAX_LEN, **kw)


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_type,ratio_level,loss", COMBOS)
def test_formula_value_and_gradient_match_the_reference(loss_type, ratio_level, loss, beta):
    lp, old, mask, adv = hand_tensors()
    ref = torch.tensor(REF, dtype=torch.float64)
    got, denom, stats = objective(loss_type, ratio_level, loss, beta)(lp, mask, adv, old, ref)
    (grad,) = torch.autograd.grad(got, lp)
    lp2 = lp.detach().clone().requires_grad_(True)
    want = reference_loss(lp2, old, mask, adv, loss_type, ratio_level, loss, beta, ref)
    (want_grad,) = torch.autograd.grad(want, lp2)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(grad, want_grad, rtol=1e-14, atol=1e-15)
    assert float(denom) == {"dapo": 8, "grpo": 3, "dr_grpo": 3 * MAX_LEN, "seq-mean-token-sum": 3}[loss_type]
    assert float(stats.seqs) == 3 and float(stats.tokens) == 8
    assert float(stats.clip_frac) == pytest.approx(float(stats.clip_frac_low + stats.clip_frac_high), abs=1e-15)
    assert float(stats.clip_frac_low) > 0 and float(stats.clip_frac_high) > 0  # the tensors reach both sides


def test_gspo_gradient_is_the_papers():
    """GSPO's gradient (arXiv 2507.18071): unclipped, each token gets -A_i s_i / |y_i| (here / the divisor)."""
    lp, _, mask, adv = hand_tensors()
    old = lp.detach() - 0.01  # s_i = e^0.01 for every sequence: inside the clip range
    loss, denom, _ = objective("grpo", "sequence")(lp, mask, adv, old)
    (grad,) = torch.autograd.grad(loss, lp)
    lengths = mask.sum(-1, keepdim=True).double()
    s = torch.exp(torch.tensor(0.01, dtype=torch.float64))
    # grpo: loss = sum_i (1/|y_i|) sum_t (-s_i A_i) / 3 = sum_i -s_i A_i / 3, and d s_i / d lp_it = s_i / |y_i|
    torch.testing.assert_close(grad, -adv.unsqueeze(-1) * s * mask / lengths / denom, rtol=1e-14, atol=1e-16)


def test_cispo_gradient_flows_through_every_token_weighted_by_the_truncated_ratio():
    """-sg(clip(r)) A grad log pi at every token, clipped ones included (MiniMax-M1), unlike ppo_clip's zero there."""
    lp, old, mask, adv = hand_tensors()
    loss, denom, _ = objective("dapo", loss="cispo")(lp, mask, adv, old)
    (grad,) = torch.autograd.grad(loss, lp)
    r = torch.exp(lp.detach() - old).clamp(1 - EPS, 1 + EPS_HIGH)
    torch.testing.assert_close(grad, -r * adv.unsqueeze(-1) * mask / denom, rtol=1e-14, atol=1e-16)
    assert bool((grad[mask] != 0).all())


def test_default_is_todays_expression_bit_for_bit():
    """The default (dapo, token, ppo_clip) computes exactly what GRPOObjective computed before the family existed."""
    lp, old, mask, adv = hand_tensors()
    ref = torch.tensor(REF, dtype=torch.float64)
    got, denom, stats = GRPOObjective(EPS, EPS_HIGH, 0.1)(lp, mask, adv, old, ref)
    (grad,) = torch.autograd.grad(got, lp)
    lp2 = lp.detach().clone().requires_grad_(True)  # the previous body of GRPOObjective.__call__, verbatim
    m = mask.to(lp2.dtype)
    ratio = torch.exp(lp2 - old)
    a = adv.unsqueeze(-1)
    clipped = torch.clamp(ratio, 1 - EPS, 1 + EPS_HIGH)
    delta = ref - lp2
    per_token = -torch.min(ratio * a, clipped * a) + 0.1 * (torch.exp(delta) - delta - 1)
    d = m.sum()
    want = (per_token * m).sum() / torch.where(d > 0, d, torch.ones_like(d))
    (want_grad,) = torch.autograd.grad(want, lp2)
    assert torch.equal(got, want) and torch.equal(grad, want_grad) and torch.equal(denom, d)
    was_clipped = (((ratio * a) > (clipped * a)).to(m.dtype) * m).sum() / d
    assert torch.equal(stats.clip_frac, was_clipped.detach())
    assert GRPOConfig().loss_type == "dapo" and GRPOConfig().ratio_level == "token" and GRPOConfig().loss == "ppo_clip"


def test_a_row_without_tokens_is_no_sequence():
    """A DP filler row (or an empty completion) leaves every divisor and the loss unchanged."""
    lp, old, mask, adv = hand_tensors()
    pad = lambda t, v: torch.cat([t, torch.full_like(t[:1], v)])
    for loss_type in LOSS_TYPES:
        obj = objective(loss_type)
        a, da, _ = obj(lp, mask, adv, old)
        b, db, stats = obj(pad(lp, -1.0), pad(mask, False), pad(adv, 3.0), pad(old, -2.0))
        assert torch.equal(a, b) and torch.equal(da, db) and float(stats.seqs) == 3 and float(stats.n) == 4


def test_builder_passes_the_family_and_max_new_tokens():
    rl = GRPOConfig(loss_type="dr_grpo", ratio_level="sequence", epsilon=3e-4, epsilon_high=4e-4)
    obj = build_objective("grpo", ObjectiveParts(rl, single_process, max_new_tokens=17))
    assert (obj.loss_type, obj.ratio_level, obj.loss, obj.max_completion_length) == ("dr_grpo", "sequence",
                                                                                    "ppo_clip", 17)


# -- one update: chunked equals unchunked, for every allowed combination ----------------------------------------------
def bare(policy_dir, split: Split, obj: GRPOObjective, needs: Needs, lr: float = 0.1) -> Updater:
    """An Updater over a plain transformers model in float64 (tests/update/test_updater.py's pattern) with ``obj``."""
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float64).train()
    score = lambda c: token_logprobs(model, c.input_ids, c.attention_mask, positions=c.completion_mask[:, 1:])
    view = PolicyView(model=model, temperature=1.0, logprobs=score, reference=None, call=lambda fn, *a: fn(*a))
    updater = Updater(model, lambda chunk, old: obj.chunk_loss(chunk, view, old), split, needs,
                      ahead=AheadPass(model, score))
    updater.attach(torch.optim.SGD(model.parameters(), lr=lr))
    return updater


# The fast tier checks both on the toy float64 model to 1e-12 (tests/objectives/test_loss_family_unit.py); these run
# the same on the tiny Qwen2 policy in the slow tier.
@pytest.mark.slow
@pytest.mark.parametrize("loss_type,ratio_level,loss", COMBOS)
def test_chunked_update_equals_unchunked_in_float64(tiny_policy_dir, loss_type, ratio_level, loss):
    """Two inner epochs against a frozen pi_old: the second sees ratios off 1 and clips; both chunkings equal one."""
    batch = synthetic_batch(UNEQUAL, seed=1)
    # L = 32 (rollout's default max_new_tokens). Qwen2's RMSNorm and attention softmax upcast to float32 even in a
    # float64 model, so their backward rounds the incoming gradient to float32: exact to ~1e-15 only when the whole
    # step's divisor and the chunks' carried scale differ by a power of two, as here (64 tokens, 8 and 8 x 32). With
    # L = 20 (160 vs 256) any loss_type shows ~7e-8, and so does the default loss on a batch of 65 tokens.
    obj = GRPOObjective(0.01, 0.01, loss_type=loss_type, ratio_level=ratio_level, loss=loss, max_completion_length=32)
    runs = {name: bare(tiny_policy_dir, Split(rows=8, mu_iterations=2, **kw), obj, Needs(pi_old=True), lr=1.0)
            for name, kw in (("whole", {}), ("fixed", {"n_micro": 4}), ("budget", {"max_tokens_per_micro": 40}))}
    before = params_of(runs["whole"].policy)
    results = {name: u.update(batch) for name, u in runs.items()}
    assert runs["fixed"].last_plan.real_chunks == 4 and runs["budget"].last_plan.real_chunks > 1
    metrics = {name: roll_up(r) for name, r in results.items()}
    assert metrics["whole"]["grpo/epoch2/clip_frac"] > 0  # the clip binds in the second epoch
    for name in ("fixed", "budget"):
        delta = max_rel_delta(before, params_of(runs["whole"].policy), params_of(runs[name].policy))
        print(f"{loss_type}/{ratio_level}/{loss} {name}: max relative delta {delta:.2e}")
        assert delta <= 5e-8
        for metric in ("grpo/loss", "grpo/denom", "grpo/seqs", "grpo/clip_frac_low", "grpo/clip_frac_high"):
            assert metrics[name][metric] == pytest.approx(metrics["whole"][metric], rel=1e-12, abs=1e-15), metric


@pytest.mark.slow
@pytest.mark.parametrize("loss_type,ratio_level,loss", COMBOS)
def test_one_chunk_is_bit_identical_to_the_whole_batch_objective_call(tiny_policy_dir, loss_type, ratio_level, loss):
    batch = synthetic_batch(UNEQUAL, seed=1)
    obj = objective(loss_type, ratio_level, loss)
    updater = bare(tiny_policy_dir, Split(rows=8), obj, Needs())
    updater.update(batch)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float64).train()
    logprobs = token_logprobs(model, batch.input_ids, batch.attention_mask, positions=batch.completion_mask[:, 1:])
    obj(logprobs, batch.completion_mask[:, 1:], batch.advantages)[0].backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), updater.policy.parameters()))


@pytest.mark.parametrize("budget", [8, 15, 24, 40, 192])
def test_a_token_budgeted_plan_never_splits_a_row(budget):
    """A sequence-level ratio needs all of a sequence's tokens in one chunk: every chunk holds whole rows, each row
    once, all its tokens (a row longer than the budget sits alone, whole)."""
    batch = synthetic_batch(UNEQUAL, seed=1)
    plan, _ = plan_update(batch, n_mini=1, n_micro=1, budget=budget)
    assert sorted(r for rows in plan.rows[0] for r in rows) == list(range(8))
    for k, rows in enumerate(plan.rows[0]):
        chunk = plan.chunk(batch, 0, k)
        for j, r in enumerate(rows):
            width = int(batch.attention_mask[r].sum())
            assert torch.equal(chunk.input_ids[j, :width], batch.input_ids[r, :width])
            assert int(chunk.completion_mask[j].sum()) == int(batch.completion_mask[r].sum())


# -- refusals ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,names", [
    ({"loss": "cispo", "ratio_level": "sequence"}, "ratio_level='sequence' with loss='cispo'"),
    ({"loss_type": "bnpo"}, "loss_type='bnpo'"),
    ({"loss_type": "token-mean"}, "loss_type='token-mean'"),
    ({"ratio_level": "seq"}, "ratio_level='seq'"),
    ({"loss": "sapo"}, "loss='sapo'"),
    ({"epsilon": 1.0}, "epsilon=1.0"),
    ({"epsilon": 1.5, "loss": "cispo"}, "epsilon=1.5"),
])
def test_refusals_name_the_knob(kw, names):
    with pytest.raises(ConfigError) as err:
        GRPOConfig(**kw)
    assert any(p.startswith(names) for p in err.value.problems), err.value.problems


def test_the_family_round_trips_through_yaml_and_the_parser_refuses_a_name():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--rl", type=GRPOConfig, default=GRPOConfig())
    cfg = parser.parse_args(["--rl.loss_type=seq-mean-token-sum", "--rl.ratio_level=sequence", "--rl.epsilon=3e-4"])
    again = parser.instantiate_classes(parser.parse_string(parser.dump(cfg))).rl
    assert (again.loss_type, again.ratio_level, again.loss) == ("seq-mean-token-sum", "sequence", "ppo_clip")
    with pytest.raises(Exception, match="bnpo"):
        parser.parse_args(["--rl.loss_type=bnpo"])


def test_peer_names_point_to_ours():
    with pytest.raises(ConfigError, match="use 'dapo'"):
        GRPOConfig(loss_type="bnpo")
    with pytest.raises(ConfigError, match="seq-mean-token-mean is 'grpo' here"):
        GRPOConfig(loss_type="seq-mean-token-mean")
    assert GRPOConfig(loss="cispo", epsilon=1.0, epsilon_high=4.0).epsilon == 1.0  # TRL's cispo, epsilon_high=5


@pytest.mark.parametrize("knob,value", [("loss_type", "grpo"), ("ratio_level", "sequence"), ("loss", "cispo")])
def test_opd_refuses_the_family(knob, value):
    from lightning_grpo.objectives.opd import OPDConfig
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.run_check import check_run

    opd = OPDConfig(teacher=PolicyConfig(path="teacher"))
    with pytest.raises(ConfigError) as err:
        check_run(PolicyConfig(), GRPOConfig(**{knob: value}), RolloutConfig(), opd, "opd")
    assert [p for p in err.value.problems if p.startswith(f"rl.{knob}={value!r}")]
