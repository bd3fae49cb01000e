"""On-policy distillation (OPD): the student samples, a frozen teacher scores the same tokens, and the loss is
the per-token reverse KL ``KL(student || teacher)``, token-mean normalized with the deferred divisor.

Two forms of the per-token KL (``opd.kl``):

* ``full``: the exact KL over the whole vocabulary at every completion position, differentiated directly
  (``kl.reverse_kl``, chunked over tokens: no ``[B, T, V]`` float32 tensor). Needs a Hugging Face teacher
  with the student's vocabulary.
* ``sampled``: the one-sample estimate ``k = log p_s(y_t) - log p_t(y_t)`` at the sampled token, used as a
  per-token cost in a score-function gradient: the surrogate ``k + sg(k) * (log p_s - sg(log p_s))`` has
  value ``k`` and gradient ``k * grad log p_s`` (discount 0: each token answers for its own KL). Reads only
  the teacher's logprob of the sampled token, so a vLLM teacher (prompt logprobs) serves it.

The direct form (``use_rewards=false``) has no ratio: it consumes no pi_old, ``needs_old_logprobs()`` is
false, and mini-batching runs no ahead pass. With ``use_rewards=true`` the loss is the GRPO clipped
surrogate plus ``beta_opd`` times the KL term; both terms are sums over the same completion tokens divided
by the same global (DP-mean) token count, so the sum is exactly the token mean of the combined per-token
loss and chunking stays exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from lightning_grpo.batch import RolloutBatch
from lightning_grpo.checks import raise_problems
from lightning_grpo.config import GRPOConfig, VLLMConfig
from lightning_grpo.distributed import single_process
from lightning_grpo.objectives.base import PolicyView, Reduction, nonzero
from lightning_grpo.objectives.chunk_stats import ChunkStats
from lightning_grpo.objectives.entropy import token_mean
from lightning_grpo.objectives.grpo import DPMean, GRPOObjective
from lightning_grpo.objectives.kl import (
    CHUNK_BYTES,
    chunk_tokens,
    completion_hidden,
    reverse_kl,
)
from lightning_grpo.objectives.teacher import (
    HFTeacher,
    VLLMTeacher,
    check_same_vocab,
    model_vocab_size,
)
from lightning_grpo.policy import PolicyConfig


@dataclass
class OPDConfig:
    """The ``opd`` section: the teacher and the distillation loss (used when ``model.objective: opd``)."""

    teacher: PolicyConfig | None = None
    """The teacher model (same fields as ``policy``: a Hugging Face folder or ``tiny:<name>``, dtype, ...). Required.
    It must share the student's tokenizer."""
    teacher_engine: Literal["hf", "vllm"] = "hf"
    """hf: a frozen transformers model (both KL forms); vllm: an in-process vLLM engine returning prompt logprobs of
    the student's tokens (kl=sampled only)."""
    teacher_device: str | None = None
    """Device of an hf teacher (e.g. ``cuda:1``); null = the policy's device."""
    teacher_vllm: VLLMConfig | None = None
    """How the vLLM teacher engine is built (null = VLLMConfig defaults)."""
    kl: Literal["full", "sampled"] = "full"
    """full: exact reverse KL over the vocabulary at every completion token (chunked over tokens); sampled: the
    one-sample estimate at the sampled token (score-function gradient, cheaper, noisier)."""
    beta_opd: float = 1.0
    """Weight of the KL term."""
    use_rewards: bool = False
    """false: distillation alone (no ratio, no pi_old, no ahead pass). true: GRPO's clipped surrogate on the reward
    advantages plus beta_opd x KL, both normalized by the same global token count."""
    kl_chunk_mb: float = CHUNK_BYTES / 2**20
    """Float32 logits of one chunk of positions in the full KL, in MiB (memory only: the result is unchanged)."""

    def __post_init__(self) -> None:
        if isinstance(self.teacher, dict):
            self.teacher = PolicyConfig(**self.teacher)
        raise_problems("opd config", self.problems())

    def problems(self) -> list[str]:
        """Every broken rule of this section as a ``field=value: rule; fix`` line."""
        p = []
        if self.kl == "full" and self.teacher_engine == "vllm":
            p.append(
                "kl='full' with teacher_engine='vllm': vLLM returns the sampled token's logprob only; use "
                "kl=sampled, or teacher_engine=hf for the full-vocabulary KL"
            )
        if self.teacher_engine == "vllm" and self.teacher_device is not None:
            p.append(
                f"teacher_device={self.teacher_device!r}: applies to an hf teacher; place a vLLM teacher through "
                "teacher_vllm (e.g. CUDA_VISIBLE_DEVICES)"
            )
        if not (
            isinstance(self.beta_opd, (int, float))
            and math.isfinite(self.beta_opd)
            and self.beta_opd >= 0
        ):
            p.append(f"beta_opd={self.beta_opd}: must be a finite number >= 0")
        if not (math.isfinite(self.kl_chunk_mb) and self.kl_chunk_mb > 0):
            p.append(f"kl_chunk_mb={self.kl_chunk_mb}: must be > 0")
        return p


@dataclass(frozen=True)
class OPDStats(ChunkStats):
    """GRPO's figures (neutral when the reward term is off: no ratio, nothing clipped) plus the distillation's."""

    REDUCE: ClassVar[dict[str, Reduction]] = {
        **ChunkStats.REDUCE,
        "opd_kl": ("opd/kl", "tokens"),
        "teacher_logprob": ("opd/teacher_logprob", "tokens"),
    }
    opd_kl: Tensor = field(default=None)
    """Token mean of the per-token reverse KL (the full KL, or the sampled estimate) over this rank's tokens."""
    teacher_logprob: Tensor = field(default=None)
    """Token mean of the teacher's logprob of the sampled tokens (rises as the student samples what it likes)."""


class OPDObjective:
    """Reverse KL to a teacher on the student's own samples, optionally added to GRPO's surrogate.

    Args:
        config: the ``opd`` section.
        rl: the ``rl`` section (clip range and k3 KL of the GRPO term when ``use_rewards``).
        dp_mean: all-reduce mean over data-parallel ranks for the divisor.
    """

    name = "opd"
    stats = OPDStats  # names every figure of a loop step where no chunk stepped

    def __init__(
        self,
        config: OPDConfig | None,
        rl: GRPOConfig | None = None,
        dp_mean: DPMean = single_process,
    ):
        self.config = config or OPDConfig()
        # the rules across opd and rl are checked before any model loads (run_check.py)
        rl = rl or GRPOConfig()
        self.grpo = GRPOObjective(rl.epsilon, rl.epsilon_high, rl.beta, dp_mean=dp_mean)
        self.teacher: HFTeacher | VLLMTeacher | None = None  # built by setup()
        self._dp_mean = dp_mean

    @property
    def dp_mean(self) -> DPMean:
        return self._dp_mean

    @dp_mean.setter
    def dp_mean(self, fn: DPMean) -> None:  # one divisor reduction for both terms
        self._dp_mean = self.grpo.dp_mean = fn

    def needs_old_logprobs(self) -> bool:
        """Only the GRPO term has a ratio; distillation alone reads no pi_old (no ahead pass at n_mini > 1)."""
        return self.config.use_rewards

    def needs_reference(self) -> bool:
        return self.config.use_rewards and self.grpo.beta > 0

    def setup(self, policy: nn.Module, tokenizer) -> None:
        """Load the teacher once and refuse one that reads token ids differently (both vocab sizes named)."""
        if self.teacher is not None:
            return
        c = self.config
        teacher = (
            VLLMTeacher(c.teacher, c.teacher_vllm)
            if c.teacher_engine == "vllm"
            else HFTeacher(c.teacher, c.teacher_device)
        )
        try:
            check_same_vocab(
                model_vocab_size(policy),
                tokenizer,
                teacher.vocab_size,
                teacher.tokenizer,
                need_same_size=c.kl == "full",
            )
        except ValueError:
            if isinstance(teacher, VLLMTeacher):
                teacher.close()
            raise
        self.teacher = teacher

    def chunk_loss(
        self, chunk: RolloutBatch, policy: PolicyView, old_logprobs: Tensor | None
    ) -> tuple[Tensor, Tensor, OPDStats]:
        if self.teacher is None:
            raise RuntimeError(
                "OPDObjective.setup(policy, tokenizer) was not called: the teacher is not loaded"
            )
        mask = chunk.completion_mask[:, 1:]  # [B, T-1]
        if self.config.kl == "full":
            logprobs, kl, teacher_lp, entropy = self._full(chunk, mask, policy)
        else:
            logprobs, entropy = self._student(chunk, policy)
            teacher_lp = self.teacher.token_logprobs(chunk).to(logprobs.dtype)
            k = (logprobs - teacher_lp).detach()
            # value k, gradient k * grad log p_s
            kl = k + k * (logprobs - logprobs.detach())
        m = mask.to(kl.dtype)
        if self.config.use_rewards:
            ref = (
                policy.reference(chunk)
                if self.needs_reference() and policy.reference is not None
                else None
            )
            g_loss, denom, g = self.grpo(
                logprobs, mask, chunk.advantages, old_logprobs, ref, entropy=entropy
            )
            loss = g_loss + self.config.beta_opd * (kl * m).sum() / nonzero(denom)
        else:
            tokens = m.sum()
            denom = self._dp_mean(tokens.detach())
            loss = self.config.beta_opd * (kl * m).sum() / nonzero(denom)
            g = _neutral(loss, denom, tokens, m, entropy)
        with torch.no_grad():
            local = m.sum().clamp(min=1)
            stats = OPDStats(
                **{**g.__dict__, "loss": loss.detach()},
                opd_kl=(kl.detach() * m).sum() / local,
                teacher_logprob=(teacher_lp.detach() * m).sum() / local,
            )
        return loss, denom, stats

    token_figure = "kl_to_teacher"
    """What the completions log shows per token (``objectives.base.ExplainsTokens``)."""

    def uses_advantages(self) -> bool:
        return self.config.use_rewards

    @torch.no_grad()
    def token_figures(self, chunk: RolloutBatch, policy: PolicyView) -> Tensor:
        """``[B, T-1]`` the per-token KL the loss drives down: the full KL, or the sampled estimate."""
        mask = chunk.completion_mask[:, 1:]  # [B, T-1]
        if self.config.kl == "full":
            return self._full(chunk, mask, policy)[1]
        logprobs = policy.logprobs(chunk)
        return (logprobs - self.teacher.token_logprobs(chunk).to(logprobs.dtype)) * mask

    @staticmethod
    def _student(
        chunk: RolloutBatch, policy: PolicyView
    ) -> tuple[Tensor, Tensor | None]:
        """The student's token logprobs, and its entropy from the same head pass when the view measures it."""
        if policy.logprobs_and_entropy is None:
            # grpo/entropy is then NaN: not measured
            return policy.logprobs(chunk), None
        return policy.logprobs_and_entropy(chunk, False)

    def _full(
        self, chunk: RolloutBatch, mask: Tensor, policy: PolicyView
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Exact per-token KL, the student's token logprobs, the teacher's and the student's entropy from one pass of
        each head (``[B, T-1]`` each)."""
        teacher = self.teacher
        t_hidden = teacher.completion_hidden(chunk)  # [N, H_t], no grad
        targets = chunk.input_ids[:, 1:][mask]  # [N]

        def teacher_logprobs(start: int, end: int) -> Tensor:
            return teacher.distribution(t_hidden[start:end])  # [end - start, V]

        def student(model: nn.Module) -> tuple[Tensor, Tensor, Tensor, Tensor]:
            # [N, H]
            hidden = completion_hidden(
                model, chunk.input_ids, chunk.attention_mask, mask
            )
            head = model.get_output_embeddings()
            step = chunk_tokens(
                head.weight.shape[0], int(self.config.kl_chunk_mb * 2**20)
            )
            return reverse_kl(
                hidden,
                head,
                targets,
                teacher_logprobs,
                temperature=policy.temperature,
                chunk=step,
            )

        kl, logprob, teacher_lp, entropy = policy.call(student, policy.model)
        return (
            _scatter(logprob, mask),
            _scatter(kl, mask),
            _scatter(teacher_lp, mask),
            _scatter(entropy, mask),
        )


def _scatter(values: Tensor, mask: Tensor) -> Tensor:
    """``[N]`` values at the True positions of ``mask`` -> ``[B, T-1]`` with zeros elsewhere (differentiable)."""
    out = values.new_zeros(mask.shape)
    return out.masked_scatter(mask, values)


def _neutral(
    loss: Tensor, denom: Tensor, tokens: Tensor, m: Tensor, entropy: Tensor | None
) -> ChunkStats:
    """GRPO's figures when there is no GRPO term: ratio 1, nothing clipped, no k3 KL (``m``: the ``[B, T-1]`` mask)."""
    zero = tokens.new_zeros(())
    return ChunkStats(
        loss=loss.detach(),
        denom=denom,
        tokens=tokens,
        n=torch.tensor(float(m.shape[0]), dtype=torch.float32),
        clip_frac=zero,
        ratio_mean=zero + 1,
        ratio_max=zero + 1,
        kl=zero,
        clip_frac_low=zero,
        clip_frac_high=zero,
        seqs=(m.sum(-1) > 0).to(m.dtype).sum(),
        entropy=token_mean(entropy, m, tokens),
    )
