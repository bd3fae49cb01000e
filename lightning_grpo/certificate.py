"""The consistency certificate: the engine's whole next-token distribution against the trainer's, measured.

The sync probe (``rollout/vllm_server.py``) compares one sampled token's logprob; a stale prefix cache, a bfloat16
head or a batch-variant kernel can leave that token right and the rest of the distribution wrong. Here a fixed set
of probe prompts is completed by the engine at temperature 1 (``ScoresVocabulary.vocabulary_logprobs``: the engine's
log-distribution at every completion position, over the whole vocabulary), the trainer scores the same tokens, and
four figures describe the gap (``mismatch/*``, docs/consistency.md):

* ``kl_mean`` / ``kl_max``: KL(engine || trainer) per position, mean and max over positions;
* ``logprob_diff_max``: the largest |engine - trainer| logprob over the vocabulary and positions;
* ``top1_agree``: the share of positions where both rank the same token first.

``Certifier`` runs it at the first loop step of a fit and after every weight sync (``rollout.certificate``); a
breach warns or stops the run (``ConsistencyError``) with the step, the figures and the likely causes.
``lightning-grpo certify`` prints the same table for a model and engine pair (``certify_cli.py``).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_grpo.rollout.base import Prompt, ScoresVocabulary, VocabDraw
from lightning_grpo.rollout.certificate_config import PROBE_TEXTS, CertificateConfig


class ConsistencyError(RuntimeError):
    """The engine's distribution left the trainer's beyond ``rollout.certificate`` (``on_breach: stop``)."""


@dataclass(frozen=True)
class Figures:
    """One certificate: engine vs trainer over ``positions`` completion positions."""

    kl_mean: float
    """Mean over positions of KL(engine || trainer), nats."""
    kl_max: float
    """Largest per-position KL(engine || trainer), nats."""
    logprob_diff_max: float
    """Largest |engine - trainer| logprob over the vocabulary and positions, nats."""
    top1_agree: float
    """Share of positions whose most likely token is the same on both sides."""
    positions: int
    """Completion positions compared."""
    seconds: float = 0.0
    """Wall time of the certificate (engine draw + trainer forward)."""

    def metrics(self) -> dict[str, float]:
        return {
            "mismatch/kl_mean": self.kl_mean,
            "mismatch/kl_max": self.kl_max,
            "mismatch/logprob_diff_max": self.logprob_diff_max,
            "mismatch/top1_agree": self.top1_agree,
            "mismatch/seconds": self.seconds,
        }

    def table(self) -> str:
        rows = [
            ("positions", f"{self.positions}"),
            ("KL(engine||trainer) mean", f"{self.kl_mean:.3e}"),
            ("KL(engine||trainer) max", f"{self.kl_max:.3e}"),
            ("max |delta logprob| (vocabulary)", f"{self.logprob_diff_max:.3e}"),
            ("top-1 agreement", f"{self.top1_agree:.4f}"),
            ("seconds", f"{self.seconds:.3f}"),
        ]
        return "\n".join(f"{name:<34}{value:>12}" for name, value in rows)


UNMEASURED = {name: math.nan for name in Figures(0.0, 0.0, 0.0, 0.0, 0).metrics()}
"""A loop step with no certificate logs NaN: never the last certificate's figures again."""


def compare(engine: Tensor, trainer: Tensor) -> Figures:
    """The figures of ``[P, V]`` engine and trainer log-distributions at the same ``P`` positions (float64)."""
    p = engine.double()
    q = trainer.double()
    # a token neither side can draw adds nothing
    both = torch.isneginf(p) & torch.isneginf(q)
    gap = torch.where(both, 0.0, p - q)  # [P, V]
    # p log(p / q); 0 where p = 0
    terms = torch.where(torch.isneginf(p), 0.0, p.exp() * gap)
    kl = terms.sum(-1)  # [P]
    top1 = (p.argmax(-1) == q.argmax(-1)).double()
    return Figures(
        float(kl.mean()),
        float(kl.max()),
        float(gap.abs().max()),
        float(top1.mean()),
        p.shape[0],
    )


def trainer_logprobs(
    policy: nn.Module, prompt: list[int], completion: list[int]
) -> Tensor:
    """``[T, V]`` float32 log-softmax of the trainer's logits at the completion's positions (eval mode: no dropout)."""
    device = next(policy.parameters()).device
    ids = torch.tensor([prompt + completion], device=device)
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad():
            logits = policy(ids).logits[0, len(prompt) - 1 : -1]  # [T, V]
    finally:
        policy.train(was_training)
    return logits.float().log_softmax(-1).cpu()


def probe_prompts(tokenizer, count: int) -> list[Prompt]:
    """The first ``count`` fixed probe prompts, encoded (ids from 1e9 up: never a data prompt's)."""
    return [
        Prompt(id=10**9 + i, token_ids=list(tokenizer(t)["input_ids"]), text=t)
        for i, t in enumerate(PROBE_TEXTS[:count])
    ]


def certify(
    engine: ScoresVocabulary,
    policy: nn.Module,
    prompts: list[Prompt],
    cfg: CertificateConfig,
) -> Figures:
    """One certificate of ``engine`` against ``policy`` on ``prompts``."""
    start = time.perf_counter()
    draws = engine.vocabulary_logprobs(prompts, cfg.max_new_tokens, cfg.seed)
    sampler, trainer = _stacked(policy, prompts, draws)
    figures = compare(sampler, trainer)
    return Figures(**{**figures.__dict__, "seconds": time.perf_counter() - start})


def breach(figures: Figures, cfg: CertificateConfig) -> list[str]:
    """The thresholds ``figures`` break, as ``name=value > knob=limit`` lines (none: certified)."""
    out = []
    if not figures.kl_mean <= cfg.max_kl:
        out.append(
            f"KL mean {figures.kl_mean:.3g} > rollout.certificate.max_kl={cfg.max_kl:g}"
        )
    limit = cfg.max_logprob_diff
    if limit is not None and not figures.logprob_diff_max <= limit:
        out.append(
            f"max |delta logprob| {figures.logprob_diff_max:.3g} > rollout.certificate.max_logprob_diff="
            f"{limit:g}"
        )
    return out


def breach_message(step: int, figures: Figures, broken: list[str]) -> str:
    return (
        f"consistency certificate at loop step {step}: the engine's next-token distribution differs from the "
        f"trainer's ({'; '.join(broken)}; KL max {figures.kl_max:.3g}, top-1 agreement {figures.top1_agree:.3f} "
        f"over {figures.positions} positions). Likely causes: a weight sync that did not land or a prefix cache "
        "not reset after it (stale KV), an engine dtype below the trainer's (rollout.vllm.dtype / "
        "rollout.server.dtype: a bfloat16 head), batch-variant kernels, or MoE routing that differs. See "
        "docs/consistency.md."
    )


class Certifier:
    """Runs the certificate at the first loop step of a fit and, when the engine holds weights of its own, after
    every weight sync (each loop step's publication).

    Args:
        cfg: ``rollout.certificate``.
        policy: the trained policy (the trainer side).
        prompts: the probe prompts (``probe_prompts``).
        after_syncs: whether the engine is synced every loop step (False: it samples with the policy itself).
    """

    def __init__(
        self,
        cfg: CertificateConfig,
        policy: nn.Module,
        prompts: list[Prompt],
        after_syncs: bool,
    ) -> None:
        self.cfg = cfg
        self.policy = policy
        self.prompts = prompts
        self.after_syncs = after_syncs
        self.last: Figures | None = None
        self._first = True

    def __call__(self, engine: object, loop_step: int) -> dict[str, float]:
        """``mismatch/*`` of this loop step (NaN when none was due); raises ``ConsistencyError`` on a breach under
        ``on_breach: stop``."""
        if not (self._first or self.after_syncs):
            return dict(UNMEASURED)
        self._first = False
        if not isinstance(engine, ScoresVocabulary):
            raise TypeError(
                f"rollout.certificate: {type(engine).__name__} cannot return its whole next-token "
                "distribution (ScoresVocabulary); use engine hf or vllm, or leave rollout.certificate out"
            )
        self.last = certify(engine, self.policy, self.prompts, self.cfg)
        broken = breach(self.last, self.cfg)
        if broken:
            message = breach_message(loop_step + 1, self.last, broken)
            if self.cfg.on_breach == "stop":
                raise ConsistencyError(message)
            warnings.warn(message, UserWarning, stacklevel=2)
        return self.last.metrics()


def _stacked(
    policy: nn.Module, prompts: list[Prompt], draws: list[VocabDraw]
) -> tuple[Tensor, Tensor]:
    """``[P, V]`` engine and trainer log-distributions over every completion position of every probe."""
    sampler = []
    trainer = []
    for prompt, draw in zip(prompts, draws):
        if not draw.token_ids:
            continue
        sampler.append(draw.logprobs)
        trainer.append(trainer_logprobs(policy, list(prompt.token_ids), draw.token_ids))
    # a head padded past the tokenizer's vocabulary
    width = min(t.shape[-1] for t in sampler + trainer)
    return torch.cat([t[:, :width] for t in sampler]), torch.cat(
        [t[:, :width] for t in trainer]
    )
