"""Vision-language policies: image placeholders expanded in prompts, pixels materialized per chunk.

A Qwen-VL prompt holds one placeholder token per image patch group (``<|image_pad|>`` x
``t*h*w / merge_size**2``), and the model's 3-D rotary positions follow the image grids. So the
prompt tokens are expanded once, when the prompt is built for generation (the image is decoded
then, which is also where an unreadable image is reported), and the collected batch keeps only
the image *references*. ``materialize`` decodes and processes the images of one chunk's rows,
right before that chunk is scored; the pixel tensors die with the chunk's forward (and its
backward, when the vision tower trains). Pixels of the whole batch are never alive at once.

The divisor is unaffected: image placeholders are prompt positions, never in ``completion_mask``.

Works with the image processor and tokenizer of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint
(the ones ``AutoModelForImageTextToText`` loads); ``AutoProcessor`` is not needed (it also wants a
video processor, which needs torchvision).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_grpo.data.images import load_images
from lightning_grpo.rollout.base import Prompt

IMAGE_TOKEN = "<|image_pad|>"
"""The placeholder token Qwen-VL chat templates put where an image goes (one per image before expansion)."""
VISION_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_pad|>",
)


@dataclass(frozen=True)
class VisionInputs:
    """The processed images of some rows, in row order (what the model's forward takes besides tokens).

    Attributes:
        pixel_values: ``[P, C*t*p*p]`` flattened patches of every image of the rows, image after image.
        image_grid_thw: ``[I, 3]`` int64 (temporal, height, width) patch grid of each image.
        mm_token_type_ids: ``[B, T]`` int, 1 on image placeholders, 0 elsewhere (the model's 3-D positions).
    """

    pixel_values: Tensor
    image_grid_thw: Tensor
    mm_token_type_ids: Tensor

    def as_kwargs(self) -> dict[str, Tensor]:
        return {
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "mm_token_type_ids": self.mm_token_type_ids,
        }


class VisionProcessor:
    """Image side of a vision-language policy: expands placeholders and turns images into model inputs.

    Args:
        image_processor: the checkpoint's image processor (``AutoImageProcessor``).
        image_token_id: id of the image placeholder token in the tokenizer.
        dtype: floating dtype the pixels are cast to (the policy's).

    Example::

        vision = VisionProcessor.from_pretrained(folder, tokenizer, dtype=torch.float32)
        prompt = vision.expand(prompt)              # placeholders x grid size, images decoded once
        inputs = vision.materialize(chunk)          # pixels of this chunk's rows only
    """

    def __init__(
        self, image_processor, image_token_id: int, dtype: torch.dtype = torch.float32
    ) -> None:
        self.image_processor = image_processor
        self.image_token_id = int(image_token_id)
        self.merge_size = int(getattr(image_processor, "merge_size", 2))
        self.dtype = dtype
        self.special_ids: tuple[int, ...] = (self.image_token_id,)
        """Vision tokens a completion must never hold (engines end it before one: ``SamplingConfig``)."""

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, tokenizer, dtype: torch.dtype = torch.float32
    ) -> VisionProcessor:
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(folder)
        token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(
                f"policy at {folder}: its tokenizer has no {IMAGE_TOKEN} token; a Qwen-VL checkpoint's "
                "tokenizer is needed for image prompts"
            )
        vision = cls(image_processor, token_id, dtype)
        vocab = tokenizer.get_vocab()
        vision.special_ids = tuple(
            sorted({token_id} | {vocab[t] for t in VISION_TOKENS if t in vocab})
        )
        return vision

    # -- prompts ---------------------------------------------------------------------------------------------------
    def process(self, images: Sequence) -> tuple[Tensor, Tensor]:
        """``(pixel_values [P, D], image_grid_thw [I, 3])`` of decoded images."""
        out = self.image_processor(images=list(images), return_tensors="pt")
        return out["pixel_values"].to(self.dtype), out["image_grid_thw"].long()

    def tokens_per_image(self, grid_thw: Tensor) -> list[int]:
        """Placeholder tokens each image expands to: ``t*h*w / merge_size**2``."""
        return (grid_thw.prod(-1) // self.merge_size**2).tolist()

    def expand(self, prompt: Prompt) -> Prompt:
        """``prompt`` with each image placeholder repeated to its image's token count (decodes its images).

        Raises:
            BadImageError: an image cannot be read (names the prompt id and the image's path).
            ValueError: the prompt's placeholders and its images do not pair up.
        """
        if not prompt.images:
            return prompt
        _, grid = self.process(load_images(prompt.images, prompt.id))
        counts = iter(self.tokens_per_image(grid))
        placeholders = sum(t == self.image_token_id for t in prompt.token_ids)
        if placeholders != len(prompt.images):
            raise ValueError(
                f"prompt id={prompt.id}: {len(prompt.images)} images but {placeholders} {IMAGE_TOKEN} tokens after "
                "the chat template; the template must place one per {'type': 'image'} part"
            )
        ids: list[int] = []
        for t in prompt.token_ids:
            ids.extend([t] * next(counts) if t == self.image_token_id else [t])
        return Prompt(
            prompt.id,
            ids,
            prompt.text,
            prompt.answer,
            prompt.meta,
            prompt.messages,
            prompt.images,
        )

    def for_generation(
        self, prompts: Sequence[Prompt], group_size: int, input_ids: Tensor
    ) -> VisionInputs | None:
        """Inputs of ``group_size`` rows per prompt (``input_ids`` ``[N, L]``, left-padded): each prompt's images
        are decoded and processed once, their pixels repeated for its rows."""
        pixels = []
        grids = []
        for p in prompts:
            if p.images:
                px, grid = self.process(load_images(p.images, p.id))
                pixels += [px] * group_size
                grids += [grid] * group_size
        if not pixels:
            return None
        grid = torch.cat(grids)
        if int((input_ids == self.image_token_id).sum()) != sum(
            self.tokens_per_image(grid)
        ):
            raise ValueError(
                "prompts with images must have their placeholders expanded first "
                "(VisionProcessor.expand, as collect.prompts.step_prompts does)"
            )
        return VisionInputs(
            torch.cat(pixels), grid, (input_ids == self.image_token_id).int()
        )

    # -- chunks ----------------------------------------------------------------------------------------------------
    def materialize(
        self,
        images: Sequence[tuple],
        input_ids: Tensor,
        ids: Sequence[int] | None = None,
    ) -> VisionInputs | None:
        """The model inputs of rows whose image references are ``images[i]`` and tokens ``input_ids[i]``.

        Args:
            images: per row, its image references (``()`` for a row without images).
            input_ids: ``[B, T]`` the rows' (expanded) tokens.
            ids: per row, the record id named in an error.

        Returns None when no row has an image.
        """
        flat = [
            (ids[i] if ids is not None else None, ref)
            for i, refs in enumerate(images)
            for ref in refs
        ]
        if not flat:
            return None
        decoded = [load_images([ref], rid)[0] for rid, ref in flat]
        pixels, grid = self.process(decoded)
        expected = sum(self.tokens_per_image(grid))
        found = int((input_ids == self.image_token_id).sum())
        if found != expected:
            raise ValueError(
                f"rows hold {found} image placeholder tokens but their images need {expected}: an "
                "image changed size since its prompt was built, the rows were cut, or a completion holds "
                "a vision token (engines cut before them: SamplingConfig.forbidden_token_ids)"
            )
        return VisionInputs(pixels, grid, (input_ids == self.image_token_id).int())


def is_vision_config(config) -> bool:
    """Whether a transformers config describes a vision-language model (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder of a Qwen-VL style model (``model.model.visual``), or None for a text-only model. Under
    peft (``policy.lora``) the transformers model is ``model.get_base_model()``."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(inner, "model", inner)
    for name in ("visual", "vision_tower", "vision_model"):
        tower = getattr(base, name, None)
        if isinstance(tower, nn.Module):
            return tower
    return None


def freeze_vision_tower(model: nn.Module) -> int:
    """Freeze the vision encoder (patch embedding and blocks); its merger (the projection into the language model)
    keeps training. Returns the number of parameters frozen."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    frozen = 0
    for name, p in tower.named_parameters():
        if not name.startswith("merger."):
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def touch_vision(loss: Tensor, model: nn.Module) -> Tensor:
    """``loss`` plus zero times every trainable vision parameter (the merger, and the tower when it trains).

    A chunk without pixels (a data-parallel filler, text-only rows) never runs the vision side, so its backward
    leaves those parameters out, and DDP, which expects every trainable parameter in the synced backward, fails
    on the next step. The zero term puts them in that backward with a zero gradient: the update is unchanged.
    """
    tower = vision_tower(model)
    params = [] if tower is None else [p for p in tower.parameters() if p.requires_grad]
    return loss + sum(p.sum() for p in params) * 0.0 if params else loss
