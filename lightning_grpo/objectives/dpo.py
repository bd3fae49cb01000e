"""The DPO loss over preference pairs: tensors in, ``(loss, denom, stats)`` out, normalized per pair.

With ``h = (pi_c - ref_c) - (pi_r - ref_r)`` (policy and reference logprobs of the chosen and rejected
answers; sums over the answer tokens, or their means when ``length_normalize``):

* ``sigmoid`` (DPO): ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)`` (``eps`` = label smoothing);
* ``ipo``: ``(h - 1 / (2 beta))^2`` (IPO; TRL's IPO uses length-normalized logprobs, ``length_normalize=true``).

``loss`` is the chunk's sum over pairs divided by the DP mean of its pair count, ``denom`` that count:
the accumulator recovers the chunk sum as ``loss * denom`` and divides once at the step, so accumulating
chunks equals the whole batch. Reference-free DPO passes zeros for the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_grpo.distributed import single_process
from lightning_grpo.objectives.base import Reduction, nonzero
from lightning_grpo.objectives.grpo import DPMean

LossType = Literal["sigmoid", "ipo"]


@dataclass(frozen=True)
class DPOStats:
    """One chunk's figures, as 0-d tensors; per-pair means are over this rank's pairs (weighted by ``pairs``)."""

    REDUCE: ClassVar[dict[str, Reduction]] = {
        "loss": ("dpo/loss", "denom"),
        "denom": ("dpo/denom", "sum"),
        "pairs": ("dpo/pairs", "sum"),
        "accuracy": ("dpo/accuracy", "pairs"),
        "margin": ("dpo/margin", "pairs"),
        "chosen_reward": ("dpo/chosen_reward", "pairs"),
        "rejected_reward": ("dpo/rejected_reward", "pairs"),
        "chosen_logp": ("dpo/chosen_logp", "pairs"),
        "rejected_logp": ("dpo/rejected_logp", "pairs"),
    }
    loss: Tensor
    denom: Tensor
    """Divisor the loss was normalized by (DP-mean pairs)."""
    pairs: Tensor
    """This rank's pairs in the chunk."""
    accuracy: Tensor
    """Share of pairs whose implicit reward ranks the chosen answer first (0 at the start: policy == reference)."""
    margin: Tensor
    """Mean implicit reward margin ``beta * h``."""
    chosen_reward: Tensor
    rejected_reward: Tensor
    chosen_logp: Tensor
    """Mean policy logprob of the chosen answer (sum, or per token with length_normalize)."""
    rejected_logp: Tensor


class DPOObjective:
    """Direct preference optimization (and IPO) on sequence logprobs of chosen/rejected answers.

    Args:
        beta: strength of the implicit KL to the reference (larger keeps the policy closer).
        loss_type: ``sigmoid`` (DPO) or ``ipo``.
        label_smoothing: ``eps`` of conservative DPO (the share of labels assumed flipped); sigmoid only.
        dp_mean: all-reduce mean over data-parallel ranks for the divisor.
    """

    name = "dpo"
    stats = DPOStats  # names every dpo/* figure of a loop step where no chunk stepped

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: LossType = "sigmoid",
        label_smoothing: float = 0.0,
        dp_mean: DPMean = single_process,
    ) -> None:
        self.beta = beta
        self.loss_type = loss_type
        self.label_smoothing = label_smoothing
        self.dp_mean = dp_mean

    def needs_old_logprobs(self) -> bool:
        """No ratio: DPO reads the reference, never pi_old."""
        return False

    def __call__(
        self,
        chosen: Tensor,
        rejected: Tensor,
        ref_chosen: Tensor,
        ref_rejected: Tensor,
    ) -> tuple[Tensor, Tensor, DPOStats]:
        """Loss of one chunk of pairs.

        Args:
            chosen, rejected: ``[P]`` policy logprobs of each answer (with grad).
            ref_chosen, ref_rejected: ``[P]`` reference logprobs (zeros for reference-free DPO).
        """
        chosen_reward = chosen - ref_chosen.to(chosen.dtype)  # [P], before beta
        rejected_reward = rejected - ref_rejected.to(rejected.dtype)
        h = chosen_reward - rejected_reward  # [P]
        if self.loss_type == "ipo":
            per_pair = (h - 1 / (2 * self.beta)) ** 2
        else:
            eps = self.label_smoothing
            per_pair = -(1 - eps) * F.logsigmoid(self.beta * h) - eps * F.logsigmoid(
                -self.beta * h
            )
        pairs = torch.tensor(
            float(chosen.shape[0]), dtype=chosen.dtype, device=chosen.device
        )
        denom = self.dp_mean(pairs)
        loss = per_pair.sum() / nonzero(denom)  # an empty chunk: loss 0, divisor 0
        with torch.no_grad():
            local = pairs.clamp(min=1)
            c = self.beta * chosen_reward.detach()
            r = self.beta * rejected_reward.detach()
            stats = DPOStats(
                loss=loss.detach(),
                denom=denom,
                pairs=pairs,
                accuracy=(c > r).to(c.dtype).sum() / local,
                margin=(c - r).sum() / local,
                chosen_reward=c.sum() / local,
                rejected_reward=r.sum() / local,
                chosen_logp=chosen.detach().sum() / local,
                rejected_logp=rejected.detach().sum() / local,
            )
        return loss, denom, stats
