"""Per-chunk logprobs of the policy and of the frozen reference: what objectives and the ahead pass score with.

Every score is the fused completion-only head (``logprobs.token_logprobs``) at the sampling temperature, run as a
forward of the model (``root_call``: FSDP2 gathers its root around it). A chunk with images is scored with its own
pixels, decoded when that chunk is scored, so only one chunk's pixels are alive at a time.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import torch
from torch import Tensor, nn

from lightning_grpo import lora
from lightning_grpo.batch import RolloutBatch, pack_rollouts
from lightning_grpo.collect.rows import StepRows, TokenFigure
from lightning_grpo.distributed import root_call
from lightning_grpo.logprobs import fuses_head, token_logprobs
from lightning_grpo.objectives.base import ExplainsTokens, Objective, PolicyView, Stats
from lightning_grpo.packing import PADDED, Packing
from lightning_grpo.rollout.base import Rollout
from lightning_grpo.update.ahead import eval_mode
from lightning_grpo.vision import VisionInputs, VisionProcessor, touch_vision


class ChunkScorer:
    """Scores chunks with the policy, the reference and the vision side a module built.

    Args:
        policy: the trained model.
        ref: the frozen reference copy, or None (none needed, or LoRA: the policy with its adapter off).
        vision: a vision-language policy's image side (None: text-only).
        has_reference: whether the objective may ask for reference logprobs.
        temperature: the sampling temperature (``rollout.temperature``).
        keep_bytes: the LM-head logits kept per slice (``rl.logits_keep_mb``).
        packing: whether chunks are scored padding-free (``rl.packed`` resolved for this policy; ``packing.py``).
    """

    def __init__(
        self,
        policy: nn.Module,
        ref: nn.Module | None,
        vision: VisionProcessor | None,
        has_reference: bool,
        temperature: float,
        keep_bytes: int,
        packing: Packing = PADDED,
    ) -> None:
        self.policy = policy
        self.ref = ref
        self.vision = vision
        self.has_reference = has_reference
        self.temperature = temperature
        self.keep_bytes = keep_bytes
        self.packing = packing

    def device(self) -> torch.device:
        """Where the policy is now (a Trainer moves it after the scorer is built)."""
        return next(self.policy.parameters()).device

    @property
    def packed(self) -> bool:
        """Whether chunks are packed now (on the policy's current device)."""
        return self.packing.on(self.device().type)

    def pi_old(self, chunk: RolloutBatch) -> Tensor:
        """``[B, T-1]`` the policy's logprobs of ``chunk`` (the ahead pass's frozen pi_old)."""
        return self.logprobs(self.policy, chunk.to(self.device()))

    def policy_view(
        self, chunk: RolloutBatch | None = None, vision: VisionInputs | None = None
    ) -> PolicyView:
        """What an objective may ask of the policy (``objectives/base.py``). ``vision``: ``chunk``'s pixels,
        materialized once and shared by the policy and the reference (another chunk materializes its own)."""
        scores = _ChunkScores(self, chunk, vision)
        reference = scores.reference if self.has_reference else None
        call = functools.partial(root_call, self.policy)
        return PolicyView(
            model=self.policy,
            temperature=self.temperature,
            logprobs=scores.logprobs,
            reference=reference,
            call=call,
            logprobs_and_entropy=scores.with_entropy,
        )

    def chunk_loss(
        self,
        objective: Objective,
        chunk: RolloutBatch,
        old_logprobs: Tensor | None,
        sampler_is_pi_old: bool,
    ) -> tuple[Tensor, Tensor, Stats]:
        """The objective on one chunk: it asks the policy (and reference, teacher) for what it needs.

        ``sampler_is_pi_old``: ``rl.rollout_correction.mode=bypass`` (``plan.pi_old_source``): the sampler's logprobs
        stand in for a pi_old the ahead pass did not record."""
        chunk = chunk.to(self.device())
        # this chunk's pixels only; freed once its backward has run
        vision = self.materialize(chunk)
        if old_logprobs is None and sampler_is_pi_old:
            if chunk.rollout_logprobs is None:
                raise ValueError(
                    "rl.rollout_correction.mode=bypass but the engine returned no sampler logprobs"
                )
            old_logprobs = chunk.rollout_logprobs[:, 1:]
        loss, denom, stats = objective.chunk_loss(
            chunk, self.policy_view(chunk, vision), old_logprobs
        )
        # no pixels: DDP still needs the vision side in the backward
        if vision is None and self.vision is not None:
            loss = touch_vision(loss, self.policy)
        return loss, denom, stats

    def token_figures(
        self, objective: ExplainsTokens, pad_id: int, rollouts: list[Rollout]
    ) -> list[list[float]]:
        """Per row of ``rollouts``, ``objective``'s figure at each completion token the loss counts, with the policy
        as it is now (the completions log calls it for the few rows it shows, after the loop step's update)."""
        zeros = torch.zeros(len(rollouts))
        chunk = pack_rollouts(rollouts, zeros, zeros, pad_id).to(self.device())
        with torch.no_grad(), eval_mode(self.policy):
            values = objective.token_figures(
                chunk, self.policy_view(chunk, self.materialize(chunk))
            )
        mask = chunk.completion_mask[:, 1:]  # [B, T-1]
        return [values[i][mask[i]].tolist() for i in range(len(rollouts))]

    def explained(self, rows: StepRows, objective: Objective, tokenizer) -> StepRows:
        """``rows`` with the objective's per-token figure when it has one (OPD's KL to the teacher:
        ``ExplainsTokens``), measured on demand (``token_figures``) for the rows a log shows."""
        if not isinstance(objective, ExplainsTokens):
            return rows
        values = functools.partial(
            self.token_figures, objective, tokenizer.pad_token_id
        )
        figure = TokenFigure(objective.token_figure, values)
        return replace(rows, figure=figure, uses_advantages=objective.uses_advantages())

    def reference_logprobs(
        self, chunk: RolloutBatch, vision: VisionInputs | None = None
    ) -> Tensor:
        """``[B, T-1]`` logprobs of the frozen reference: the copy, or under LoRA the policy with its adapter off."""
        if self.ref is not None:
            with torch.no_grad(), eval_mode(self.ref):
                return self.logprobs(self.ref, chunk, vision)
        with torch.no_grad(), eval_mode(self.policy), lora.reference_mode(self.policy):
            return self.logprobs(self.policy, chunk, vision)

    def logprobs(
        self,
        model: nn.Module,
        chunk: RolloutBatch,
        vision: VisionInputs | None = None,
        entropy: str | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``[B, T-1]`` logprobs of the completion tokens at the sampling temperature, 0 at prompt and padding. A chunk
        with images is scored with ``vision`` (materialized here when not given). ``entropy`` (``"value"``/``"grad"``):
        also the policy's entropy there, ``(logprobs, entropy)`` (``logprobs.token_logprobs``)."""
        vision = vision if vision is not None else self.materialize(chunk)
        extra = (
            None
            if vision is None
            else {k: v.to(self.device()) for k, v in vision.as_kwargs().items()}
        )
        return root_call(
            model,
            token_logprobs,
            model,
            chunk.input_ids,
            chunk.attention_mask,
            positions=chunk.completion_mask[:, 1:],
            temperature=self.temperature,
            keep_bytes=self.keep_bytes,
            model_inputs=extra,
            entropy=entropy,
            packed=self.packed,
        )

    def materialize(self, chunk: RolloutBatch) -> VisionInputs | None:
        """The pixels of ``chunk``'s rows (decoded and processed now), or None for a chunk without images."""
        if chunk.images is None or self.vision is None:
            return None
        return self.vision.materialize(
            chunk.images, chunk.input_ids.cpu(), chunk.group_ids.tolist()
        )


class _ChunkScores:
    """What a ``PolicyView`` scores with: ``chunk``'s pixels, materialized once, go with every score of that chunk
    (any other chunk materializes its own)."""

    def __init__(
        self,
        scorer: ChunkScorer,
        chunk: RolloutBatch | None,
        vision: VisionInputs | None,
    ) -> None:
        self.scorer = scorer
        self.chunk = chunk
        self.vision = vision

    def pixels(self, chunk: RolloutBatch) -> VisionInputs | None:
        return self.vision if chunk is self.chunk else None

    def logprobs(self, chunk: RolloutBatch) -> Tensor:
        return self.scorer.logprobs(self.scorer.policy, chunk, self.pixels(chunk))

    def reference(self, chunk: RolloutBatch) -> Tensor:
        return self.scorer.reference_logprobs(chunk, self.pixels(chunk))

    def with_entropy(self, chunk: RolloutBatch, grad: bool) -> tuple[Tensor, Tensor]:
        entropy = "grad" if grad else "value"
        return self.scorer.logprobs(
            self.scorer.policy, chunk, self.pixels(chunk), entropy
        )


def frozen_copy(policy: nn.Module, needed: bool) -> nn.Module | None:
    """The reference of k3 KL: the initial policy, frozen (None when not ``needed``: no memory spent).

    It stays in train mode like every module Lightning holds and is scored under ``eval_mode`` (no dropout). Under
    LoRA no copy is needed: the reference is the base with the adapter disabled.
    """
    if not needed:
        return None
    return copy.deepcopy(policy).requires_grad_(False)


def build_scorer(
    policy: nn.Module,
    ref: nn.Module | None,
    vision: VisionProcessor | None,
    objective: Objective,
    rl,
    temperature: float,
    routed: bool,
) -> ChunkScorer:
    """The scorer of a built policy, with ``rl.packed`` resolved for it (refused where packing is inexact).

    Args:
        policy: the trained model (LoRA: the reference is its base).
        ref: the frozen copy (``frozen_copy``), or None.
        vision: a vision-language policy's image side (None: text-only).
        objective: whether it asks for reference logprobs.
        rl: ``packed`` and ``logits_keep_mb``.
        temperature: the sampling temperature (``rollout.temperature``).
        routed: whether MoE routing replay is attached (packing refuses it).
    """
    wants_ref = objective.needs_reference()
    has_ref = ref is not None or (lora.is_lora(policy) and wants_ref)
    fused = fuses_head(policy)
    packing = Packing.resolve(rl.packed, policy, vision is not None, routed, fused)
    keep_bytes = int(rl.logits_keep_mb * 2**20)
    return ChunkScorer(policy, ref, vision, has_ref, temperature, keep_bytes, packing)
