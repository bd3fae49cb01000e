"""Rollout correction made visible: the real vLLM engine samples in bfloat16, the trainer scores in float32.

Its own module: one in-process engine per module (two cannot live side by side, see
test_rollout_vllm_logprobs_mode.py). The gap between the sampler's and the trainer's logprobs is what
``rl.rollout_correction`` exists for; here it is measured on real generations, and ``tis`` changes the update
exactly as its formula says.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from test_rollout_correction import reference_loss

from lightning_grpo.batch import pack_rollouts
from lightning_grpo.correction import RolloutCorrection, derived_metrics
from lightning_grpo.logprobs import token_logprobs
from lightning_grpo.metrics import roll_up
from lightning_grpo.objectives.grpo import GRPOObjective
from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout.base import Prompt, SamplingConfig
from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.heavy]
# heavy: an in-process vLLM engine (the contract suite keeps one in make test); CI and `make test-integration` run it

BF16 = VLLMConfig(dtype="bfloat16", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def sampled(tiny_policy_dir):
    """8 bf16 completions (2 prompts x 4) with the engine's logprobs, packed as a collected batch."""
    model, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir), dtype="float32"))
    engine = VLLMEngine(tiny_policy_dir, BF16, sampler_logprobs=True)
    try:
        prompts = [Prompt(id=i, token_ids=tok(t)["input_ids"], text=t) for i, t in enumerate(["12+34=", "7*8="])]
        rollouts = engine.generate(prompts, 4, SamplingConfig(max_new_tokens=16, logprobs=True, seed=3))
    finally:
        engine.close()
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75, 0.5, -1.0, 0.8, -0.3])
    batch = pack_rollouts(rollouts, adv, torch.zeros(8), tok.pad_token_id)
    return model.train(), batch


def test_the_bf16_sampler_differs_from_the_fp32_trainer_and_the_metrics_show_it(sampled):
    model, batch = sampled
    mask = batch.completion_mask[:, 1:]
    lp = token_logprobs(model, batch.input_ids, batch.attention_mask, positions=mask)
    obj = GRPOObjective(0.2, 0.2, correction=RolloutCorrection(mode="tis", threshold=1.05))
    _, _, stats = obj(lp, mask, batch.advantages, None, None, batch.rollout_logprobs[:, 1:])
    metrics = roll_up(_result([stats]))
    metrics |= derived_metrics(metrics)
    gap = ((lp.detach() - batch.rollout_logprobs[:, 1:]).abs() * mask).sum() / mask.sum()
    print({k: round(v, 5) for k, v in metrics.items() if k.startswith("correction/")})
    assert metrics["correction/logprob_gap_mean"] == pytest.approx(float(gap), rel=1e-5)
    # ~7e-4 on this near-uniform tiny policy: 1000x the float32 engine's gap (~5e-7, test_rollout_vllm.py)
    assert metrics["correction/logprob_gap_mean"] > 1e-4
    assert metrics["correction/is_weight_max"] > 1.001 and metrics["correction/ess"] < 1.0
    assert metrics["correction/token_mult_prob_error"] > 1.0001
    assert metrics["correction/training_ppl"] != pytest.approx(metrics["correction/rollout_ppl"], rel=1e-5)


def test_tis_changes_the_update_exactly_as_its_formula_says(sampled):
    """The gradient with tis equals the reference (float64 loops, test_rollout_correction.py) on real engine data,
    and differs from the uncorrected gradient."""
    model, batch = sampled
    mask = batch.completion_mask[:, 1:]
    lp = token_logprobs(model, batch.input_ids, batch.attention_mask, positions=mask).detach().double()
    roll = batch.rollout_logprobs[:, 1:].double()
    adv = batch.advantages.double()
    old = lp + 0.05 * torch.sin(torch.arange(lp.numel(), dtype=torch.float64)).view_as(lp)  # pi_old off the policy
    grads = {}
    for name, corr in (("tis", RolloutCorrection(mode="tis", threshold=1.3)), ("off", None)):
        x = lp.clone().requires_grad_()
        loss = GRPOObjective(0.2, 0.28, correction=corr)(x, mask, adv, old, None, roll)[0]
        (grads[name],) = torch.autograd.grad(loss, x)
    x = lp.clone().requires_grad_()
    (expected,) = torch.autograd.grad(reference_loss(x, old, roll, mask, adv, "tis", "token"), x)
    assert torch.allclose(grads["tis"], expected, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(grads["tis"], grads["off"], rtol=1e-3)


def _result(chunks):
    from types import SimpleNamespace

    return SimpleNamespace(chunks=chunks, steps=[], chunk_epochs=[0] * len(chunks), consecutive_skips=0,
                           discarded_chunks=0)
