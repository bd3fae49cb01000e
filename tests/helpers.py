"""Shared test helpers: a small policy spec, synthetic collected batches, update deltas."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from lightning_grpo.batch import RolloutBatch
from lightning_grpo.policy import TinyPolicySpec

SMALL = TinyPolicySpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)

QUICKSTART_ARGS = [
    "--config", str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"),
    # shortened: 2 loop steps, a validation after each, 16 held-out prompts, a shorter warm start (cached per session)
    "--trainer.max_steps=2", "--trainer.val_check_interval=1", "--data.val_size=16",
    "--model.policy.warm_start_steps=30",
]
"""``lightning-grpo fit`` arguments of the shortened quickstart (the quickstart_run fixture, the sweep test)."""


def synthetic_batch(completion_lens: list[int], prompt_len: int = 4, vocab: int = 80, seed: int = 0,
                    with_logprobs: bool = False) -> RolloutBatch:
    """A collected batch with the given completion lengths (0 = an empty completion), right-padded."""
    g = torch.Generator().manual_seed(seed)
    n, width = len(completion_lens), prompt_len + max(max(completion_lens), 1)
    ids = torch.randint(4, vocab, (n, width), generator=g)
    attn = torch.zeros(n, width, dtype=torch.bool)
    comp = torch.zeros(n, width, dtype=torch.bool)
    for i, c in enumerate(completion_lens):
        attn[i, : prompt_len + c] = True
        comp[i, prompt_len : prompt_len + c] = True
    ids = ids.masked_fill(~attn, 0)
    lp = (-torch.rand(n, width, generator=g) * 2).masked_fill(~comp, 0) if with_logprobs else None
    return RolloutBatch(
        input_ids=ids, attention_mask=attn, completion_mask=comp,
        advantages=torch.randn(n, generator=g), rewards=torch.rand(n, generator=g),
        group_ids=torch.arange(n) // 2, sample_ids=torch.arange(n), rollout_logprobs=lp,
    )


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def max_rel_delta(before: dict, a: dict, b: dict) -> float:
    """max |Δa - Δb| / max |Δa| over all parameters: compares the *updates*, not the weights."""
    num = max(float((a[k] - b[k]).abs().max()) for k in before)
    den = max(float((a[k] - before[k]).abs().max()) for k in before)
    return num / den


def clone(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)
