"""GRPOModule's update half: the policy's parts (adapter, image side, reference, chunk
scorer) and the update of one collected batch, each behind a hook a subclass may override.

A mixin of ``GRPOModule`` (module.py): it reads the module's config sections, and
``configure_model`` calls ``build_parts`` once (docs/lightning.md, docs/update.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_grpo.model_parts import build_updater, scoring_parts, trainable
from lightning_grpo.objectives import Objective, ObjectiveParts, Stats, build_objective
from lightning_grpo.policy import load_vision
from lightning_grpo.update import Recorder, Split, Updater, pi_old_source

if TYPE_CHECKING:  # annotations only
    from torch import Tensor

    from lightning_grpo.batch import RolloutBatch
    from lightning_grpo.vision import VisionProcessor


class UpdateHooks:
    """Builds the policy's parts and the updater for ``GRPOModule`` (which sets the
    fields)."""

    def configure_objective(self, objective: str | Objective) -> Objective:
        """The loss: a registered name (``objectives.OBJECTIVES``) built for this module, or an instance as is."""
        if not isinstance(objective, str):
            return objective
        max_new_tokens = self.rollout_cfg.max_new_tokens
        parts = ObjectiveParts(
            self.rl, self.dp_mean, max_new_tokens, opd=self.opd_cfg, seed=self.seed
        )
        return build_objective(objective, parts)

    def configure_vision(self) -> VisionProcessor | None:
        """The policy's image side (None for a text-only policy); freezes the vision tower unless
        ``policy.train_vision_tower``. Default: ``load_vision`` on the policy folder."""
        return load_vision(self.policy_cfg, self.tokenizer, self.policy)

    def configure_recorders(self) -> list[Recorder]:
        """More per-token records for the ahead pass to take (``update/records.py``; none by default)."""
        return []

    def configure_updater(self) -> Updater:
        """The update of one collected batch (``model_parts.build_updater``, docs/update.md). Built for one process:
        the ranks' split and reductions join with the optimizer (``on_train_start``), once the strategy is known."""
        return build_updater(
            self.policy,
            self.forward_chunk,
            self.scorer,
            self.routing,
            self.objective,
            self.rl,
            recorders=self.configure_recorders(),
            dp_sum=self.dp_sum,
            seed=self.seed,
            timer=self.timer,
        )

    def split(self) -> Split:
        """How this rank cuts a collected batch (packed: token budgets count real tokens)."""
        return Split.of(self.rl, self.dp_size(), self.scorer.packed)

    def build_parts(self) -> None:
        """Policy, tokenizer, LoRA adapter, image side, reference, MoE routing replay,
        chunk scorer and updater, in that order (``configure_model``)."""
        model, self.tokenizer = self.configure_policy()
        # model_parts.py
        trained = trainable(model, self.policy_cfg.lora, self.seed)
        self.policy = trained.policy
        self.lora_base = trained.lora_base  # base.py leaves it out of checkpoints
        # before the optimizer and the reference: it may freeze a tower
        self.vision = self.configure_vision()
        parts = scoring_parts(
            self.policy,
            self.tokenizer,
            self.vision,
            self.objective,
            self.rl,
            # OPD's teacher
            self.rollout_cfg.temperature,
            trained.has_adapter,
            self.dp_mean,
        )
        self.ref = parts.ref
        self.routing = parts.routing
        self.scorer = parts.scorer
        self.updater = self.configure_updater()

    def forward_chunk(
        self, chunk: RolloutBatch, old_logprobs: Tensor | None
    ) -> tuple[Tensor, Tensor, Stats]:
        """Score one chunk with the objective (``ChunkScorer.chunk_loss``)."""
        sampler = pi_old_source(self.rl) == "sampler"
        return self.scorer.chunk_loss(self.objective, chunk, old_logprobs, sampler)
