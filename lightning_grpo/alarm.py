"""A warning when a run has nothing to learn from, before the curves go flat for hours.

GRPO learns only from groups whose rewards differ: a group whose completions all score the same has advantage 0
on every row (``reward/frac_zero_std`` counts those groups). When that share stays near 1 the run spends its
compute on a zero gradient. Likewise, when most completions hit ``max_new_tokens`` their rewards grade cut-off
text. Neither raises: ``SignalAlarm`` warns once per kind, naming the knobs that fix it.
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_grpo.config import GRPOConfig, RolloutConfig


class SignalAlarm(Callback):
    """Warns when the learning signal is gone for ``patience`` consecutive loop steps.

    Args:
        zero_std_frac: warn when ``reward/frac_zero_std`` (groups whose rewards all agree) is above this ...
        clipped_frac: ... or ``completion/clipped_frac`` (completions cut at ``max_new_tokens``) is above this ...
        patience: ... for this many consecutive loop steps (0: never warn).

    Example::

        Trainer(callbacks=[SignalAlarm(zero_std_frac=0.9, patience=5)])
    """

    def __init__(
        self, zero_std_frac: float = 0.9, clipped_frac: float = 0.5, patience: int = 5
    ) -> None:
        if not (0 <= zero_std_frac < 1 and 0 <= clipped_frac < 1) or patience < 0:
            raise ValueError(
                f"SignalAlarm(zero_std_frac={zero_std_frac}, clipped_frac={clipped_frac}, patience="
                f"{patience}): the fractions must be in [0, 1), patience >= 0 (0 = off)"
            )
        self.limits = {
            "reward/frac_zero_std": zero_std_frac,
            "completion/clipped_frac": clipped_frac,
        }
        self.patience = patience
        self._streak = dict.fromkeys(self.limits, 0)
        self._warned: set[str] = set()

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs,
        batch,
        batch_idx: int,
    ) -> None:
        metrics = getattr(pl_module, "last_metrics", {})
        for name, limit in self.limits.items():
            above = name in metrics and float(metrics[name]) > limit
            self._streak[name] = self._streak[name] + 1 if above else 0
            if (
                self.patience
                and self._streak[name] == self.patience
                and name not in self._warned
            ):
                # once per fit: the message names the fix, repeating it adds nothing
                self._warned.add(name)
                rollout = getattr(pl_module, "rollout_cfg", None)
                rl = getattr(pl_module, "rl", None)
                rank_zero_warn(self.message(name, metrics, rollout, rl))

    def message(
        self,
        name: str,
        metrics: dict[str, float],
        rollout: RolloutConfig | None,
        rl: GRPOConfig | None,
    ) -> str:
        """The warning for metric ``name``, with the values of the knobs that set it (``rollout``, ``rl``: the run's
        sections, None where the module has none)."""
        temperature = getattr(rollout, "temperature", "?")
        step = int(metrics.get("step", 0))
        if name == "completion/clipped_frac":
            return (
                f"no learning signal: {metrics[name]:.0%} of completions hit model.rollout.max_new_tokens="
                f"{getattr(rollout, 'max_new_tokens', '?')} for {self.patience} loop steps (to loop step {step})"
                f": their rewards grade cut-off text. Raise max_new_tokens, or ask for shorter answers."
            )
        reward = metrics.get("reward/mean", float("nan"))
        return (
            f"no learning signal: reward/frac_zero_std > {self.limits[name]} for {self.patience} loop steps (to "
            f"loop step {step}; now {metrics[name]:.2f}): the completions of a prompt all get the same reward, so "
            f"every advantage is 0. Causes: model.rollout.temperature={temperature} too low for diverse "
            f"samples, model.rl.group_size={getattr(rl, 'group_size', '?')} too small, or the task too easy or "
            f"too hard for this policy (reward/mean {reward:.3f}). Raise the temperature or the group size, or "
            f"change the task's difficulty."
        )

    def state_dict(self) -> dict:
        return {"streak": dict(self._streak), "warned": sorted(self._warned)}

    def load_state_dict(self, state: dict) -> None:
        self._streak.update(state["streak"])
        self._warned = set(state["warned"])
