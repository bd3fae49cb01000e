"""A loop step's prompts: records -> engine prompts (a VLM's image placeholders expanded), and the sampling of a
loop step (its seed).

An unreadable image is met here, at the step that draws it: with ``data.on_bad_record: skip`` its record is left
out of the draw and ``with_skipped_groups`` puts its group back as empty rows, so the collected batch keeps the
config's size and those rows count in no divisor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_grpo.data.images import BadImageError
from lightning_grpo.rollout.base import Prompt, Rollout, SamplingConfig
from lightning_grpo.vision import VisionProcessor


def step_prompts(
    records, tokenizer, vision: VisionProcessor | None, on_bad_record: str = "error"
) -> tuple[list[Prompt], list[int]]:
    """``(prompts, skipped)``: the engine prompts of ``records`` (placeholders expanded for a VLM) and the indices of
    the records skipped for an unreadable image (``on_bad_record="skip"``; with ``"error"`` the ``BadImageError``,
    naming record id and path, propagates)."""
    prompts = []
    skipped = []
    for i, record in enumerate(records):
        prompt = record.to_prompt(tokenizer)
        if vision is not None:
            try:
                prompt = vision.expand(prompt)
            except BadImageError:
                if on_bad_record != "skip":
                    raise
                skipped.append(i)
        prompts.append(prompt)
    if skipped and len(skipped) == len(records):
        raise ValueError(
            f"every record of this loop step has an unreadable image (ids {[r.id for r in records]}); "
            "check the image paths of the data"
        )
    return prompts, skipped


def live_prompts(prompts: Sequence[Prompt], skipped: Sequence[int]) -> list[Prompt]:
    """The prompts that are drawn: every one but the skipped."""
    return [p for i, p in enumerate(prompts) if i not in skipped]


def with_skipped_groups(
    rollouts: list,
    prompts: Sequence[Prompt],
    skipped: Sequence[int],
    group_size: int,
    eos_token_id: int,
) -> tuple[list, Tensor]:
    """``(rollouts of every prompt, live [N] bool)``: each skipped prompt's group is put back in place as empty
    completions of a one-token prompt with no image, so the collected batch keeps its configured size. Those rows
    carry no completion token: they add nothing to the loss or to the divisor (their advantage is set to 0)."""
    out = []
    live = []
    drawn = iter(rollouts)
    for i, p in enumerate(prompts):
        if i in skipped:
            empty = Prompt(p.id, [eos_token_id], "", p.answer, p.meta)
            out += [Rollout(empty, [], "", "length") for _ in range(group_size)]
            live += [False] * group_size
        else:
            out += [next(drawn) for _ in range(group_size)]
            live += [True] * group_size
    return out, torch.tensor(live)


@dataclass(frozen=True)
class StepSampling:
    """How a loop step samples: the rollout section's knobs plus one reproducible seed per (seed, loop step, rank).

    Built once the data-parallel size and this rank are known (the seed depends on both).
    """

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]
    logprobs: bool
    """Whether the engine returns the sampler's logprobs (rollout correction needs them)."""
    seed: int
    """The run's seed (``model.seed``)."""
    world: int = 1
    rank: int = 0
    forbidden_token_ids: tuple[int, ...] = ()
    """Tokens a completion must never hold (a VLM's vision tokens)."""

    @classmethod
    def of(
        cls,
        rollout,
        logprobs: bool,
        seed: int,
        world: int,
        rank: int,
        vision: VisionProcessor | None,
    ) -> StepSampling:
        """The sampling of the ``rollout`` section on this rank (a VLM's vision tokens forbidden in completions)."""
        forbidden = vision.special_ids if vision is not None else ()
        return cls(
            rollout.max_new_tokens,
            rollout.temperature,
            rollout.top_p,
            rollout.top_k,
            tuple(rollout.stop or ()),
            logprobs,
            seed,
            world,
            rank,
            forbidden,
        )

    def at(self, loop_step: int) -> SamplingConfig:
        """The sampling of the draw for ``loop_step`` (engines derive one stream per prompt and sample from it)."""
        seed = (self.seed * 1_000_003 + loop_step) * max(self.world, 1) + self.rank
        return SamplingConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            logprobs=self.logprobs,
            seed=seed,
            stop=self.stop,
            forbidden_token_ids=self.forbidden_token_ids,
        )
