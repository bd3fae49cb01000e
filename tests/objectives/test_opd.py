"""On-policy distillation: the KL against hand-computed values, exactness under chunking, no ahead pass for the
direct form, and teachers that read token ids differently refused at setup."""

from __future__ import annotations

import math
import re
import runpy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import SMALL, max_rel_delta, params_of, synthetic_batch

from lightning_grpo.batch import pack_rollouts
from lightning_grpo.config import ConfigError, GRPOConfig
from lightning_grpo.metrics import roll_up
from lightning_grpo.module import GRPOModule
from lightning_grpo.objectives import OBJECTIVES
from lightning_grpo.objectives.kl import reverse_kl
from lightning_grpo.objectives.opd import OPDConfig, OPDObjective
from lightning_grpo.objectives.teacher import VocabularyMismatchError
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.timing import AHEAD
from lightning_grpo.tiny.build import build_tiny_policy

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier

UNEQUAL = [1, 12, 3, 20, 2, 7, 15, 4]  # completion lengths: chunk token counts differ a lot


def opd_module(policy_dir, teacher_dir, dtype="float64", micro=0, mini=0, **opd):
    rl = GRPOConfig(batch_per_replica=8, group_size=2, mini_batch_per_replica=mini, micro_batch_per_replica=micro,
                    max_grad_norm=0.0)
    module = GRPOModule(policy=PolicyConfig(path=str(policy_dir), dtype=dtype), rl=rl, objective="opd",
                        opd=OPDConfig(teacher=PolicyConfig(path=str(teacher_dir), dtype=dtype), **opd))
    module.configure_model()
    module.updater.attach(torch.optim.SGD(module.policy.parameters(), lr=0.1))
    return module


# -- the full-vocabulary KL --------------------------------------------------------------------------------------------
def test_reverse_kl_equals_the_dense_formula_in_value_and_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False).double()
    t_logits = torch.randn(37, 50, dtype=torch.float64)
    targets = torch.randint(0, 50, (37,))
    teacher = torch.log_softmax(t_logits, -1)

    kl, lp, tlp, ent = reverse_kl(hidden, head, targets, lambda a, b: teacher[a:b], temperature=0.7, chunk=5)
    (kl.sum() + 0.3 * lp.sum()).backward()
    g_hidden, g_head = hidden.grad.clone(), head.weight.grad.clone()

    hidden.grad, head.weight.grad = None, None
    logp = torch.log_softmax(head(hidden) / 0.7, -1)  # [N, V] at once
    dense_kl = (logp.exp() * (logp - teacher)).sum(-1)
    dense_lp = logp.gather(1, targets[:, None])[:, 0]
    (dense_kl.sum() + 0.3 * dense_lp.sum()).backward()
    assert torch.allclose(kl, dense_kl, rtol=1e-12, atol=1e-14) and torch.allclose(lp, dense_lp, rtol=1e-12)
    assert torch.equal(tlp, teacher.gather(1, targets[:, None])[:, 0])
    assert torch.allclose(ent, -(logp.exp() * logp).sum(-1).detach(), rtol=1e-12)  # grpo/entropy under OPD
    assert torch.allclose(g_hidden, hidden.grad, rtol=1e-10) and torch.allclose(g_head, head.weight.grad, rtol=1e-10)
    assert float(dense_kl.detach().min()) >= 0


def test_reverse_kl_is_zero_against_itself():
    torch.manual_seed(1)
    hidden, head = torch.randn(9, 8, dtype=torch.float64), torch.nn.Linear(8, 20, bias=False).double()
    with torch.no_grad():
        same = torch.log_softmax(head(hidden), -1)
        kl, _, _, _ = reverse_kl(hidden, head, torch.zeros(9, dtype=torch.long), lambda a, b: same[a:b], chunk=4)
    assert float(kl.abs().max()) < 1e-14


# -- the objective on hand-computed values -----------------------------------------------------------------------------
class _Fixed:
    """A teacher with fixed per-token logprobs (sampled form)."""

    def __init__(self, logprobs):
        self.logprobs = logprobs

    def token_logprobs(self, chunk):
        return self.logprobs


def test_sampled_estimator_value_and_gradient():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, -3.0]])
    mask = torch.tensor([[True, True, False]])
    chunk = synthetic_batch([3], prompt_len=1)
    chunk = replace(chunk, completion_mask=torch.cat([torch.zeros(1, 1, dtype=torch.bool), mask], 1))
    obj = OPDObjective(OPDConfig(teacher=PolicyConfig(), kl="sampled", beta_opd=2.0))
    obj.teacher = _Fixed(teacher)
    view = type("View", (), {"logprobs": lambda self, c: lp, "logprobs_and_entropy": None})()
    loss, denom, stats = obj.chunk_loss(chunk, view, None)
    k = [0.5, -1.0]  # log p_s - log p_t on the two counted tokens
    assert float(denom) == 2 and float(loss) == pytest.approx(2.0 * sum(k) / 2)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[2.0 * 0.5 / 2, 2.0 * -1.0 / 2, 0.0]]))  # beta * k / N per token
    assert float(stats.opd_kl) == pytest.approx(sum(k) / 2) and float(stats.teacher_logprob) == pytest.approx(-1.25)
    assert float(stats.ratio_mean) == 1.0 and float(stats.clip_frac) == 0.0


def test_direct_form_needs_no_pi_old_and_the_reward_form_does():
    assert not OPDObjective(OPDConfig(teacher=PolicyConfig())).needs_old_logprobs()
    assert OPDObjective(OPDConfig(teacher=PolicyConfig(), use_rewards=True)).needs_old_logprobs()


# -- exactness ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_rewards", [False, True], ids=["opd", "grpo+opd"])
@pytest.mark.parametrize("kl", ["full", "sampled"])
@pytest.mark.parametrize("n_micro", [2, 4, 8])
def test_chunked_step_equals_unchunked_on_unequal_lengths(tiny_policy_dir, tiny_teacher_dir, kl, use_rewards,
                                                          n_micro):
    batch = synthetic_batch(UNEQUAL, seed=1)
    whole = opd_module(tiny_policy_dir, tiny_teacher_dir, kl=kl, use_rewards=use_rewards)
    chunked = opd_module(tiny_policy_dir, tiny_teacher_dir, micro=8 // n_micro, kl=kl, use_rewards=use_rewards)
    before = params_of(whole.policy)
    expected = roll_up(whole.updater.update(batch))
    got = roll_up(chunked.updater.update(batch))
    assert max_rel_delta(before, params_of(whole.policy), params_of(chunked.policy)) <= 5e-8
    for name in ("grpo/loss", "opd/kl", "opd/teacher_logprob", "grpo/denom", "grpo/tokens", "grpo/entropy"):
        assert got[name] == pytest.approx(expected[name], rel=1e-12), name  # the roll-up telescopes too
    assert 0 < got["grpo/entropy"] < math.log(whole.policy.config.vocab_size)  # measured (main: NaN in every row)


def test_reward_form_is_grpo_plus_beta_times_the_kl_each_over_the_global_token_count(tiny_policy_dir,
                                                                                      tiny_teacher_dir):
    """Update of GRPO+OPD == update of GRPO + beta_opd x update of OPD alone (gradients add; plain SGD).

    To float32 precision, not float64's: Qwen2's RMSNorm casts to float32 even in a float64 model, so the
    gradient reaching it is rounded to float32, and round(g1 + g2) != round(g1) + round(g2) in the last bits
    (7e-8 relative here). Chunking, above, splits rows, not terms, and stays at float64 precision."""
    batch = synthetic_batch(UNEQUAL, seed=2)
    both = opd_module(tiny_policy_dir, tiny_teacher_dir, micro=2, use_rewards=True, beta_opd=0.5)
    alone = opd_module(tiny_policy_dir, tiny_teacher_dir, micro=4, beta_opd=0.5)
    rl = GRPOConfig(batch_per_replica=8, group_size=2, micro_batch_per_replica=1, max_grad_norm=0.0)
    grpo = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir), dtype="float64"), rl=rl)
    grpo.configure_model()
    grpo.updater.attach(torch.optim.SGD(grpo.policy.parameters(), lr=0.1))
    before = params_of(both.policy)
    for module in (both, alone, grpo):
        module.updater.update(batch)
    summed = {k: params_of(alone.policy)[k] + params_of(grpo.policy)[k] - before[k] for k in before}
    assert max_rel_delta(before, params_of(both.policy), summed) <= 1e-6


@pytest.mark.parametrize("kl", ["full", "sampled"])
def test_the_completions_log_shows_the_per_token_kl_the_loss_trains_on(tiny_policy_dir, tiny_teacher_dir, kl):
    """``last_rows`` of an OPD module carry ``kl_to_teacher``: per row, one figure per completion token, whose token
    mean is the objective's own ``opd/kl`` on the same rows; no advantage (the loss reads none)."""
    from types import SimpleNamespace

    from lightning_grpo.collect.rows import RewardParts, StepRows
    from lightning_grpo.rollout.base import Prompt, Rollout

    module = opd_module(tiny_policy_dir, tiny_teacher_dir, kl=kl)
    g = torch.Generator().manual_seed(0)
    rollouts = [Rollout(Prompt(id=i, token_ids=torch.randint(3, 60, (3,), generator=g).tolist()),
                        torch.randint(3, 60, (n,), generator=g).tolist(), "", "stop") for i, n in enumerate((2, 5, 1))]
    zeros = torch.zeros(3)
    module.collector = SimpleNamespace(last_rows=StepRows(1, rollouts, zeros, zeros, RewardParts()))
    rows = module.last_rows.samples(3, group_size=1)
    assert [len(r["kl_to_teacher"]) for r in rows] == [2, 5, 1] and all(r["advantage"] is None for r in rows)
    batch = pack_rollouts(rollouts, zeros, zeros, module.tokenizer.pad_token_id)
    with torch.no_grad():
        _, _, stats = module.scorer.chunk_loss(module.objective, batch, None, False)
    shown = [v for r in module.last_rows.figure.values(rollouts) for v in r]
    assert sum(shown) / len(shown) == pytest.approx(float(stats.opd_kl), rel=1e-9)

# -- the ahead pass gate -----------------------------------------------------------------------------------------------
def test_direct_form_runs_no_ahead_pass_at_n_mini_4(tiny_policy_dir, tiny_teacher_dir, monkeypatch):
    module = opd_module(tiny_policy_dir, tiny_teacher_dir, dtype="float32", mini=2)
    assert module.rl.n_mini == 4
    monkeypatch.setattr(module.updater.ahead, "compute", lambda *a: pytest.fail("the ahead pass ran"))
    seen = []
    real = module.forward_chunk
    module.updater.loop.forward_chunk = lambda chunk, old: (seen.append(old), real(chunk, old))[1]
    result = module.updater.update(synthetic_batch(UNEQUAL, seed=3))
    assert len(result.steps) == 4 and not any(s.skipped for s in result.steps)
    assert seen == [None] * 4 and module.timer.seconds(AHEAD) == 0.0


def test_reward_form_runs_the_ahead_pass_at_n_mini_4(tiny_policy_dir, tiny_teacher_dir):
    module = opd_module(tiny_policy_dir, tiny_teacher_dir, dtype="float32", mini=2, use_rewards=True)
    calls = []
    real = module.updater.ahead.compute
    module.updater.ahead.compute = lambda *a: (calls.append(1), real(*a))[1]
    module.updater.update(synthetic_batch(UNEQUAL, seed=3))
    assert calls == [1] and module.timer.seconds(AHEAD) > 0


# -- refusals ----------------------------------------------------------------------------------------------------------
def test_teacher_with_another_tokenizer_is_refused_at_setup_naming_both_sizes(tiny_policy_dir, tmp_path):
    from transformers import AutoTokenizer

    teacher = build_tiny_policy(tmp_path / "teacher", SMALL)
    tok = AutoTokenizer.from_pretrained(teacher)
    tok.add_tokens(["<extra_a>", "<extra_b>"])  # a different tokenizer (and vocabulary size)
    tok.save_pretrained(teacher)
    module = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir)), objective="opd",
                        opd=OPDConfig(teacher=PolicyConfig(path=str(teacher)), kl="sampled"))
    n = len(AutoTokenizer.from_pretrained(tiny_policy_dir))
    with pytest.raises(VocabularyMismatchError, match=rf"teacher vocabulary {n + 2} tokens .* student {n} tokens"):
        module.configure_model()


def test_teacher_with_another_vocab_size_is_refused_for_the_full_kl(tiny_policy_dir, tmp_path):
    teacher = build_tiny_policy(tmp_path / "teacher", replace(SMALL, vocab_size=128))
    module = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir)), objective="opd",
                        opd=OPDConfig(teacher=PolicyConfig(path=str(teacher)), kl="full"))
    with pytest.raises(VocabularyMismatchError, match=r"LM head 128\), student (\d+) tokens \(LM head \1\)"):
        module.configure_model()
    sampled = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir)), objective="opd",
                         opd=OPDConfig(teacher=PolicyConfig(path=str(teacher)), kl="sampled"))
    sampled.configure_model()  # same tokenizer, padded head: the sampled form reads ids of the tokenizer only


@pytest.mark.parametrize("kwargs,match", [
    ({"kl": "full", "teacher_engine": "vllm"}, "kl='full' with teacher_engine='vllm'"),
    ({"beta_opd": -1.0}, "beta_opd=-1.0"),
    ({"beta_opd": math.nan}, "beta_opd=nan"),
    ({"kl_chunk_mb": 0.0}, "kl_chunk_mb=0.0"),
    ({"teacher_engine": "vllm", "kl": "sampled", "teacher_device": "cuda:1"}, "teacher_device='cuda:1'"),
])
def test_opd_config_rules(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        OPDConfig(teacher=PolicyConfig(), **kwargs)


def test_opd_needs_a_teacher_and_no_k3_kl_without_rewards():
    with pytest.raises(ConfigError, match=r"opd.teacher=None") as err:
        GRPOModule(objective="opd", rl=GRPOConfig(batch_per_replica=8, group_size=2, beta=0.1))
    assert "rl.beta=0.1" in str(err.value)  # both problems at once


def test_an_opd_section_with_another_objective_is_refused():
    with pytest.raises(ValueError, match="set model.objective=opd"):
        GRPOModule(opd=OPDConfig(teacher=PolicyConfig(path="tiny:teacher")))
    GRPOModule(opd=OPDConfig())  # the section's defaults alone are no conflict (a printed config carries them)


def test_unknown_objective_lists_the_registered_ones():
    with pytest.raises(ValueError, match="known: grpo, opd"):
        GRPOModule(objective="ppo")


def test_the_documented_objective_registers_and_builds_from_its_parts(tmp_path):
    """docs/objectives.md's "Adding an objective" as written: its builder gets ``ObjectiveParts``, never the module."""
    text = (Path(__file__).parents[2] / "docs" / "objectives.md").read_text()
    example = re.search(r"## Adding an objective.*?```python\n(.*?)```", text, re.DOTALL).group(1)
    (tmp_path / "mine.py").write_text(example)
    try:
        runpy.run_path(str(tmp_path / "mine.py"))
        module = GRPOModule(objective="mine")
        assert type(module.objective).__name__ == "MyObjective"
        assert module.objective.dp_mean == module.dp_mean
    finally:
        OBJECTIVES.pop("mine", None)  # the registry is process-wide: other tests list its names
