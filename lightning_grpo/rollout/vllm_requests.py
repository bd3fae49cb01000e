"""What goes into vLLM and what comes back: a prompt as vLLM's input (an image prompt's placeholders collapsed), a
row's ``SamplingParams``, and a completion as a ``Rollout`` (or, every logprob asked for, a ``VocabDraw``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lightning_grpo.rollout.base import (
    Prompt,
    Rollout,
    SamplingConfig,
    VocabDraw,
    finish_rollout,
)

ImageLoader = Callable[[Sequence, int | None], list]
"""Decodes a prompt's image references (``Prompt.images``) into images, naming the prompt id in its errors
(``lightning_grpo.data.images.load_images``): the data layer owns the reference formats, so it is passed in."""


def vllm_request(
    prompt: Prompt,
    image_token_id: int | None = None,
    load_images: ImageLoader | None = None,
) -> dict:
    """vLLM's input for ``prompt``: its tokens, and for an image prompt its decoded images as ``multi_modal_data``.

    vLLM expands each image placeholder itself (its processor replaces one ``<|image_pad|>`` per image with the
    image's token count), so the expanded runs our prompts carry (what the update scores) go back to one token each.
    The completion comes back alone, so the rollout keeps our expanded prompt.
    """
    if not prompt.images:
        return {"prompt_token_ids": list(prompt.token_ids)}
    if image_token_id is None:
        raise ValueError(
            f"prompt id={prompt.id} has images but the engine's model is text-only"
        )
    if load_images is None:
        raise ValueError(
            f"prompt id={prompt.id} has images but the engine has no image loader: build it with "
            "VLLMEngine(load_images=lightning_grpo.data.images.load_images)"
        )
    ids = prompt.token_ids
    collapsed = [
        t
        for i, t in enumerate(ids)
        if not (t == image_token_id and i and ids[i - 1] == image_token_id)
    ]
    return {
        "prompt_token_ids": collapsed,
        "multi_modal_data": {"image": load_images(prompt.images, prompt.id)},
    }


def model_image_token_id(model_path: Path) -> int | None:
    """A vision-language model's image placeholder id (None: a text-only model)."""
    config = json.loads((model_path / "config.json").read_text())
    return (
        config.get("image_token_id")
        if config.get("vision_config") is not None
        else None
    )


def sampling_params(s: SamplingConfig, seed: int):
    from vllm import SamplingParams

    return SamplingParams(
        n=1,
        temperature=s.temperature,
        top_p=s.top_p if s.temperature > 0 else 1.0,
        top_k=s.top_k if s.temperature > 0 else 0,  # 0 = off in vLLM too
        max_tokens=s.max_new_tokens,
        logprobs=0 if s.logprobs else None,  # 0 = only the sampled token's logprob
        seed=seed,
        # vLLM matches them in the completion text only, as HFEngine does
        stop=list(s.stop) or None,
    )


def completion_rollout(
    prompt: Prompt, completion, sampling: SamplingConfig, decode=None
) -> Rollout:
    ids = list(completion.token_ids)
    logprobs = (
        [step[t].logprob for step, t in zip(completion.logprobs, ids)]
        if sampling.logprobs
        else None
    )
    return finish_rollout(
        prompt,
        ids,
        completion.text,
        completion.finish_reason,
        logprobs,
        sampling,
        decode,
    )


def vocab_draw(completion, vocab: int) -> VocabDraw:
    """vLLM's per-step ``{token id: Logprob}`` dicts as one ``[T, V]`` tensor (-inf where vLLM left a token out)."""
    ids = list(completion.token_ids)
    logprobs = torch.full((len(ids), vocab), -math.inf)  # [T, V]
    for t, step in enumerate(completion.logprobs):
        index = torch.tensor(list(step.keys()))
        logprobs[t, index] = torch.tensor([lp.logprob for lp in step.values()])
    return VocabDraw(ids, logprobs)
