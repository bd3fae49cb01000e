"""Reward functions: the API, the built-ins, and the weighted scorer.

The API. A reward function takes the completions of one collected batch and returns one
float per completion, in order::

    def my_reward(rollouts: Sequence[Rollout]) -> Sequence[float]:
        return [1.0 if r.text.strip() == r.prompt.answer else 0.0 for r in rollouts]

Each ``Rollout`` carries ``.text`` (the completion, decoded without special tokens),
``.finish_reason`` (``"stop"``: the sampler emitted EOS; ``"length"``: cut at
``max_new_tokens``) and ``.prompt`` (``.text``, ``.answer``, ``.id``, ``.meta``). The
function sees the whole batch at once, so a reward model can batch its forward pass.

A ``RewardSpec`` names a function (a built-in name, or ``"package.module:function"``)
and its weight; ``score`` sums the weighted rewards. A function that raises, returns
the wrong number of values or a NaN/inf value fails the step with a ``RewardError``
naming the function and, where it can be found, the sample index.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import torch
from torch import Tensor

from lightning_grpo.rollout.base import Rollout

RewardFn = Callable[[Sequence[Rollout]], Sequence[float]]


class RewardError(RuntimeError):
    """A reward function failed or returned unusable values; the message names it."""


@dataclass(frozen=True)
class RewardSpec:
    """One reward function and its weight in the total."""

    name: str = "arith"
    """A built-in (``arith``, ``math_answer``, ``format``, ``recorded``) or an import path ``package.module:function``."""
    weight: float = 1.0
    """Multiplies this function's rewards in the total."""

    def __post_init__(self) -> None:
        if not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            raise ValueError(f"reward {self.name!r}: weight={self.weight!r} must be a finite number")


# -- answer parsing ----------------------------------------------------------------------------------------------

_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"^[-+]?\d+(\.\d+)?$")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced (``\\boxed{\\frac{1}{2}}`` works)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: the last ``\\boxed{}``, else what follows the last ``####``, else None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    return hashes[-1].strip() if hashes else None


def extract_reference(answer: str) -> str:
    """A reference answer's final value: GSM8K's ``#### N`` / ``\\boxed{N}`` if present, else the whole string."""
    found = extract_answer(answer)
    return (found if found is not None else answer).strip()


def normalize_answer(answer: str) -> str:
    """Canonical form for comparison: no ``$``/commas/trailing period; numbers as plain decimals (``42.0`` -> ``42``)."""
    s = answer.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    if _NUMBER.match(s):
        try:
            value = Decimal(s)
            return format(value.to_integral_value() if value == value.to_integral_value() else value.normalize(), "f")
        except InvalidOperation:  # unreachable for the regex above; kept to never crash a step on a format quirk
            return s
    return s


# -- built-in reward functions -----------------------------------------------------------------------------------


def _need_answer(r: Rollout, fn: str) -> str:
    if r.prompt.answer is None:
        raise ValueError(f"prompt id {r.prompt.id} has no reference answer; {fn} needs one (set answer_key)")
    return r.prompt.answer


def math_answer(rollouts: Sequence[Rollout]) -> list[float]:
    """1.0 when the completion's ``\\boxed{}`` / ``####`` answer equals the reference's final answer, else 0.0."""
    out = []
    for r in rollouts:
        predicted = extract_answer(r.text)
        expected = normalize_answer(extract_reference(_need_answer(r, "math_answer")))
        out.append(float(predicted is not None and normalize_answer(predicted) == expected))
    return out


def format_reward(rollouts: Sequence[Rollout]) -> list[float]:
    """1.0 when the completion stopped on EOS and states an answer (``\\boxed{}``, ``####`` or a bare number)."""
    out = []
    for r in rollouts:
        stated = extract_answer(r.text) is not None or bool(_NUMBER.match(r.text.strip()))
        out.append(float(r.finish_reason == "stop" and stated))
    return out


def arith_reward(rollouts: Sequence[Rollout]) -> list[float]:
    """The ``arith`` task: 1.0 when the completion is exactly the answer and then EOS, else 0.0."""
    return [float(r.finish_reason == "stop" and r.text.strip() == _need_answer(r, "arith")) for r in rollouts]


def recorded_reward(rollouts: Sequence[Rollout]) -> list[float]:
    """The reward stored on each rollout (the replay engine serves recorded rewards)."""
    missing = [i for i, r in enumerate(rollouts) if r.reward is None]
    if missing:
        raise ValueError(f"samples {missing[:5]} carry no recorded reward (rollout.reward is None)")
    return [float(r.reward) for r in rollouts]


BUILTINS: dict[str, RewardFn] = {
    "math_answer": math_answer,
    "format": format_reward,
    "arith": arith_reward,
    "recorded": recorded_reward,
}


def resolve_reward(name: str) -> RewardFn:
    """The function a ``RewardSpec.name`` refers to: a built-in, or ``package.module:function``."""
    if name in BUILTINS:
        return BUILTINS[name]
    if ":" not in name:
        raise ValueError(
            f"reward {name!r}: not a built-in ({', '.join(BUILTINS)}); "
            "give an import path 'package.module:function' for your own"
        )
    module_name, attr = name.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r} ({err})") from err
    fn = getattr(module, attr, None)
    if not callable(fn):  # a config error like the others above, hence ValueError, not TypeError
        raise ValueError(f"reward {name!r}: module {module_name!r} has no callable {attr!r}")  # noqa: TRY004
    return fn


# -- scoring -----------------------------------------------------------------------------------------------------


def score(rollouts: Sequence[Rollout], specs: Sequence[RewardSpec]) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted sum of the reward functions over ``rollouts``.

    Returns:
        ``(total [N] float32, per_function)``: ``per_function[name]`` is that function's unweighted ``[N]`` rewards.

    Raises:
        RewardError: a function raised, returned a length other than ``N``, or a NaN/inf value.
    """
    if not specs:
        raise ValueError("no reward functions configured: give at least one RewardSpec")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"reward functions {names}: each may appear once (merge the weights instead)")
    total = torch.zeros(len(rollouts), dtype=torch.float32)
    per_function = {}
    for spec in specs:
        values = _call(spec.name, resolve_reward(spec.name), rollouts)
        per_function[spec.name] = values
        total += spec.weight * values
    return total, per_function


def _call(name: str, fn: RewardFn, rollouts: Sequence[Rollout]) -> Tensor:
    """``fn(rollouts)`` as a checked ``[N]`` float32 tensor."""
    try:
        raw = fn(rollouts)
    except Exception as err:
        where = _first_failing(fn, rollouts)
        raise RewardError(f"reward function {name!r} raised {type(err).__name__}: {err}{where}") from err
    try:
        values = torch.as_tensor([float(v) for v in raw], dtype=torch.float32)  # [N]
    except (TypeError, ValueError) as err:
        raise RewardError(f"reward function {name!r} must return a sequence of floats ({err})") from err
    if len(values) != len(rollouts):
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {len(rollouts)} completions; "
            f"expected exactly {len(rollouts)} (one float per completion, in order)"
        )
    bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        raise RewardError(
            f"reward function {name!r} returned {values[i].item()} for sample {i} (prompt id "
            f"{rollouts[i].prompt.id}){f' and {len(bad) - 1} more' if len(bad) > 1 else ''}; rewards must be finite"
        )
    return values


def _first_failing(fn: RewardFn, rollouts: Sequence[Rollout]) -> str:
    """Locate the sample: re-call ``fn`` one sample at a time (failure path only; costs up to N calls)."""
    for i, r in enumerate(rollouts):
        try:
            fn([r])
        except Exception:  # noqa: BLE001 - any failure locates the sample; the original error is chained
            return f" (first failing sample: index {i}, prompt id {r.prompt.id})"
    return " (no single sample fails alone: the failure depends on the whole batch)"
