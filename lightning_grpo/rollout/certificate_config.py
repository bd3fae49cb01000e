"""``CertificateConfig``: the consistency certificate's knobs (``rollout.certificate``; ``certificate.py`` runs it).

A plain dataclass beside the engines, like ``VLLMConfig``: it imports nothing but ``checks.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_grpo.checks import is_finite, is_int, raise_problems


@dataclass
class CertificateConfig:
    """Engine vs trainer over the whole vocabulary, at the first loop step of a fit and after every weight sync.

    A few fixed probe prompts are completed by the engine at temperature 1 (seeded); at every completion position the
    engine's next-token log-distribution is compared with the trainer's on the same tokens (docs/consistency.md).
    """

    prompts: int = 4
    """Probe prompts (a fixed set, the same at every check)."""
    max_new_tokens: int = 16
    """Completion tokens per probe prompt: each is one position compared over the whole vocabulary."""
    max_kl: float = 1e-3
    """Alarm when the mean KL(engine || trainer) over the positions exceeds this (nats). Measured on the tiny
    quickstart policy: float32 engines |KL| < 1e-7, a bfloat16 vLLM against the float32 trainer 2e-5, a prefix cache
    left stale after a sync 5e-2 (docs/consistency.md)."""
    max_logprob_diff: float | None = None
    """Alarm when the largest |engine - trainer| logprob over the vocabulary and positions exceeds this (nats); None =
    not checked (rare tokens of a bfloat16 engine differ by whole nats, harmlessly)."""
    on_breach: Literal["warn", "stop"] = "warn"
    """What a breach does: warn (once per breach, naming the step and figures), or stop the run with that message
    (the checkpoint of the last boundary is kept)."""
    seed: int = 0
    """Seed of the probe completions."""

    def __post_init__(self) -> None:
        raise_problems("rollout.certificate", self.problems())

    def problems(self) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line."""
        p = []
        if not is_int(self.prompts) or not 1 <= self.prompts <= len(PROBE_TEXTS):
            p.append(
                f"prompts={self.prompts!r}: must be an integer in 1..{len(PROBE_TEXTS)}"
            )
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            p.append(f"max_new_tokens={self.max_new_tokens!r}: must be an integer >= 1")
        if not is_finite(self.max_kl) or self.max_kl <= 0:
            p.append(
                f"max_kl={self.max_kl!r}: must be a number > 0 (nats); to turn the certificate off, leave "
                "rollout.certificate out"
            )
        if self.max_logprob_diff is not None and (
            not is_finite(self.max_logprob_diff) or self.max_logprob_diff <= 0
        ):
            p.append(
                f"max_logprob_diff={self.max_logprob_diff!r}: must be a number > 0 (nats), or null (not checked)"
            )
        if self.on_breach not in ("warn", "stop"):
            p.append(f"on_breach={self.on_breach!r}: must be 'warn' or 'stop'")
        if not is_int(self.seed):
            p.append(f"seed={self.seed!r}: must be an integer")
        return p


PROBE_TEXTS = (
    "(12+34)*56-78=90; (9+8)*7-6=5; 3*3*3=27; 100-1=99; 4+4+4+4=16; 7*8=",
    "The quick brown fox jumps over the lazy dog, and then the dog sleeps. ",
    "Question: what is 15 plus 27? Think step by step, then answer. Answer:",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints ",
    "Once upon a time, in a village by the sea, there lived an old sailor who",
    "1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, ",
    "Translate to French: 'The cat is on the table.' French: 'Le chat est ",
    "A list of primes: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, ",
)
"""The fixed probe prompts (each longer than one 32-token prefix-cache block for a character tokenizer, so a
stale cached prefix is reused and shows)."""
