"""Calling a user's reward function safely: its signature, its arguments, its time limit, its values.

Two signatures are accepted, told apart once when the config loads (``inspect_reward``):

- ``fn(rollouts) -> list[float | None]`` (ours): one required positional parameter, the batch of
  ``Rollout`` objects.
- ``fn(prompts, completions, **columns) -> list[float | None]`` (TRL's): any function with a parameter
  named ``completions``. It is called with keywords: ``prompts`` (strings, or chat messages for
  conversational prompts), ``completions`` (strings, or ``[{"role": "assistant", "content": ...}]``),
  ``completion_ids`` and every dataset column (``answer``, ...) as a list aligned with the completions.
  Without ``**kwargs`` it gets only the keywords it names.

Hygiene, whatever the signature: each call gets its own deep copy of the rollouts (a function that
edits them in place changes nothing that is trained); a call runs on a daemon thread and fails the
step after ``timeout_s`` (the training thread stays responsive to SIGTERM meanwhile); the values must
be real numbers or None, one per completion, else a ``RewardError`` names the function and the sample.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from lightning_grpo.rollout.base import Rollout

INTERNAL_META = ("source_index", "epoch")
"""Keys the prompt stream adds to a record's meta; every other meta key is a dataset column."""
TRL_KEYWORDS = ("prompts", "completions", "completion_ids")


class RewardError(RuntimeError):
    """A reward function failed or returned unusable values; the message names it."""


@dataclass(frozen=True)
class RewardFunction:
    """A resolved reward function and how to call it."""

    name: str
    fn: Callable[..., Any]
    style: Literal["rollouts", "trl"]
    keywords: frozenset[str] | None = None
    """TRL style: the keywords it accepts (None = it takes ``**kwargs``, so every column)."""
    required: frozenset[str] = frozenset()
    """TRL style: required keywords that must come from dataset columns."""


def inspect_reward(name: str, fn: Callable[..., Any]) -> RewardFunction:
    """Classify ``fn``'s signature; raises ``ValueError`` naming the function and both supported forms."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: assume ours
        return RewardFunction(name, fn, "rollouts")
    by_name = {p.name: p for p in params}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    if (
        "completions" in by_name
        and by_name["completions"].kind is not inspect.Parameter.POSITIONAL_ONLY
    ):
        named = {
            p.name
            for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        required = {
            p.name
            for p in params
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        return RewardFunction(
            name,
            fn,
            "trl",
            None if var_kw else frozenset(named),
            frozenset(required - set(TRL_KEYWORDS)),
        )
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    required = [
        p
        for p in params
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if (
        positional
        and len(required) <= 1
        and (not required or required[0] is positional[0])
    ):
        return RewardFunction(name, fn, "rollouts")
    raise ValueError(
        f"reward {name!r}: unsupported signature {fn.__name__ if hasattr(fn, '__name__') else 'fn'}"
        f"{inspect.signature(fn)}. Write fn(rollouts) -> list[float | None] (one Rollout batch) or TRL's "
        "fn(prompts, completions, **kwargs) -> list[float | None]"
    )


class CallAbandoned(Exception):
    """A call still running was given up on: past its time limit, or the run was asked to stop."""


def call_reward(
    rf: RewardFunction,
    rollouts: Sequence[Rollout],
    timeout_s: float | None,
    should_stop: Callable[[], bool] | None = None,
) -> Any:
    """One batch call of ``rf`` on private copies of ``rollouts``, within ``timeout_s``; returns its raw output.

    ``should_stop`` (polled while the call runs; e.g. "the trainer received SIGTERM") abandons it early.
    """
    args: tuple = ()
    kwargs: dict[str, Any] = {}
    if rf.style == "rollouts":
        args = (copy.deepcopy(list(rollouts)),)
    else:
        kwargs = trl_arguments(rf, rollouts)
    call = functools.partial(rf.fn, *args, **kwargs)
    try:
        return run_with_timeout(call, timeout_s, f"reward:{rf.name}", should_stop)
    except CallAbandoned as err:
        raise RewardError(
            f"reward function {rf.name!r} {err} on a batch of {len(rollouts)} completions; the step fails and the "
            f"call is abandoned on a daemon thread. Make it faster or raise its timeout_s (rewards[*].timeout_s)"
        ) from None
    except Exception as err:
        # the line that raised: usually in the user's file
        where = traceback.extract_tb(err.__traceback__)[-1]
        raise RewardError(
            f"reward function {rf.name!r} raised {type(err).__name__}: {err}\n  at {where.filename}:{where.lineno} "
            f"in {where.name} (a batch of {len(rollouts)} completions). Fix the function (model.rewards) or its "
            "data columns"
        ) from err


def trl_arguments(rf: RewardFunction, rollouts: Sequence[Rollout]) -> dict[str, Any]:
    """TRL's keyword arguments for ``rollouts``: prompts, completions, completion_ids and the dataset columns."""
    chat = [r.prompt.messages is not None for r in rollouts]
    kwargs: dict[str, Any] = {
        "prompts": [
            copy.deepcopy(r.prompt.messages) if c else r.prompt.text
            for r, c in zip(rollouts, chat)
        ],
        "completions": [
            [{"role": "assistant", "content": r.text}] if c else r.text
            for r, c in zip(rollouts, chat)
        ],
        "completion_ids": [list(r.token_ids) for r in rollouts],
    }
    for column in dict.fromkeys(
        k for r in rollouts for k in r.prompt.meta if k not in INTERNAL_META
    ):
        kwargs.setdefault(
            column, [copy.deepcopy(r.prompt.meta.get(column)) for r in rollouts]
        )
    missing = sorted(rf.required - set(kwargs))
    if missing:
        raise RewardError(
            f"reward function {rf.name!r} requires {missing}, which are not dataset columns (the prompts carry "
            f"{sorted(set(kwargs) - set(TRL_KEYWORDS))}); give them defaults or take **kwargs"
        )
    return (
        kwargs
        if rf.keywords is None
        else {k: v for k, v in kwargs.items() if k in rf.keywords}
    )


def run_with_timeout(
    call: Callable[[], Any],
    timeout_s: float | None,
    thread_name: str,
    should_stop: Callable[[], bool] | None = None,
    poll_s: float = 0.2,
) -> Any:
    """``call()`` on a daemon thread, waiting at most ``timeout_s`` (None: no limit; without ``should_stop`` the call
    then runs in this thread).

    The waiting thread polls ``should_stop`` every ``poll_s`` (it may also raise, e.g. ``StopRequested``): a SIGTERM
    ends the wait at once, where a call on the training thread would hold the run until it returned. An abandoned
    call cannot keep the process alive (daemon thread).

    Raises:
        CallAbandoned: past ``timeout_s``, or ``should_stop()`` turned true.
    """
    if timeout_s is None and should_stop is None:
        return call()
    # no limit, but a stop request still ends the wait
    timeout_s = math.inf if timeout_s is None else timeout_s
    box: dict[str, Any] = {}
    # thread-local in torch: carry the caller's mode over
    grad = torch.is_grad_enabled()
    device = (
        torch.cuda.current_device()
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else None
    )

    def target() -> None:
        try:
            if device is not None:
                # each thread starts on device 0: keep the rank's device
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad):
                box["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the caller, who raises it
            box["error"] = err

    thread = threading.Thread(target=target, name=thread_name, daemon=True)
    start = time.monotonic()
    thread.start()
    while thread.is_alive():
        left = timeout_s - (time.monotonic() - start)
        if left <= 0:
            raise CallAbandoned(f"did not return within timeout_s={timeout_s:g} s")
        if should_stop is not None and should_stop():
            raise CallAbandoned(
                f"was still running after {time.monotonic() - start:.1f} s when the run was asked "
                "to stop (SIGTERM)"
            )
        thread.join(min(poll_s, left))
    if "error" in box:
        raise box["error"]
    return box["value"]


_REAL = (bool, int, float, np.bool_, np.integer, np.floating)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def as_values(name: str, raw: Any, rollouts: Sequence[Rollout]) -> Tensor:
    """A function's output as a ``[N]`` float32 tensor, NaN where it returned None; refuses anything else."""
    n = len(rollouts)
    if isinstance(raw, (Tensor, np.ndarray)) and raw.ndim == 1:
        raw = raw.tolist()
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence):
        raise RewardError(
            f"reward function {name!r} returned a {type(raw).__name__}; it must return a list of {n} numbers "
            "(bool/int/float, or None for no opinion), one per completion, in order"
        )
    if len(raw) != n:
        raise RewardError(
            f"reward function {name!r} returned {len(raw)} values for {n} completions; "
            f"expected exactly {n} (one float per completion, in order)"
        )
    values = []
    for i, v in enumerate(raw):
        if v is not None and not isinstance(v, _REAL):
            raise RewardError(
                f"reward function {name!r} returned {v!r} ({type(v).__name__}) for sample {i} (prompt id "
                f"{rollouts[i].prompt.id}); rewards must be real numbers (bool/int/float) or None"
            )
        values.append(math.nan if v is None else float(v))
        if v is not None and not math.isfinite(values[-1]):
            bad = sum(
                x is not None and isinstance(x, _REAL) and not math.isfinite(float(x))
                for x in raw
            )
            raise RewardError(
                f"reward function {name!r} returned {values[-1]} for sample {i} (prompt id {rollouts[i].prompt.id})"
                f"{f' and {bad - 1} more' if bad > 1 else ''}; rewards must be finite (None means no opinion)"
            )
        # finite in float64, inf in the float32 the advantages and loss use
        if abs(values[-1]) > FLOAT32_MAX:
            raise RewardError(
                f"reward function {name!r} returned {values[-1]:g} for sample {i} (prompt id {rollouts[i].prompt.id})"
                f"; rewards must fit float32 (|reward| <= {FLOAT32_MAX:.3g}): scale the function's output down"
            )
    return torch.tensor(values, dtype=torch.float32)  # [N]
