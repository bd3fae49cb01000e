"""The built-in tool environment: arithmetic on operands too large to do in one's head, with a calculator.

Written in TRL's ``environment_factory`` form (the form docs/environments.md teaches): ``reset(**row)`` reads the
row's ``answer``, the public methods are the tools, ``reward`` is 1.0 once ``submit`` received the right number.
"""

from __future__ import annotations


class CalculatorEnv:
    """Add and multiply exactly, then submit the result."""

    def __init__(self) -> None:
        self.answer: str | None = None
        self.reward = 0.0
        self.submitted = False

    def reset(self, **row) -> str | None:
        self.answer = str(row.get("answer", "")).strip()
        self.reward = 0.0
        self.submitted = False
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers exactly.

        Args:
            a: the first addend.
            b: the second addend.
        """
        return a + b

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers exactly.

        Args:
            a: the first factor.
            b: the second factor.
        """
        return a * b

    def submit(self, answer: int) -> str:
        """Submit the final answer; it is scored once and the episode's reward is set.

        Args:
            answer: the final result.
        """
        if self.submitted:  # one try per episode: guessing again is not rewarded
            return "already submitted"
        self.reward = float(str(answer) == self.answer)
        self.submitted = True
        return "submitted"
