"""Final answers of math completions: extraction, normalization, and the equivalence check.

A completion states its answer as the last ``\\boxed{...}`` or after the last ``####`` (GSM8K's
convention). Two answers match when their normalized strings are equal (``1,000`` = ``1000.0``)
or, where the optional ``math-verify`` package is installed (``pip install lightning-grpo[math]``),
when it proves them equivalent (``\\frac{1}{2}`` = ``0.5``). Without it the string check alone
decides, so results never depend on the extra beyond those equivalences.
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation

_HASHES = re.compile(r"####\s*([^\n]*)")
NUMBER = re.compile(r"^[-+]?\d+(\.\d+)?$")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced (``\\boxed{\\frac{1}{2}}`` works)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 1
    i = start + len("\\boxed{")
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
    if NUMBER.match(s):
        try:
            value = Decimal(s)
            return format(
                value.to_integral_value()
                if value == value.to_integral_value()
                else value.normalize(),
                "f",
            )
        # unreachable for the regex above; kept to never crash a step on a format quirk
        except InvalidOperation:
            return s
    return s


def answers_match(predicted: str, reference: str) -> bool:
    """Normalized string equality, or math-verify's equivalence where the package is installed."""
    if normalize_answer(predicted) == normalize_answer(reference):
        return True
    verify = _math_verify()
    return verify is not None and verify(reference, predicted)


def _math_verify():
    """``(gold, predicted) -> bool`` from math-verify, or None when it is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None

    def check(gold: str, predicted: str) -> bool:
        # Reward functions run on a worker thread (rewards[*].timeout_s), where math-verify's signal-based
        # timeouts cannot be armed: there they are off and the reward's own timeout bounds the call.
        limit = 5 if threading.current_thread() is threading.main_thread() else None
        gold_parsed = parse(_math(gold), parsing_timeout=limit)
        predicted_parsed = parse(_math(predicted), parsing_timeout=limit)
        return bool(
            gold_parsed
            and predicted_parsed
            and verify(gold_parsed, predicted_parsed, timeout_seconds=limit)
        )

    return check


def _math(answer: str) -> str:
    """A bare answer as LaTeX math, so math-verify parses ``1/2`` and ``\\frac{1}{2}`` alike."""
    return answer if "$" in answer else f"${answer}$"
