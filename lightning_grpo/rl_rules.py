"""The ``rl`` section's rules (``GRPOConfig``): each function lists the broken rules of one concern.

Every problem is a ``field=value: rule; fix`` line; ``GRPOConfig.problems`` gathers them into one
``ConfigError`` (``checks.py``). ``rl`` is a ``GRPOConfig``, not imported: config.py imports this module.
"""

from __future__ import annotations

from lightning_grpo.checks import is_finite, is_int

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "seq-mean-token-sum")
"""``rl.loss_type``: how per-token losses become the step's loss (TRL's names; verl's where TRL has none)."""
RATIO_LEVELS = ("token", "sequence")
"""``rl.ratio_level``: the importance ratio per token (PPO, GRPO) or per sequence (GSPO)."""
LOSS_FORMS = ("ppo_clip", "cispo")
"""``rl.loss``: the clipped surrogate, or CISPO's truncated importance weight on a REINFORCE term."""
PEER_LOSS_NAMES = {
    "bnpo": "TRL's bnpo divides by each micro-batch's own token count, so its step changes with the chunking; here "
    "chunking is exact: use 'dapo' (bnpo's step at one chunk per step on one rank)",
    "token-mean": "verl's token-mean is 'dapo' here",
    "seq-mean-token-mean": "verl's seq-mean-token-mean is 'grpo' here",
    "seq-mean-token-sum-norm": "verl's seq-mean-token-sum-norm is 'dr_grpo' here (loss_scale_factor = "
    "rollout.max_new_tokens; dr_grpo also divides by the number of sequences)",
}
"""Peer names that are not ``rl.loss_type`` values, and what to set instead (docs/objectives.md)."""


def size_problems(rl) -> list[str]:
    """The batch, its group, mini-batch and chunk sizes, and the passes over it."""
    p: list[str] = []
    b = rl.batch_per_replica
    mini = rl.mini_batch_per_replica
    micro = rl.micro_batch_per_replica
    g = rl.group_size
    if not is_int(g) or g < 2:
        p.append(
            f"group_size={g}: must be an integer >= 2 (a group of one has no relative advantage)"
        )
    if not is_int(b) or b <= 0:
        p.append(f"batch_per_replica={b}: must be a positive integer")
    elif is_int(g) and g >= 2 and b % g:
        p.append(
            f"batch_per_replica={b}: must be a multiple of group_size={g}; try {max(g, b - b % g)}"
        )
    if not is_int(mini) or mini < 0:
        p.append(f"mini_batch_per_replica={mini}: must be >= 0 (0 = whole batch)")
    elif is_int(b) and b > 0 and mini > b:
        p.append(
            f"mini_batch_per_replica={mini}: must not exceed batch_per_replica={b}"
        )
    elif is_int(b) and b > 0 and mini and b % mini:
        p.append(
            f"mini_batch_per_replica={mini} must divide batch_per_replica={b} (a ragged step changes its token mean)"
        )
    if not is_int(micro) or micro < 0:
        p.append(
            f"micro_batch_per_replica={micro}: must be >= 0 (0 = one chunk per step)"
        )
    elif not p and micro > rl.mini_batch:
        p.append(
            f"micro_batch_per_replica={micro}: must not exceed the mini-batch ({rl.mini_batch})"
        )
    elif not p and micro and rl.mini_batch % micro:
        p.append(
            f"micro_batch_per_replica={micro} must divide the mini-batch ({rl.mini_batch}) exactly"
        )
    for name in ("max_tokens_per_micro", "max_tokens_per_ahead_micro"):
        value = getattr(rl, name)
        if not is_int(value) or value < 0:
            p.append(
                f"{name}={value}: must be an integer >= 0 (tokens per chunk; 0 = off)"
            )
    if rl.max_tokens_per_micro and rl.micro_batch_per_replica:
        p.append(
            f"max_tokens_per_micro={rl.max_tokens_per_micro} with micro_batch_per_replica="
            f"{rl.micro_batch_per_replica}: two ways to cut a mini-batch into chunks; set one, the other 0"
        )
    if not is_int(rl.mu_iterations) or rl.mu_iterations < 1:
        p.append(
            f"mu_iterations={rl.mu_iterations}: must be an integer >= 1 (passes over each collected batch)"
        )
    return p


def loss_problems(rl) -> list[str]:
    """The clip range, KL weight, advantage scaling, gradient clip and the skip limit."""
    p: list[str] = []
    # CISPO truncates a weight: a lower bound of 0 (epsilon 1.0) is no bound (MiniMax-M1)
    if rl.loss == "cispo":
        if not is_finite(rl.epsilon) or not 0 < rl.epsilon <= 1:
            p.append(
                f"epsilon={rl.epsilon}: with loss='cispo' must be in (0, 1] (1.0 = no lower bound)"
            )
    elif not is_finite(rl.epsilon) or not 0 < rl.epsilon < 1:
        p.append(
            f"epsilon={rl.epsilon}: must be in (0, 1) so the clip range 1 - epsilon stays positive"
        )
    if rl.epsilon_high is not None and (
        not is_finite(rl.epsilon_high) or rl.epsilon_high <= 0
    ):
        p.append(
            f"epsilon_high={rl.epsilon_high}: must be > 0 (or null for symmetric clipping)"
        )
    for name, zero in (
        ("beta", "no KL, no reference model"),
        ("max_grad_norm", "no clipping"),
        ("logits_keep_mb", "always recompute"),
    ):
        value = getattr(rl, name)
        if not is_finite(value) or value < 0:
            p.append(f"{name}={value}: must be a finite number >= 0 (0 = {zero})")
    if rl.scale_rewards not in ("group", "batch", "none"):
        p.append(
            f"scale_rewards={rl.scale_rewards!r}: must be one of 'group', 'batch', 'none'"
        )
    skips = rl.max_consecutive_skips
    if skips is not None and (not is_int(skips) or skips < 0):
        p.append(
            f"max_consecutive_skips={skips!r}: must be an integer >= 0 "
            "(0 = stop at the first skipped step) or null (never stop)"
        )
    return p


def family_problems(rl) -> list[str]:
    """The loss family: divisor, ratio level and surrogate, and the combinations that make no sense."""
    p: list[str] = []
    if rl.loss_type not in LOSS_TYPES:
        hint = PEER_LOSS_NAMES.get(rl.loss_type, "the divisor of the step's loss")
        p.append(
            f"loss_type={rl.loss_type!r}: must be one of {', '.join(map(repr, LOSS_TYPES))}; {hint}"
        )
    if rl.ratio_level not in RATIO_LEVELS:
        p.append(
            f"ratio_level={rl.ratio_level!r}: must be 'token' or 'sequence' (GSPO)"
        )
    if rl.loss not in LOSS_FORMS:
        p.append(f"loss={rl.loss!r}: must be 'ppo_clip' or 'cispo'")
    elif rl.loss == "cispo" and rl.ratio_level == "sequence":
        p.append(
            "ratio_level='sequence' with loss='cispo': CISPO weighs each token's gradient by that token's own "
            "truncated ratio (MiniMax-M1); a sequence ratio has no published CISPO form. Set "
            "ratio_level='token', or loss='ppo_clip' for GSPO"
        )
    if not is_finite(rl.entropy_coef) or rl.entropy_coef < 0:
        p.append(
            f"entropy_coef={rl.entropy_coef}: must be a finite number >= 0 (0 = no entropy bonus)"
        )
    if not is_finite(rl.top_entropy_quantile) or not 0 < rl.top_entropy_quantile <= 1:
        p.append(
            f"top_entropy_quantile={rl.top_entropy_quantile}: must be in (0, 1] (the share of each "
            "sequence's tokens trained; 1.0 = all, the paper's 0.2 = the top 20% by entropy)"
        )
    return p


def pi_old_problems(rl) -> list[str]:
    """Where pi_old comes from, and the routing replay that needs it."""
    p: list[str] = []
    if not isinstance(rl.freeze_pi_old, bool):
        p.append(f"freeze_pi_old={rl.freeze_pi_old!r}: must be true or false")
    if rl.routing_replay not in ("off", "ahead", "rollout"):
        p.append(
            f"routing_replay={rl.routing_replay!r}: must be one of 'off', 'ahead', 'rollout'"
        )
    elif rl.routing_replay == "ahead" and (
        rl.pi_old_is_sampler or not rl.freeze_pi_old
    ):
        knob = (
            "rollout_correction.mode='bypass'"
            if rl.pi_old_is_sampler
            else "freeze_pi_old=false"
        )
        p.append(
            f"routing_replay='ahead': it records routing in the ahead pass, which {knob} turns off; "
            "use routing_replay='rollout' (routing from the engine) or 'off'"
        )
    return p


def shaping_problems(rl) -> list[str]:
    """Dynamic sampling, overlong shaping, truncated completions (the buffer's bound reads rollout: run_check.py)."""
    p: list[str] = []
    if rl.packed != "auto" and not isinstance(rl.packed, bool):
        p.append(f"packed={rl.packed!r}: must be true, false or 'auto'")
    for name in ("dynamic_sampling", "mask_truncated_completions"):
        if not isinstance(getattr(rl, name), bool):
            p.append(f"{name}={getattr(rl, name)!r}: must be true or false")
    if not is_int(rl.max_refill_rounds) or rl.max_refill_rounds < 0:
        p.append(
            f"max_refill_rounds={rl.max_refill_rounds!r}: must be an integer >= 0 (0 = filter, never refill)"
        )
    if not is_int(rl.overlong_buffer) or rl.overlong_buffer < 0:
        p.append(
            f"overlong_buffer={rl.overlong_buffer!r}: must be an integer >= 0 (tokens; 0 = off)"
        )
    if not is_finite(rl.overlong_penalty) or rl.overlong_penalty < 0:
        p.append(
            f"overlong_penalty={rl.overlong_penalty!r}: must be a finite number >= 0"
        )
    return p


def rank_problems(rl, dp: int) -> list[str]:
    """Sizes that must split evenly over ``dp`` data-parallel ranks."""
    p = []
    if rl.prompts_per_batch % dp:
        p.append(
            f"batch_per_replica={rl.batch_per_replica}: its {rl.prompts_per_batch} groups must split evenly "
            f"over DP size {dp} (groups never split across ranks)"
        )
    if rl.mini_batch % dp:
        p.append(f"mini_batch_per_replica={rl.mini_batch}: must divide by DP size {dp}")
    if rl.micro_batch % dp and not rl.max_tokens_per_micro:
        p.append(
            f"micro_batch_per_replica={rl.micro_batch}: must divide by DP size {dp}"
        )
    return p
