"""Reward functions: the API, the built-ins, and the weighted scorer.

The API. A reward function takes the completions of one collected batch and returns one
value per completion, in order: a real number, or None for "no opinion on this sample".
Two signatures are accepted and told apart once, when the config loads
(``reward_calls.inspect_reward``)::

    def my_reward(rollouts: Sequence[Rollout]) -> list[float | None]:         # ours
        return [1.0 if r.text.strip() == r.prompt.answer else 0.0 for r in rollouts]

    def my_trl_reward(prompts, completions, answer, **kwargs) -> list[float | None]:  # TRL's, unchanged
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

Each ``Rollout`` carries ``.text`` (the completion, decoded without special tokens),
``.finish_reason`` (``"stop"``: EOS or a stop string; ``"length"``: cut at ``max_new_tokens``) and
``.prompt`` (``.text``, ``.messages``, ``.answer``, ``.id``, ``.meta`` with the dataset's columns).
The function sees the whole batch at once, so a reward model can batch its forward pass.

A ``RewardSpec`` names a function (a built-in name, or ``"module:function"`` importable from the
current working folder or an installed package), its weight and its time limit; ``score`` sums the
weighted rewards, a None counting 0. docs/rewards.md is the user's guide.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_grpo.checks import ConfigError, raise_problems
from lightning_grpo.data.answers import (
    NUMBER,
    answers_match,
    extract_answer,
    extract_reference,
    normalize_answer,
)
from lightning_grpo.data.reward_calls import (
    RewardError,
    RewardFunction,
    as_values,
    call_reward,
    inspect_reward,
)
from lightning_grpo.rollout.base import Rollout

__all__ = [
    "RewardError",
    "RewardSpec",
    "extract_answer",
    "extract_reference",
    "normalize_answer",
    "score",
]

RewardFn = Callable[[Sequence[Rollout]], Sequence[float | None]]


@dataclass(frozen=True)
class RewardSpec:
    """One reward function, its weight in the total and its time limit. The function is resolved at load."""

    name: str = "arith"
    """A built-in (``arith``, ``exact``, ``math_answer``, ``format``, ``recorded``) or an import path ``module:function``
    (the current working folder is importable, like a script's own folder)."""
    weight: float = 1.0
    """Multiplies this function's rewards in the total."""
    timeout_s: float | None = 60.0
    """Seconds one batch call may take; past it the step fails with a RewardError naming the function.
    null = no limit (the call then runs on the training thread)."""
    per_sample: bool = False
    """Call the function once per completion (a one-element batch each) instead of once per batch; a failure
    then names its sample. Off: one batch call, and a failure is reported at once with the function's traceback."""

    def __post_init__(self) -> None:
        p = self.problems()
        # Import and signature problems surface here, at config load, not at the first loop step.
        try:
            object.__setattr__(self, "_function", load_reward(self.name))
        # every problem of the name is a ValueError naming it (load_reward)
        except ValueError as err:
            p.append(str(err))
        raise_problems("rewards config", p)

    def problems(self) -> list[str]:
        """Every broken rule of the weight and time limit as a ``field=value: rule`` line (the name: at load)."""
        p = []
        if not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            p.append(
                f"reward {self.name!r}: weight={self.weight!r} must be a finite number"
            )
        if self.timeout_s is not None and (
            not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0
        ):
            p.append(
                f"reward {self.name!r}: timeout_s={self.timeout_s!r} must be > 0 seconds (or null)"
            )
        return p

    @property
    def function(self) -> RewardFunction:
        """The resolved function and its calling convention."""
        return self._function  # type: ignore[attr-defined]


# -- built-in reward functions -----------------------------------------------------------------------------------


def _need_answer(r: Rollout, fn: str) -> str:
    if r.prompt.answer is None:
        raise ValueError(
            f"prompt id {r.prompt.id} has no reference answer; {fn} needs one (set answer_key)"
        )
    return r.prompt.answer


def math_answer(rollouts: Sequence[Rollout]) -> list[float]:
    """1.0 when the completion's ``\\boxed{}`` / ``####`` answer equals the reference's final answer, else 0.0.

    Equal means equal after normalization (``1,000`` = ``1000.0``) or, with math-verify installed, equivalent
    (``\\frac{1}{2}`` = ``0.5``); see ``data/answers.py``.
    """
    out = []
    for r in rollouts:
        predicted = extract_answer(r.text)
        expected = extract_reference(_need_answer(r, "math_answer"))
        out.append(float(predicted is not None and answers_match(predicted, expected)))
    return out


def format_reward(rollouts: Sequence[Rollout]) -> list[float]:
    """1.0 when the completion stopped (EOS or a stop string) and states an answer (``\\boxed{}``, ``####`` or a
    bare number)."""
    out = []
    for r in rollouts:
        stated = extract_answer(r.text) is not None or bool(
            NUMBER.match(r.text.strip())
        )
        out.append(float(r.finish_reason == "stop" and stated))
    return out


def arith_reward(rollouts: Sequence[Rollout]) -> list[float]:
    """The ``arith`` task: 1.0 when the completion is exactly the answer and then EOS, else 0.0."""
    return [
        float(r.finish_reason == "stop" and r.text.strip() == _need_answer(r, "arith"))
        for r in rollouts
    ]


def recorded_reward(rollouts: Sequence[Rollout]) -> list[float]:
    """The reward stored on each rollout (the replay engine serves recorded rewards)."""
    missing = [i for i, r in enumerate(rollouts) if r.reward is None]
    if missing:
        raise ValueError(
            f"samples {missing[:5]} carry no recorded reward (rollout.reward is None)"
        )
    return [float(r.reward) for r in rollouts]


BUILTINS: dict[str, RewardFn] = {
    "math_answer": math_answer,
    "format": format_reward,
    "arith": arith_reward,
    # the same rule for any task with a short exact answer (the visual ``colors`` task)
    "exact": arith_reward,
    "recorded": recorded_reward,
}


def resolve_reward(name: str) -> RewardFn:
    """The function a ``RewardSpec.name`` refers to: a built-in, or ``module:function``."""
    if name in BUILTINS:
        return BUILTINS[name]
    if ":" not in name:
        raise ValueError(
            f"reward {name!r}: not a built-in ({', '.join(BUILTINS)}); "
            "give an import path 'module:function' for your own (my_rewards.py in the working folder: "
            "'my_rewards:my_function')"
        )
    module_name, attr = name.split(":", 1)
    # a console script's sys.path lacks the working folder
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"reward {name!r}: cannot import module {module_name!r} ({err}); it must be importable from the "
            f"working folder {os.getcwd()} or an installed package"
        ) from err
    fn = getattr(module, attr, None)
    # a config error like the others above, hence ValueError, not TypeError
    if not callable(fn):
        # noqa: TRY004
        raise ValueError(
            f"reward {name!r}: module {module_name!r} has no callable {attr!r}"
        )
    return fn


def load_reward(name: str) -> RewardFunction:
    """Resolve ``name`` and classify its signature (ours or TRL's); every problem is a ``ValueError`` naming it."""
    return inspect_reward(name, resolve_reward(name))


def check_reward_columns(specs: Sequence[RewardSpec], columns: set[str]) -> None:
    """A TRL-style function's required keywords must be dataset columns: else a ``ConfigError`` before training."""
    for spec in specs:
        missing = sorted(spec.function.required - columns)
        if missing:
            raise ConfigError(
                f"reward {spec.name!r} requires {missing}, which are not columns of the prompt data (its columns: "
                f"{sorted(columns)}). Rename the parameter to a column, give it a default, or check data.source"
            )


# -- scoring -----------------------------------------------------------------------------------------------------


def score(
    rollouts: Sequence[Rollout],
    specs: Sequence[RewardSpec],
    should_stop: Callable[[], bool] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted sum of the reward functions over ``rollouts``; a None (no opinion) counts 0 in the total.

    ``should_stop`` is polled while a function runs (``GRPOModule`` passes "the trainer received SIGTERM").

    Returns:
        ``(total [N] float32, per_function)``: ``per_function[name]`` is that function's unweighted ``[N]``
        rewards, NaN where it returned None.

    Raises:
        RewardError: a function raised, timed out, or returned something other than one real number or None per
            completion (strings, dicts, NaN/inf and wrong lengths are refused).
    """
    if not specs:
        raise ValueError("no reward functions configured: give at least one RewardSpec")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(
            f"reward functions {names}: each may appear once (merge the weights instead)"
        )
    total = torch.zeros(len(rollouts), dtype=torch.float32)
    opinions = torch.zeros(len(rollouts), dtype=torch.bool)
    per_function = {}
    for spec in specs:
        values = _values(spec, rollouts, should_stop)
        per_function[spec.name] = values
        total += spec.weight * values.nan_to_num(0.0)
        opinions |= ~values.isnan()
    # each value fits float32; weights times values may not
    if not bool(total.isfinite().all()):
        raise RewardError(
            f"the weighted sum of the reward functions {names} (weights {[s.weight for s in specs]}) "
            "overflows float32: lower the weights or the functions' scale"
        )
    if not bool(opinions.all()):
        warnings.warn(
            f"{int((~opinions).sum())} of {len(rollouts)} completions got None from every reward function "
            f"({names}); their total reward is 0",
            stacklevel=2,
        )
    return total, per_function


def _values(
    spec: RewardSpec,
    rollouts: Sequence[Rollout],
    should_stop: Callable[[], bool] | None,
) -> Tensor:
    """One function's checked ``[N]`` values: one batch call, or one call per sample when declared so."""
    rf = spec.function
    if not spec.per_sample:
        return as_values(
            spec.name, call_reward(rf, rollouts, spec.timeout_s, should_stop), rollouts
        )
    out = []
    for i, r in enumerate(rollouts):
        try:
            out.append(
                as_values(
                    spec.name, call_reward(rf, [r], spec.timeout_s, should_stop), [r]
                )
            )
        except RewardError as err:
            raise RewardError(
                f"{err} [per_sample: sample {i}, prompt id {r.prompt.id}]"
            ) from err.__cause__
    return torch.cat(out)  # [N]


def overlong_penalty(
    lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0
) -> Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), added to each completion's reward.

    ``[N]`` float32: 0 up to ``max_new_tokens - buffer`` tokens, then falling linearly to ``-penalty`` at
    ``max_new_tokens`` (a completion cut by a stop string after it would be longer: held at ``-penalty``).
    ``buffer == 0``: all zeros (off).
    """
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    start = max_new_tokens - buffer
    # tokens into the buffer
    over = (lengths.to(torch.float64) - start).clamp(min=0, max=buffer)
    return (-over / buffer * penalty).to(torch.float32)
