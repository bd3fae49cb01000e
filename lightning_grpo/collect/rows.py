"""One loop step's rows as the completions log shows them: each rollout with its rewards (total and per function),
advantage and whether it trained; an episode with its opening (tool schemas included) and every turn, its tool calls
and their results (``completions.py`` writes them; the Collector keeps the last step's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from torch import Tensor

from lightning_grpo.rollout.base import Rollout


class RewardParts:
    """Per-function rewards of the rollouts scored since ``clear``, found by the rollout object itself.

    Dynamic sampling scores several draws in one loop step and keeps some groups of each, so the parts are kept
    per rollout (by identity: a ``Rollout`` holds lists, it has no hash) rather than per draw. One per loop step.
    """

    def __init__(self) -> None:
        self._parts: dict[int, tuple[Rollout, dict[str, float]]] = {}

    def add(self, rollouts: list[Rollout], parts: dict[str, Tensor]) -> None:
        # the rollout is kept too: its id() is only unique while it lives
        for i, r in enumerate(rollouts):
            self._parts[id(r)] = (r, {name: float(v[i]) for name, v in parts.items()})

    def of(self, rollout: Rollout) -> dict[str, float]:
        return self._parts.get(id(rollout), (None, {}))[1]


@dataclass(frozen=True)
class StepRows:
    """One loop step's rows on this rank (``N`` = its share of the collected batch, groups contiguous)."""

    step: int
    """The loop step the rows were drawn for, as metrics.csv's ``step`` counts it (1 for the first)."""
    rollouts: list[Rollout]
    """``[N]`` completions."""
    rewards: Tensor
    """``[N]`` total rewards (shaped)."""
    advantages: Tensor
    """``[N]`` advantages (0 on rows not trained)."""
    parts: RewardParts
    """Per-function rewards of the rows."""
    figure: TokenFigure | None = None
    """The objective's per-token figure, asked for the rows shown only (OPD: the KL to the teacher), or None."""
    uses_advantages: bool = True
    """Whether the loss reads the advantages (False: rows show ``"advantage": null``)."""
    trained: Tensor | None = None
    """``[N]`` bool: rows whose completion tokens count in the loss (False: a dynamic-sampling padding group, a
    skipped record, a truncated completion under ``rl.mask_truncated_completions``); None: every row."""

    def samples(self, n: int, group_size: int) -> list[dict]:
        """Up to ``n`` rows as JSON-ready dicts: the first row of each group, then the second, ... (spread)."""
        order = sorted(
            range(len(self.rollouts)), key=lambda i: (i % group_size, i // group_size)
        )[:n]
        rows = [self._row(i) for i in order]
        if self.figure is not None and order:
            values = self.figure.values([self.rollouts[i] for i in order])
            for row, v in zip(rows, values):
                row[self.figure.name] = [round(x, 4) for x in v]
        return rows

    def _row(self, i: int) -> dict:
        r = self.rollouts[i]
        advantage = float(self.advantages[i]) if self.uses_advantages else None
        trained = self.trained is None or bool(self.trained[i])
        row = {
            "step": self.step,
            "prompt_id": r.prompt.id,
            "prompt": r.prompt.text,
            "completion": r.text,
            "reward": float(self.rewards[i]),
            "rewards": self.parts.of(r),
            "advantage": advantage,
            "finish_reason": r.finish_reason,
            "trained": trained,
        }
        # an episode: the prompt as the model saw it, every turn with its calls
        if r.transcript is not None:
            row["prompt"] = r.transcript.opening
            row["turns"] = [asdict(t) for t in r.transcript.turns]
        return row


@dataclass(frozen=True)
class TokenFigure:
    """An objective's per-token figure, measured on demand for the rows a log shows."""

    name: str
    """Its key in a row (``kl_to_teacher``)."""
    values: Callable[[list[Rollout]], list[list[float]]]
    """Rollouts -> per row, the figure at each completion token the loss counts."""
