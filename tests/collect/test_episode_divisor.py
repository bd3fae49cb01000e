"""Token-in token-out through the Collector (fake engine, no model): an episode's environment tokens are context,
never in the loss mask, so never in a divisor, and its ids reach the batch as the engine gave them."""

from __future__ import annotations

import torch

from lightning_grpo.collect import Collector, Drawer, StepSampling
from lightning_grpo.config import GRPOConfig
from lightning_grpo.data.stream import PromptRecord
from lightning_grpo.objectives.grpo import GRPOObjective
from lightning_grpo.rollout.base import Rollout
from lightning_grpo.tiny.tokenizer import make_char_tokenizer

TURNS = [5, 6, 90, 91, 92, 7, 8]
"""Sampled, sampled, three tool-result ids, sampled, sampled."""
MASK = [True, True, False, False, False, True, True]


class EpisodeEngine:
    """Each completion is a two-turn episode: the model's ids around a tool result's (``model_mask`` False)."""

    def generate(self, prompts, group_size, sampling):
        out = []
        for p in prompts:
            for k in range(group_size):
                out.append(Rollout(p, TURNS[:5 + 2 * k], "episode", "stop", model_mask=MASK[:5 + 2 * k]))
        return out


def rewards(rollouts):
    return torch.tensor([float(len(r.token_ids)) for r in rollouts]), {}


def test_environment_tokens_are_context_outside_the_mask_and_the_divisor():
    rl = GRPOConfig(batch_per_replica=2, group_size=2, micro_batch_per_replica=2)
    sampling = StepSampling(8, 1.0, 1.0, 0, (), False, seed=0)
    collector = Collector(Drawer(EpisodeEngine(), None), rewards, rl=rl, max_new_tokens=8, sampling=sampling,
                          tokenizer=make_char_tokenizer(), prompts=None)
    batch, _ = collector.collect([PromptRecord(0, "1+1=", "2", {})], loop_step=0)
    prompt = len(collector.last_rows.rollouts[0].prompt.token_ids)
    assert batch.input_ids[0, prompt:prompt + 5].tolist() == TURNS[:5]  # ids as sampled, never re-tokenized
    assert batch.input_ids[1, prompt:prompt + 7].tolist() == TURNS
    assert batch.completion_mask[0, prompt:prompt + 5].tolist() == MASK[:5]
    assert batch.completion_mask.sum(-1).tolist() == [2, 4]  # the model's tokens only
    logprobs = torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1, dtype=torch.float64)
    _, denom, _ = GRPOObjective()(logprobs, batch.completion_mask[:, 1:], batch.advantages)
    assert float(denom) == 6  # 2 + 4 sampled tokens: the 3 + 3 tool tokens count in no divisor
