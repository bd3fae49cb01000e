"""DPOModule: direct preference optimization on the same exact accumulation as GRPO.

One ``training_step`` consumes one batch of preference pairs (``dpo.batch_size`` per replica) as one
optimizer step of ``dpo.grad_accum`` train calls (the trainer-side meaning of ``grad_accum``: train calls
per optimizer step). Before them, one no-grad pass scores every pair with the frozen reference (the
initial policy); then the collected-batch loop walks the chunks, the objective normalizes each by its
DP-mean pair count, and the ``DeferredAccumulator`` divides once at the step: accumulating equals the
whole batch, chunks of unequal lengths included. Non-finite chunks poison their window, metrics roll up
weighted by pairs, and the module owns its state, as in ``GRPOModule``.

``global_step`` counts optimizer steps = training steps; ``loop_step`` the same (one batch, one step).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_grpo.base import UpdateModule
from lightning_grpo.checks import is_finite, is_int, raise_problems
from lightning_grpo.config import OptimConfig
from lightning_grpo.data.preferences import (
    PreferenceBatch,
    PreferencePair,
    encode_pairs,
)
from lightning_grpo.distributed import root_call
from lightning_grpo.logprobs import token_logprobs
from lightning_grpo.metrics import roll_up
from lightning_grpo.objectives.dpo import DPOObjective, DPOStats
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.timing import UPDATE
from lightning_grpo.update import ChunkPlan, LoopResult, Split, Updater, eval_mode


@dataclass
class DPOConfig:
    """The ``dpo`` section: batch, accumulation and the preference loss."""

    batch_size: int = 32
    """Pairs per optimizer step, per replica (over all data-parallel ranks)."""
    grad_accum: int = 1
    """Train calls (forward/backward chunks) per optimizer step, each of batch_size / grad_accum pairs. Memory only:
    the deferred divisor makes the step equal the whole batch's."""
    beta: float = 0.1
    """Strength of the implicit KL to the reference: the loss reads beta x (policy - reference) logprob margins."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's logistic loss; ipo: IPO's squared loss (pair it with length_normalize: true, as TRL does)."""
    length_normalize: bool = False
    """Score each answer by its mean token logprob instead of the sum (length-normalized DPO / IPO)."""
    label_smoothing: float = 0.0
    """Conservative DPO: the share of preference labels assumed flipped (sigmoid only)."""
    reference_free: bool = False
    """Compare against a uniform reference (logprob 0) instead of the initial policy: no reference model, no pass."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this after normalization; 0 disables clipping."""
    max_length: int | None = None
    """Prompt + answer tokens; longer answers are cut at the end. None = the policy's context length."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, dp_size: int = 1) -> None:
        """Raise one ConfigError listing every broken rule (``dp_size`` adds the per-rank rule)."""
        raise_problems("dpo config", self.problems(dp_size))

    def problems(self, dp_size: int = 1) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line."""
        p = []
        b = self.batch_size
        k = self.grad_accum
        if not is_int(b) or b < 1:
            p.append(f"batch_size={b}: must be a positive integer")
        if not is_int(k) or k < 1:
            p.append(
                f"grad_accum={k}: must be a positive integer (train calls per optimizer step)"
            )
        elif is_int(b) and b >= 1 and b % k:
            p.append(
                f"grad_accum={k} must divide batch_size={b} (a ragged chunk changes nothing here, but every "
                "rank must run the same number of train calls)"
            )
        elif is_int(b) and b >= 1 and dp_size > 1 and (b // k) % dp_size:
            p.append(
                f"batch_size={b} / grad_accum={k} = {b // k} pairs per train call must split evenly over DP "
                f"size {dp_size}"
            )
        if not is_finite(self.beta) or self.beta <= 0:
            p.append(f"beta={self.beta}: must be a finite number > 0")
        if self.loss_type not in ("sigmoid", "ipo"):
            p.append(f"loss_type={self.loss_type!r}: must be 'sigmoid' or 'ipo'")
        if not is_finite(self.label_smoothing) or not 0 <= self.label_smoothing < 0.5:
            p.append(f"label_smoothing={self.label_smoothing}: must be in [0, 0.5)")
        elif self.label_smoothing and self.loss_type != "sigmoid":
            p.append(
                f"label_smoothing={self.label_smoothing}: applies to loss_type='sigmoid' only"
            )
        if not is_finite(self.max_grad_norm) or self.max_grad_norm < 0:
            p.append(
                f"max_grad_norm={self.max_grad_norm}: must be a finite number >= 0 (0 = no clipping)"
            )
        if self.max_length is not None and (
            not is_int(self.max_length) or self.max_length < 2
        ):
            p.append(f"max_length={self.max_length}: must be an integer >= 2 or null")
        return p

    def pairs_per_rank(self, dp_size: int) -> int:
        """Pairs of one optimizer step on each of ``dp_size`` data-parallel ranks (batch_size / dp_size)."""
        self.validate(dp_size)
        return self.batch_size // dp_size


# The sections' defaults: instances, so `--help` and `--print_config` show every field (copied, never mutated).
_POLICY = PolicyConfig()
_OPTIM = OptimConfig()


class DPOModule(UpdateModule):
    """DPO (sigmoid, IPO, length-normalized, reference-free) with exact gradient accumulation.

    Args:
        policy: which model to train (a Hugging Face folder, or ``tiny:<name>``); the reference is its copy.
        dpo: batch, accumulation and loss (``DPOConfig``).
        optim: AdamW and its schedule, stepped once per optimizer step.
        seed: seed of a ``tiny:`` policy's init; None = the seed ``seed_everything`` applied, else 0.

    Example::

        module = DPOModule(PolicyConfig(path="my-sft-model"), DPOConfig(batch_size=64, grad_accum=4, beta=0.1))
        Trainer(max_steps=500).fit(module, datamodule=PreferenceDataModule("pairs.jsonl"))

    The update machinery is ``UpdateModule``'s (``base.py``), as GRPO's: AdamW and its schedule, the precision
    plugin's step (unscale -> 1/sum -> clip -> step), the DP reductions and the module-owned checkpoint state.
    """

    def __init__(
        self,
        policy: PolicyConfig = _POLICY,
        dpo: DPOConfig | None = None,
        optim: OptimConfig = _OPTIM,
        seed: int | None = None,
    ) -> None:
        super().__init__(policy, optim, seed)
        self.dpo = copy.deepcopy(dpo or DPOConfig())
        self.objective = DPOObjective(
            self.dpo.beta, self.dpo.loss_type, self.dpo.label_smoothing, self.dp_mean
        )

    # -- Lightning hooks ---------------------------------------------------------------------------------------------
    def check_strategy(self) -> None:
        """``dpo``'s per-rank rule (pairs per train call split over the DP size); ``UpdateModule.setup`` calls it."""
        self.dpo.validate(self.dp_size())

    def configure_model(self) -> None:
        """Policy, tokenizer, (unless reference-free) the frozen reference and the updater. Idempotent."""
        if self.policy is None:
            policy, self.tokenizer = self.configure_policy()
            self.policy = policy.train()
            self.ref = (
                None
                if self.dpo.reference_free
                else copy.deepcopy(self.policy).requires_grad_(False)
            )
            # One optimizer step of dpo.grad_accum train calls per batch; DPO has no pi_old (no ahead pass). Built for
            # one process: the ranks' reductions join with the optimizer (UpdateModule.on_train_start).
            split = Split(n_micro=self.dpo.grad_accum)
            self.updater = Updater(
                self.policy,
                self.forward_chunk,
                split,
                max_grad_norm=self.dpo.max_grad_norm,
            )

    def training_step(self, pairs: Sequence[PreferencePair], batch_idx: int) -> None:
        # 1. tokenize this rank's pairs; 2. reference pass; 3. grad_accum train calls, one optimizer step
        with self.timer.phase(UPDATE):
            result = self.update(self.encode(pairs))
        # 4. report: one roll-up per batch
        self.report(result)
        self.end_loop_step()

    def validation_step(self, pairs: Sequence[PreferencePair], batch_idx: int) -> None:
        """Held-out pairs: ``val/accuracy`` (the policy's own preference), ``val/reward_accuracy``, ``val/margin``."""
        batch = self.with_reference(self.encode(pairs))
        with torch.no_grad(), eval_mode(self.policy):
            chosen, rejected = self.answer_logprobs(self.policy, batch.to(self.device))
        _, _, stats = self.objective(
            chosen, rejected, *self._reference_of(batch, chosen)
        )
        metrics = {
            "val/accuracy": float((chosen > rejected).float().mean()),
            "val/reward_accuracy": float(stats.accuracy),
            "val/margin": float(stats.margin),
            "step": float(self.loop_step),
        }
        self.log_validation(metrics, weight=len(pairs))

    # -- the phases ---------------------------------------------------------------------------------------------------
    def encode(self, pairs: Sequence[PreferencePair]) -> PreferenceBatch:
        """Token ids of this rank's pairs (prompt, answer, EOS; answers cut at ``dpo.max_length``)."""
        return encode_pairs(
            pairs, self.tokenizer, self.dpo.max_length or self.context_length()
        )

    def update(self, batch: PreferenceBatch) -> LoopResult:
        """One optimizer step of ``grad_accum`` chunks over this rank's pairs, after the reference pass."""
        expected = self.dpo.pairs_per_rank(self.dp_size())
        if len(batch) != expected:
            raise ValueError(
                f"preference batch has {len(batch)} pairs on this rank but dpo.batch_size / DP size is "
                f"{expected}; give the data module pairs_per_step = dpo.batch_size"
            )
        return self.updater.update(self.with_reference(batch))

    def with_reference(self, batch: PreferenceBatch) -> PreferenceBatch:
        """``batch`` with every pair's reference logprobs, from one no-grad pass in train-call-sized chunks."""
        if self.ref is None:
            return batch
        plan = ChunkPlan.fixed(len(batch), 1, self.dpo.grad_accum)
        parts = []
        with torch.no_grad(), eval_mode(self.ref):
            for mini, micro in plan.walk():
                parts.append(
                    self.answer_logprobs(
                        self.ref, plan.chunk(batch, mini, micro).to(self.device)
                    )
                )
        chosen, rejected = (
            torch.cat(side).to(batch.chosen_ids.device) for side in zip(*parts)
        )
        return replace(batch, ref_chosen=chosen, ref_rejected=rejected)

    def forward_chunk(
        self, chunk: PreferenceBatch, old_logprobs: Tensor | None
    ) -> tuple[Tensor, Tensor, DPOStats]:
        """The DPO loss of one chunk of pairs (``old_logprobs`` is always None: DPO has no pi_old)."""
        chunk = chunk.to(self.device)
        chosen, rejected = self.answer_logprobs(self.policy, chunk)
        return self.objective(chosen, rejected, *self._reference_of(chunk, chosen))

    def answer_logprobs(
        self, model: nn.Module, chunk: PreferenceBatch
    ) -> tuple[Tensor, Tensor]:
        """``[P]`` logprobs of the chosen and of the rejected answers (sums, or means with ``length_normalize``)."""
        # [2P, T]: chosen rows, then rejected rows
        ids, attention, mask = chunk.sequences()
        lp = root_call(model, token_logprobs, model, ids, attention)  # [2P, T-1]
        m = mask[:, 1:].to(lp.dtype)
        seq = (lp * m).sum(-1)  # [2P]
        if self.dpo.length_normalize:
            seq = seq / m.sum(-1).clamp(min=1)
        return seq[: len(chunk)], seq[len(chunk) :]

    def _reference_of(
        self, chunk: PreferenceBatch, like: Tensor
    ) -> tuple[Tensor, Tensor]:
        if chunk.ref_chosen is None:  # reference-free: a uniform reference
            return torch.zeros_like(like), torch.zeros_like(like)
        return chunk.ref_chosen.to(like.device), chunk.ref_rejected.to(like.device)

    def report(self, result: LoopResult) -> None:
        """One row per batch: the roll-up (pairs summed, per-pair means over equal shares), published with the
        counters and timing as GRPO's (``UpdateModule.publish``)."""
        metrics = roll_up(result, prefix="dpo", stats=self.objective.stats)
        rows = self.dpo.pairs_per_rank(self.dp_size())
        self.publish(metrics, rows, bar={"loss": "dpo/loss", "acc": "dpo/accuracy"})
