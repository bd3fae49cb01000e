"""The consistency certificate (``certificate.py``): the figures by hand, the config's refusals, the transformers
engine against the trainer with two controls that must fail, and a fit that logs ``mismatch/*`` and stops on a
breach (tests/test_certificate_vllm.py runs the in-process vLLM engine)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import StepRecorder, fit_tiny, tiny_grpo_module

from lightning_grpo.certificate import Certifier, ConsistencyError, breach, certify, compare, probe_prompts
from lightning_grpo.config import CertificateConfig, ConfigError, RolloutConfig
from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout.hf import HFEngine

pytestmark = pytest.mark.heavy  # a fit per test: CI and `make test-integration`

STRICT = CertificateConfig(max_kl=1e-6, max_logprob_diff=1e-4, max_new_tokens=8)
"""float32 engine and trainer agree far inside these (measured: KL < 1e-7, |delta| < 6e-6)."""


def test_the_figures_of_two_hand_written_distributions():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.9, 0.1, 0.0]], dtype=torch.float64).log()  # token 2: impossible on both
    q = torch.tensor([[0.25, 0.75, 0.0], [0.9, 0.1, 0.0]], dtype=torch.float64).log()
    figures = compare(p, q)
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert figures.kl_mean == pytest.approx(kl0 / 2, rel=1e-12)
    assert figures.kl_max == pytest.approx(kl0, rel=1e-12)
    assert figures.logprob_diff_max == pytest.approx(math.log(2), rel=1e-6)
    assert figures.top1_agree == 0.5  # position 0: a tie (first wins) against token 1
    assert figures.positions == 2


def test_a_token_the_trainer_cannot_draw_makes_the_kl_infinite():
    p = torch.tensor([[0.5, 0.5]]).log()
    q = torch.tensor([[1.0, 0.0]]).log()
    assert math.isinf(compare(p, q).kl_mean)


@pytest.mark.parametrize("field, value", [("max_kl", 0.0), ("max_kl", -1e-3), ("max_kl", float("nan")),
                                          ("max_logprob_diff", 0.0), ("prompts", 0), ("on_breach", "raise")])
def test_a_bad_certificate_knob_is_refused_naming_it(field, value):
    with pytest.raises(ConfigError, match=f"(?s)rollout.certificate.*{field}="):
        CertificateConfig(**{field: value})


@pytest.mark.parametrize("engine", ["vllm_server", "replay"])
def test_the_certificate_with_an_engine_that_cannot_return_its_distribution_is_refused(engine):
    with pytest.raises(ConfigError, match=f"certificate with engine='{engine}'.*use one of them"):
        RolloutConfig(engine=engine, replay_path="x.jsonl", certificate=CertificateConfig())


@pytest.fixture(scope="module")
def trainer(tiny_policy_dir):
    policy, tokenizer = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    return policy, tokenizer


def test_the_transformers_engine_is_certified_against_the_trainer(trainer):
    """Its decode path (left-padded batch, KV cache) against the trainer's full forward on the same tokens."""
    policy, tokenizer = trainer
    figures = certify(HFEngine(policy, tokenizer), policy, probe_prompts(tokenizer, 4), STRICT)
    assert figures.positions >= 8
    assert abs(figures.kl_mean) < 1e-7 and figures.logprob_diff_max < 1e-4 and figures.top1_agree == 1.0
    assert breach(figures, STRICT) == []


def test_controls_a_stale_engine_and_a_bfloat16_engine_fail_the_certificate(trainer):
    policy, tokenizer = trainer
    prompts = probe_prompts(tokenizer, 4)
    stale = copy.deepcopy(policy)
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    assert certify(HFEngine(stale, tokenizer), moved, prompts, STRICT).kl_mean > 1e-3  # a sync that never landed
    bf16 = copy.deepcopy(policy).to(torch.bfloat16)
    figures = certify(HFEngine(bf16, tokenizer), policy, prompts, STRICT)  # measured: KL 4e-7, |delta| 5e-3
    assert figures.logprob_diff_max > 1e-3 and breach(figures, STRICT) != []


def test_a_breach_warns_or_stops_with_the_step_the_figures_and_the_causes(trainer):
    policy, tokenizer = trainer
    bf16 = HFEngine(copy.deepcopy(policy).to(torch.bfloat16), tokenizer)
    prompts = probe_prompts(tokenizer, 2)
    with pytest.warns(UserWarning, match=r"certificate at loop step 4.*\| [0-9.e-]+ > rollout.certificate.max_logprob_diff"):
        Certifier(STRICT, policy, prompts, after_syncs=True)(bf16, loop_step=3)
    stop = CertificateConfig(max_logprob_diff=1e-4, max_new_tokens=8, on_breach="stop")
    with pytest.raises(ConsistencyError, match="loop step 1.*prefix cache.*bfloat16 head"):
        Certifier(stop, policy, prompts, after_syncs=True)(bf16, loop_step=0)


def test_without_syncs_only_the_first_loop_step_is_certified_and_later_ones_log_nan(trainer):
    policy, tokenizer = trainer
    certifier = Certifier(STRICT, policy, probe_prompts(tokenizer, 1), after_syncs=False)
    first = certifier(HFEngine(policy, tokenizer), 0)
    second = certifier(HFEngine(policy, tokenizer), 1)
    assert abs(first["mismatch/kl_mean"]) < 1e-7 and math.isnan(second["mismatch/kl_mean"])


def test_a_fit_logs_the_certificate_and_stops_on_a_breach(tiny_policy_dir, tmp_path):
    module = tiny_grpo_module(tiny_policy_dir)
    module.rollout_cfg.certificate = CertificateConfig(max_new_tokens=4, prompts=2)
    recorder = StepRecorder()
    fit_tiny(module, tmp_path / "ok", 2, callbacks=[recorder])
    first, second = recorder.metrics
    assert abs(first["mismatch/kl_mean"]) < 1e-7 and first["mismatch/top1_agree"] == 1.0
    assert math.isnan(second["mismatch/kl_mean"])  # the hf engine samples with the policy: no sync to certify
    module = tiny_grpo_module(tiny_policy_dir)
    module.rollout_cfg.certificate = CertificateConfig(max_new_tokens=4, prompts=2, max_logprob_diff=1e-12,
                                                       on_breach="stop")
    with pytest.raises(ConsistencyError, match="loop step 1: .*max_logprob_diff=1e-12"):
        fit_tiny(module, tmp_path / "stop", 2)


def test_the_certify_verb_prints_the_table_and_fails_on_a_breach(tiny_policy_dir, tmp_path, capsys):
    from lightning_grpo.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  policy:\n    path: {tiny_policy_dir}\n  rollout:\n    engine: hf\n")
    with pytest.raises(SystemExit) as ok:
        main(["certify", "--config", str(config)])
    out = capsys.readouterr().out
    assert ok.value.code == 0 and "KL(engine||trainer) mean" in out and out.rstrip().endswith("certified")
    config.write_text(config.read_text() + "    certificate:\n      max_logprob_diff: 1.0e-12\n")
    with pytest.raises(SystemExit) as breached:
        main(["certify", "--config", str(config)])
    assert breached.value.code == 1 and "BREACH: max |delta logprob|" in capsys.readouterr().out
