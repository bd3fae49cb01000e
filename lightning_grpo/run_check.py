"""``check_run``: every rule that reads more than one config section, in one place, before any model is loaded.

Each section refuses its own bad values when it is built (``GRPOConfig.__post_init__`` and the like). The rules here
read two sections or more (``rl`` with ``rollout``, ``policy.lora`` with ``rollout.server``, the objective with
``opd``), so no section can check them alone. ``check_run`` takes config objects and plain values only, never a
module or a model, and reports every broken rule at once as ``field=value: rule; fix`` lines in one ``ConfigError``.

Who runs it: ``GRPOModule.__init__`` through ``check_module`` (every rule that needs no data-parallel size),
``GRPOModule.setup`` through ``check_ranks`` and the CLI once the Trainer exists (with ``dp_size``: the rules that
depend on how many ranks train), all before the policy's weights are read. ``check_parts`` (``GRPOModule.setup``, before the policy loads) refuses what needs no weight but
loads or asks something: the environment, a reward's data columns, async with a sleeping engine, a server URL.
Rules that need the loaded model (MoE layers, whether a policy packs exactly, the tokenizer's
chat template) stay where the model is: ``routing/``, ``packing.py``, ``envs/``.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_grpo import lora
from lightning_grpo.checks import ConfigError, raise_problems
from lightning_grpo.config import GRPOConfig, RolloutConfig, ServerConfig
from lightning_grpo.data.rewards import RewardSpec, check_reward_columns
from lightning_grpo.data.seam import PromptProvider
from lightning_grpo.envs.config import EnvConfig
from lightning_grpo.envs.environment import load_env, load_parser
from lightning_grpo.objectives import OBJECTIVES
from lightning_grpo.objectives.opd import OPDConfig
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.rollout.server.placement import hop_transport
from lightning_grpo.rollout.server.pool import check_answers
from lightning_grpo.routing.replay import rollout_refusal
from lightning_grpo.update.ahead import warn_if_unfrozen

OPD_FAMILY = (
    ("loss_type", "dapo"),
    ("ratio_level", "token"),
    ("loss", "ppo_clip"),
    ("entropy_coef", 0.0),
    ("top_entropy_quantile", 1.0),
)
"""``rl`` knobs objective=opd needs at their defaults: its token-mean KL shares the default GRPO term's divisor."""


def check_run(
    policy: PolicyConfig,
    rl: GRPOConfig,
    rollout: RolloutConfig,
    opd: OPDConfig | None = None,
    objective: str | None = "grpo",
    dp_size: int | None = None,
) -> None:
    """Raise one ``ConfigError`` listing every broken rule across sections (none broken: return).

    Args:
        policy: the ``policy`` section.
        rl: the ``rl`` section.
        rollout: the ``rollout`` section.
        opd: the ``opd`` section (None: not given).
        objective: the registered objective's name (``model.objective``); None for an objective instance built in
            Python, which brings its own configuration (no objective rule applies).
        dp_size: data-parallel ranks (the Trainer's world size); None before a Trainer exists, which leaves out the
            rules that depend on it.
    """
    p = (
        sampler_logprobs_problems(rl, rollout)
        + overlong_problems(rl, rollout)
        + async_problems(rl, rollout)
    )
    p += server_problems(policy, rollout, dp_size) + routing_problems(rl, rollout)
    if objective is not None:
        p += objective_problems(objective, rl, opd)
    raise_problems("run config", p)


def check_module(
    policy: PolicyConfig,
    rl: GRPOConfig,
    rollout: RolloutConfig,
    opd: OPDConfig | None,
    objective: str | None,
) -> None:
    """What ``GRPOModule(...)`` checks when it is built, before any model: ``check_run`` without the DP size, and a
    warning when ``rl.freeze_pi_old=false`` makes the clip a no-op (off-label, said once)."""
    warn_if_unfrozen(rl)
    check_run(policy, rl, rollout, opd, objective)


def check_ranks(
    policy: PolicyConfig, rl: GRPOConfig, rollout: RolloutConfig, dp_size: int, strategy
) -> None:
    """The rules that need the strategy, at ``setup`` before the policy loads: ``rl``'s per-rank divisibility, the
    rules across sections that read the DP size (the objective's ran when the module was built), and LoRA under
    this ``strategy`` (the Trainer's, or None outside one)."""
    rl.validate(dp_size)
    check_run(policy, rl, rollout, objective=None, dp_size=dp_size)
    lora.check_strategy(policy.lora, strategy)


def sampler_logprobs_problems(rl: GRPOConfig, rollout: RolloutConfig) -> list[str]:
    """vLLM's raw sampler logprobs are of the plain logits, while the update scores at the sampling temperature: as
    the rollout correction's pi_rollout under a warped sampler the ratio would compare unlike quantities."""
    mode = rollout.vllm.logprobs_mode if rollout.vllm is not None else "auto"
    warped = rollout.temperature != 1.0 or rollout.top_p < 1.0 or rollout.top_k > 0
    if not (
        rollout.engine == "vllm"
        and rl.needs_sampler_logprobs
        and mode == "raw_logprobs"
        and warped
    ):
        return []
    return [
        (
            "rollout.vllm.logprobs_mode='raw_logprobs': with "
            f"rl.rollout_correction.mode={rl.rollout_correction.mode!r} and "
            f"rollout.temperature={rollout.temperature}, top_p={rollout.top_p}, top_k={rollout.top_k} the loss would "
            "compare log-softmax of the unwarped logits with the trainer's; set vllm.logprobs_mode to 'auto' or "
            "'processed_logprobs'"
        )
    ]


def overlong_problems(rl: GRPOConfig, rollout: RolloutConfig) -> list[str]:
    """An overlong buffer as long as the completion would start the penalty before the first token."""
    if not (rl.overlong_buffer and rl.overlong_buffer >= rollout.max_new_tokens):
        return []
    return [
        (
            f"rl.overlong_buffer={rl.overlong_buffer}: must be below rollout.max_new_tokens={rollout.max_new_tokens} "
            "(the penalty ramps over the last overlong_buffer tokens); lower it or set 0 (off)"
        )
    ]


def async_problems(rl: GRPOConfig, rollout: RolloutConfig) -> list[str]:
    """Async rollouts train on batches sampled by older weights: without a correction that is a silent bias."""
    k = rollout.max_off_policy_steps
    if not (k and rl.rollout_correction.mode == "off"):
        return []
    return [
        (
            f"rollout.max_off_policy_steps={k}: draws batches with weights up to {k} loop step(s) old, and "
            "rl.rollout_correction.mode=off would train on them as if on-policy (a silent bias); set "
            "rl.rollout_correction.mode: tis (pi_old = the trainer's ahead pass, the behaviour gap weighed by the "
            "sampler's logprobs; docs/async.md) or bypass (pi_old = the sampler's logprobs)"
        )
    ]


def server_problems(
    policy: PolicyConfig, rollout: RolloutConfig, dp_size: int | None
) -> list[str]:
    """The ``vllm serve`` engine: restarts, and adapter syncs, where they cannot work."""
    if rollout.engine != "vllm_server":
        return []
    p = []
    server = rollout.server or ServerConfig()
    ranks = dp_size or 1
    if server.restarts and ranks > 1:
        # async is safe (the training thread restarts, the worker idle); ranks are not: they draw at their own pace
        p.append(
            f"rollout.server.restarts={server.restarts} with {ranks} trainer ranks: the ranks draw at their own "
            "pace (refill rounds, episodes), so one may meet the dead server while another already waits in the "
            "update's all-reduce, with no barrier where rank 0 could restart it; set rollout.server.restarts: 0 "
            "(the run stops with an emergency checkpoint; resume with --ckpt_path last)"
        )
    if server.inflight_updates and ranks > 1:
        p.append(
            f"rollout.server.inflight_updates=True with {ranks} trainer ranks: rank 0 pauses the servers while "
            "the other ranks' requests are in flight, and their clients cannot know which of their tokens came "
            "before the pause; set rollout.server.inflight_updates: false (each sync waits for idle) or train on "
            "one rank"
        )
    hops = []
    for url in server.urls:  # a launched server is on its lead's node: shm under auto
        try:
            hops.append(hop_transport(server.weight_transport, url))
        except ValueError as err:
            p.append(str(err))
    adapter = policy.lora is not None and policy.lora.sync == "adapter"
    if adapter and server.weight_transport == "http":
        p.append(
            "policy.lora.sync=adapter with rollout.server.weight_transport=http: the servers load each adapter "
            "from a folder on this machine, which a server on another node cannot read; set policy.lora.sync: "
            "merge (every weight, over HTTP) or weight_transport: auto (shm to this node's servers)"
        )
    elif adapter and "http" in hops:
        p.append(
            f"policy.lora.sync=adapter with rollout.server.url={server.url}: a server on another node (HTTP "
            "under weight_transport: auto) cannot read the adapter folder on this machine; set "
            "policy.lora.sync: merge (every weight, over HTTP) or use servers on this node"
        )
    return p


def routing_problems(rl: GRPOConfig, rollout: RolloutConfig) -> list[str]:
    """MoE routing from the rollout engine: no engine of this release returns it (``routing.rollout_refusal``)."""
    if rl.routing_replay != "rollout":
        return []
    return [
        (
            f"rl.routing_replay='rollout' with rollout.engine={rollout.engine!r}: {rollout_refusal(rollout.engine)}. "
            "Use rl.routing_replay='ahead' (records routing in the ahead pass)"
        )
    ]


def objective_problems(
    objective: str, rl: GRPOConfig, opd: OPDConfig | None
) -> list[str]:
    """The ``opd`` section belongs to objective=opd, and objective=opd reads ``rl`` too."""
    section = OBJECTIVES[objective].section if objective in OBJECTIVES else None
    if section == "opd":
        return opd_problems(opd or OPDConfig(), rl)
    # a sweep setting opd.* alone would silently train something else
    if opd is not None and opd != OPDConfig():
        return [
            (
                f"objective={objective!r} but the opd section is set, which configures objective='opd': set "
                "model.objective=opd or drop model.opd"
            )
        ]
    return []


def opd_problems(opd: OPDConfig, rl: GRPOConfig) -> list[str]:
    """objective=opd: a teacher, and an ``rl`` section whose GRPO term the KL can be added to."""
    p = []
    if opd.teacher is None:
        p.append(
            "opd.teacher=None: objective=opd needs a teacher (opd.teacher.path: a Hugging Face folder or "
            "tiny:<name>)"
        )
    if not opd.use_rewards and rl.beta > 0:
        p.append(
            f"rl.beta={rl.beta}: the k3 KL to the initial policy belongs to the GRPO term, which "
            "opd.use_rewards=false leaves out; set rl.beta=0 (the teacher is the anchor) or use_rewards=true"
        )
    mode = rl.rollout_correction.mode
    if not opd.use_rewards and mode != "off":
        p.append(
            f"rl.rollout_correction.mode={mode!r}: distillation alone has no ratio, so pi_old is never used; "
            "set it to 'off' or opd.use_rewards=true"
        )
    elif mode not in ("off", "bypass"):
        p.append(
            f"rl.rollout_correction.mode={mode!r}: objective=opd adds its KL to the uncorrected GRPO term; "
            "set 'off' or 'bypass', or use objective=grpo"
        )
    for knob, default in OPD_FAMILY:
        if getattr(rl, knob) != default:
            p.append(
                f"rl.{knob}={getattr(rl, knob)!r}: objective=opd adds its token-mean KL to the default GRPO "
                f"term only (dapo, token ratio, ppo_clip); set rl.{knob}={default!r} or use objective=grpo"
            )
    return p


def check_parts(
    rollout: RolloutConfig,
    env: EnvConfig | None,
    rewards: Sequence[RewardSpec],
    prompts: PromptProvider | None,
    engine_sleeps: bool = False,
) -> None:
    """The refusals that need no weight but load or ask something, run at ``setup`` before the policy loads: the
    environment and its parser (imported), the columns a TRL-style reward reads (the data is loaded by then), async
    rollouts with an engine that sleeps, and a ``rollout.server.url`` that does not answer.

    Args:
        rollout: the ``rollout`` section.
        env: ``model.env`` (None: single-turn).
        rewards: the reward functions.
        prompts: the datamodule, when it is a ``PromptProvider`` (None: a datamodule of the user's own).
        engine_sleeps: whether the Trainer's weight publisher puts the engine to sleep (a colocated hand-off).
    """
    check_async_handoff(rollout.max_off_policy_steps, engine_sleeps)
    if prompts is not None:
        check_reward_columns(rewards, prompts.columns)
    if env is not None:
        load_env(env.name)
        load_parser(env.parser)
    server = rollout.server
    if rollout.engine == "vllm_server" and server is not None:
        for url in server.urls:
            check_answers(url, server)


def check_async_handoff(max_off_policy_steps: int, engine_sleeps: bool) -> None:
    """Async rollouts sample while the trainer updates: an engine that sleeps between generations cannot."""
    if not (max_off_policy_steps and engine_sleeps):
        return
    raise ConfigError(
        f"rollout.max_off_policy_steps={max_off_policy_steps} with HandoffCallback(placement="
        "'colocated', colocated_offload=True): async rollouts sample in another process while this one "
        "updates, so there is no device to hand back and forth; set the callback's placement: "
        "disaggregated (or colocated_offload: false) under trainer.callbacks "
        "(configs/async-quickstart.yaml)"
    )
