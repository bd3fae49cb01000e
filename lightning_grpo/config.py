"""Configuration dataclasses: every knob, its default, and the rules checked at load.

Each dataclass validates itself in ``__post_init__``, so jsonargparse (and any Python
caller) refuses a bad config before a model is built. Every problem is collected and
reported at once as ``field=value: rule; fix`` lines in one ``ConfigError`` (``checks.py``;
the ``rl`` section's rules are in ``rl_rules.py``). Derived counts (``n_mini``, ``n_micro``, per-rank sizes) are methods, never fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lightning_grpo import rl_rules
from lightning_grpo.checks import ConfigError, is_finite, raise_problems, retire
from lightning_grpo.correction import RolloutCorrection
from lightning_grpo.rl_rules import LOSS_FORMS, LOSS_TYPES, RATIO_LEVELS
from lightning_grpo.rollout.certificate_config import CertificateConfig
from lightning_grpo.rollout.rollout_config import RolloutConfig  # importable from here
from lightning_grpo.rollout.server_config import ServerConfig
from lightning_grpo.rollout.vllm_config import VLLMConfig

__all__ = [
    "LOSS_FORMS",
    "LOSS_TYPES",
    "RATIO_LEVELS",
    "CertificateConfig",
    "ConfigError",
    "GRPOConfig",
    "OptimConfig",
    "RankSizes",
    "RolloutConfig",
    "ServerConfig",
    "VLLMConfig",
]


@dataclass(frozen=True)
class RankSizes:
    """Per-data-parallel-rank sizes of one collected batch (trajectories)."""

    batch: int
    mini: int
    micro: int


GRAD_ACCUM_RETIRED = (
    "rl.grad_accum is retired for GRPO and was removed: the accumulation count is derived, n_micro = "
    "mini_batch_per_replica / micro_batch_per_replica. Set micro_batch_per_replica (trajectories per "
    "forward/backward) or max_tokens_per_micro instead"
)
"""Why ``rl.grad_accum`` is refused (from Python and from the CLI) and what to set instead."""
BYPASS_RENAMED = (
    "rl.use_rollout_logprobs_for_loss was renamed: set rl.rollout_correction.mode=bypass (pi_old = the sampler's "
    "logprobs), one of the rollout-correction modes (docs/objectives.md)"
)
PI_OLD_DERIVED = (
    "rl.needs_cached_old_logprobs was removed: it was derived, never a knob. Where pi_old comes from is decided from "
    "rl.rollout_correction.mode (bypass: the sampler's logprobs), rl.freeze_pi_old, n_mini and mu_iterations "
    "(lightning_grpo.update.plan.pi_old_source); drop the key"
)


@retire(
    "rl",
    "rl config",
    grad_accum=GRAD_ACCUM_RETIRED,
    use_rollout_logprobs_for_loss=BYPASS_RENAMED,
    needs_cached_old_logprobs=PI_OLD_DERIVED,
)
@dataclass
class GRPOConfig:
    """The ``rl`` section: how a collected batch is sized, split and optimized."""

    batch_per_replica: int = 32
    """Trajectories per loop step, per policy replica (prompts x group_size). Positive multiple of group_size."""
    mini_batch_per_replica: int = 0
    """Trajectories per optimizer step; 0 = the whole batch (one step). n_mini = batch / mini."""
    micro_batch_per_replica: int = 0
    """Trajectories per forward/backward chunk; 0 = one chunk. Memory only: the step result is unchanged."""
    max_tokens_per_micro: int = 0
    """Token budget of one forward/backward chunk (rows x the chunk's longest prompt + completion); 0 = off. Each
    mini-batch is cut into the fewest balanced chunks under it, per collected batch (a hard cap: only a sequence
    longer than the budget exceeds it, alone). Replaces micro_batch_per_replica; the step result is unchanged."""
    max_tokens_per_ahead_micro: int = 0
    """Token budget of one chunk of the no-grad ahead pass (frozen pi_old); 0 = 2 x max_tokens_per_micro, or the
    training chunks when that is off."""
    mu_iterations: int = 1
    """Inner epochs: passes over each collected batch, every optimizer step against the one frozen pi_old of the
    rollout policy. Optimizer steps per loop step = mu_iterations x n_mini."""
    group_size: int = 8
    """Completions drawn per prompt (the GRPO group)."""
    epsilon: float = 0.2
    """Lower clip range: the ratio is clipped below at 1 - epsilon; in (0, 1), or (0, 1] with loss=cispo (1.0: none)."""
    epsilon_high: float | None = None
    """Upper clip range (1 + epsilon_high); None = epsilon (symmetric clip)."""
    beta: float = 0.0
    """Weight of the k3 KL penalty to the reference policy; 0 = no reference model is built."""
    loss_type: Literal["dapo", "grpo", "dr_grpo", "seq-mean-token-sum"] = "dapo"
    """How per-token losses become the step's loss (TRL's names): dapo = token mean over the optimizer step's
    completion tokens (all ranks); grpo = each sequence's token mean, then the mean over sequences; dr_grpo = token
    sum over rollout.max_new_tokens x sequences (Dr. GRPO); seq-mean-token-sum = each sequence's token sum, mean over
    sequences (verl's name). Exact under any chunking. See docs/objectives.md ("GRPO's loss family")."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or per sequence (GSPO: exp of the mean over the sequence's tokens of
    logp - logp_old, clipped per sequence; TRL's importance_sampling_level). GSPO clips far tighter (3e-4 / 4e-4)."""
    loss: Literal["ppo_clip", "cispo"] = "ppo_clip"
    """ppo_clip: -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A). cispo: -sg(clip(r, 1 - epsilon, 1 + epsilon_high))
    A log pi, a gradient through every token (MiniMax-M1; epsilon 1.0 = no lower bound, as MiniMax-M1 and TRL)."""
    entropy_coef: float = 0.0
    """Entropy bonus: coef x the policy's entropy is subtracted from each completion token's loss, under the loss's own
    divisor. > 0 adds a checkpointed pass of the LM head for the entropy's gradient. grpo/entropy is logged always."""
    top_entropy_quantile: float = 1.0
    """Train the surrogate only on each sequence's top share of completion tokens by entropy (Wang et al. 2025,
    "Beyond the 80/20 rule"; TRL's name), in (0, 1]; 1.0 = every token. Per sequence, not over the batch as in the
    paper and TRL, so it is exact under any chunking (docs/objectives.md). The KL term and the divisor are unchanged."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this after normalization; 0 disables clipping."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: divide by the group's reward std, the batch's, or not at all."""
    deterministic: bool = False
    """Deterministic kernels and seeding (see determinism.py); CUBLAS_WORKSPACE_CONFIG must come from the launch env."""
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    """Correct for the sampler != the trainer with the sampler's logprobs: mode off | tis | mask | icepop | bypass
    (pi_old = the sampler's logprobs, no ahead pass), level, threshold, band. See docs/objectives.md."""
    freeze_pi_old: bool = True
    """Keep pi_old frozen across the window at n_mini > 1 (the ahead pass). Diagnostic only: false lets pi_old follow
    the drifting policy, so the ratio returns to 1 every mini-batch and the clip never binds (reproduces the collapse)."""
    max_consecutive_skips: int | None = 8
    """Stop the run with an error naming the last non-finite loss or gradient once more than this many optimizer steps
    in a row were skipped for non-finite values (global_step counts only steps taken, so an always-NaN run would
    never reach max_steps); null = never stop."""
    logits_keep_mb: float = 256.0
    """Float32 LM-head logits (MiB, per chunk) kept from forward for backward; past it the head is recomputed in
    backward. Memory only: the update is unchanged (logprobs.py). 0 = always recompute (least memory)."""
    packed: bool | Literal["auto"] = False
    """Padding-free chunks: each chunk's rows as one sequence, attention within each row, and max_tokens_per_micro
    counting real tokens only. Same update to rounding, 2.55x less update memory on long-tail lengths, CPU time 1.04x
    (docs/packing.md). false (default) = padded; true = packed, refusing a policy it cannot pack exactly (VLM,
    routing replay, sliding-window or non-sdpa/eager attention); auto = packed where exact, on CPU."""
    routing_replay: Literal["off", "ahead", "rollout"] = "off"
    """Sparse-MoE policies: pin each token's top-k experts. ahead = record them per row in the ahead pass and replay
    them in the probe and every later forward of the row (any chunk split, token budget, inner epoch); rollout =
    take them from the rollout engine (needs an engine that returns routing; vLLM CPU 0.32 cannot). Refused on a
    model without MoE layers. See docs/moe.md."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards all agree (advantage 0, nothing to learn) and refill from
    further prompts until the batch holds prompts_per_batch informative groups or max_refill_rounds refills were
    drawn; a batch still short trains on what there is (warned; the rest pads with groups that count nowhere)."""
    max_refill_rounds: int = 3
    """Refill rounds per loop step under dynamic_sampling; each draws another prompts_per_batch prompts (all ranks
    draw while any rank is short)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: over the last overlong_buffer tokens before rollout.max_new_tokens the reward
    falls linearly to -overlong_penalty (eq. 13); 0 = off."""
    overlong_penalty: float = 1.0
    """The penalty at rollout.max_new_tokens (overlong_buffer > 0)."""
    mask_truncated_completions: bool = False
    """Leave completions that hit rollout.max_new_tokens without EOS or a stop string out of the loss and its divisor;
    their rewards still count in their group's advantages (TRL's knob)."""

    def __post_init__(self) -> None:
        if isinstance(self.rollout_correction, dict):  # a Python caller's plain dict
            self.rollout_correction = RolloutCorrection(**self.rollout_correction)
        self.validate()

    # -- derived counts ------------------------------------------------------------------------------------------
    @property
    def pi_old_is_sampler(self) -> bool:
        """pi_old is the sampler's logprobs (``rollout_correction.mode=bypass``): no ahead pass."""
        return self.rollout_correction.mode == "bypass"

    @property
    def needs_sampler_logprobs(self) -> bool:
        """The engine must return its per-token logprobs (any rollout-correction mode but off)."""
        return self.rollout_correction.needs_sampler_logprobs

    @property
    def mini_batch(self) -> int:
        """Trajectories per optimizer step, with the 0 sentinel resolved."""
        return self.mini_batch_per_replica or self.batch_per_replica

    @property
    def micro_batch(self) -> int:
        """Trajectories per chunk, with the 0 sentinel resolved."""
        return self.micro_batch_per_replica or self.mini_batch

    @property
    def n_mini(self) -> int:
        """Optimizer steps per collected batch. DP-invariant: batch/mini == batch_per_dp/mini_per_dp."""
        return self.batch_per_replica // self.mini_batch

    @property
    def n_micro(self) -> int:
        """Forward/backward chunks per optimizer step: the accumulation count (the retired ``rl.grad_accum``)."""
        return self.mini_batch // self.micro_batch

    @property
    def steps_per_loop_step(self) -> int:
        """Optimizer steps per collected batch: mu_iterations x n_mini (trainer.max_steps counts these)."""
        return self.mu_iterations * self.n_mini

    @property
    def ahead_budget(self) -> int:
        """Token budget of an ahead-pass chunk: max_tokens_per_ahead_micro, else 2 x max_tokens_per_micro (0: the
        ahead pass walks the training chunks)."""
        return self.max_tokens_per_ahead_micro or 2 * self.max_tokens_per_micro

    @property
    def prompts_per_batch(self) -> int:
        """Prompts per loop step (per replica): batch_per_replica / group_size."""
        return self.batch_per_replica // self.group_size

    def rank_sizes(self, dp_size: int) -> RankSizes:
        """Sizes of one rank's share; raises ConfigError if they do not divide by ``dp_size``."""
        self.validate(dp_size)
        return RankSizes(
            self.batch_per_replica // dp_size,
            self.mini_batch // dp_size,
            self.micro_batch // dp_size,
        )

    # -- validation ----------------------------------------------------------------------------------------------
    def validate(self, dp_size: int = 1) -> None:
        """Raise one ConfigError listing every broken rule (``dp_size`` adds the per-rank rules)."""
        raise_problems("rl config", self.problems(dp_size))

    def problems(self, dp_size: int = 1) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line; the per-rank rules once the rest hold."""
        p = (
            rl_rules.size_problems(self)
            + rl_rules.loss_problems(self)
            + rl_rules.family_problems(self)
            + rl_rules.pi_old_problems(self)
        )
        p += rl_rules.shaping_problems(self)
        if not p and dp_size > 1:
            p += rl_rules.rank_problems(self, dp_size)
        return p


@dataclass
class OptimConfig:
    """The optimizer and its schedule (stepped by us once per optimizer step)."""

    lr: float = 1e-5
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    warmup_steps: int = 0
    """Linear warmup from 0, in optimizer steps (not loop steps); transformers' convention (step 0 runs at lr 0)."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """LR after warmup (transformers' schedules): constant, or cosine / linear decay to 0 over the horizon."""
    total_steps: int = 0
    """Horizon of a decaying schedule, in optimizer steps. 0 = the run's length: trainer.max_steps, else
    max_epochs x limit_train_batches (loop steps) x n_mini. A decaying schedule with neither is refused."""
    fused: bool | None = None
    """AdamW's fused kernel. None = fused where the device has one (CPU, CUDA) unless an fp16 GradScaler is in use
    (16-mixed: the scaler must unscale before our clip); False = torch's default kernel (foreach on CUDA). Same hyper-parameters either way."""

    def __post_init__(self) -> None:
        raise_problems("optim config", self.problems())

    def problems(self) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line."""
        p = []
        if not is_finite(self.lr) or self.lr <= 0:
            p.append(f"lr={self.lr}: must be a finite number > 0")
        if self.weight_decay < 0:
            p.append(f"weight_decay={self.weight_decay}: must be >= 0")
        if not all(0 <= b < 1 for b in self.betas):
            p.append(f"betas={self.betas}: each must be in [0, 1)")
        if self.warmup_steps < 0:
            p.append(f"warmup_steps={self.warmup_steps}: must be >= 0")
        if self.total_steps < 0:
            p.append(f"total_steps={self.total_steps}: must be >= 0")
        elif (
            self.total_steps
            and self.schedule != "constant"
            and self.warmup_steps >= self.total_steps
        ):
            p.append(
                f"warmup_steps={self.warmup_steps}: must be below total_steps={self.total_steps}, or the "
                f"{self.schedule} decay never starts"
            )
        return p
