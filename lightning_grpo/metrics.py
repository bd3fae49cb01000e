"""Roll-up: one set of metrics per collected batch, each with the reduction its meaning needs.

* ``grpo/loss`` is token-weighted: ``sum(loss_i * denom_i) / sum(denom_i)``. Each chunk's loss
  is already a mean over its own tokens, so a plain mean of chunk losses is a mean of means
  (wrong on unequal lengths); weighting by the divisor telescopes back to the batch loss.
* Counts (``grpo/n``, ``grpo/tokens``, ``grpo/denom``) are summed.
* Per-token ratios (clip fraction, ratio mean, KL) are weighted by this rank's tokens.
* Per-optimizer-step figures (grad norm, lr) are mean and max over the steps of the batch.
"""

from __future__ import annotations

import torch

from lightning_grpo.loop import LoopResult


def roll_up(result: LoopResult) -> dict[str, float]:
    """Metrics of one collected batch from the chunks that stepped and each window's outcome."""
    out: dict[str, float] = {}
    if result.chunks:
        # [K, 8] on the host in one transfer (one CPU-GPU sync per collected batch).
        names = ("loss", "denom", "tokens", "n", "clip_frac", "ratio_mean", "ratio_max", "kl")
        table = torch.stack([torch.stack([getattr(c, f).double().cpu() for f in names]) for c in result.chunks])
        col = dict(zip(names, table.unbind(-1)))
        denom, tokens = col["denom"].sum(), col["tokens"].sum()
        out["grpo/loss"] = _ratio((col["loss"] * col["denom"]).sum(), denom)
        out["grpo/denom"] = float(denom)
        out["grpo/tokens"] = float(tokens)
        out["grpo/n"] = float(col["n"].sum())
        for name in ("clip_frac", "ratio_mean", "kl"):
            out[f"grpo/{name}"] = _ratio((col[name] * col["tokens"]).sum(), tokens)
        out["grpo/ratio_max"] = float(col["ratio_max"].max())
    stepped = [s for s in result.steps if not s.skipped]
    if stepped:
        norms, lrs = [s.grad_norm for s in stepped], [s.lr for s in stepped]
        out["grpo/grad_norm"], out["grpo/grad_norm_max"] = sum(norms) / len(norms), max(norms)
        out["grpo/lr"], out["grpo/lr_max"] = sum(lrs) / len(lrs), max(lrs)
    out["grpo/optimizer_steps"] = float(len(stepped))
    out["grpo/skipped_steps"] = float(len(result.steps) - len(stepped))
    out["grpo/discarded_chunks"] = float(result.discarded_chunks)
    return out


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    return float(num / den) if float(den) > 0 else 0.0
