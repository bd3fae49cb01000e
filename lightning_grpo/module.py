"""GRPOModule: a manual-optimization LightningModule whose ``training_step`` is one loop step.

One ``training_step`` consumes one collected batch: rollout -> rewards -> advantages ->
``mu_iterations x n_mini`` optimizer steps of their chunks -> one roll-up of metrics. Counters:
``trainer.global_step`` counts optimizer steps (Lightning's meaning under manual optimization,
so ``trainer.max_steps`` is in optimizer steps = loop steps x mu_iterations x n_mini);
``loop_step`` counts collected batches and is the logged x-axis (``step``).

This file is Lightning wiring, read top-down: build the parts (``configure_model``), then per loop step collect ->
update -> report. The update itself is an ``Updater`` (``update/``, no Lightning; docs/update.md) and what every
module shares (optimizer, precision step, DP ops, checkpoint state) is ``base.UpdateModule``.

The module owns its state: ``on_save_checkpoint`` writes loop progress, accumulator, probe, data
position and per-rank RNG into every checkpoint Lightning writes (``checkpoint/state.py``), so a plain
``ModelCheckpoint`` resumes exactly. It keeps its engine current through a ``WeightPublisher``
(``publisher.py``), attaching a ``HandoffCallback`` itself when the engine holds its own weights.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor

from lightning_grpo import async_rollouts, lora
from lightning_grpo.advantages import dp_batch_std, group_advantages
from lightning_grpo.base import UpdateModule, quiet_upstream_warnings
from lightning_grpo.batch import RolloutBatch, pack_rollouts
from lightning_grpo.checkpoint import adapter as adapter_checkpoint
from lightning_grpo.checkpoint.signals import stop_poll
from lightning_grpo.completions import RewardParts, StepRows
from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig, check_overlong, check_sampler_logprobs
from lightning_grpo.correction import derived_metrics
from lightning_grpo.data.fitting import fit_prompts
from lightning_grpo.data.rewards import RewardSpec, score
from lightning_grpo.data.seam import PromptProvider
from lightning_grpo.determinism import enable_determinism
from lightning_grpo.distributed import data_parallel_mesh, shard_fsdp2
from lightning_grpo.dynamic_sampling import Groups, completion_metrics, counted_only, fill, overlong_of, scatter
from lightning_grpo.envs.config import EnvConfig
from lightning_grpo.envs.draw import draw_rollouts, episode_runner
from lightning_grpo.handoff import attach_handoff
from lightning_grpo.logprobs import fuses_head
from lightning_grpo.metrics import combine_ranks, plan_metrics, roll_up
from lightning_grpo.objectives import OBJECTIVES, Objective, Stats, build_objective
from lightning_grpo.objectives.opd import OPDConfig
from lightning_grpo.packing import Packing
from lightning_grpo.policy import PolicyConfig, load_policy, load_vision, with_seed
from lightning_grpo.precision import check_precision
from lightning_grpo.progress import count_loop_steps
from lightning_grpo.publisher import NoPublisher, WeightPublisher, find_publisher, needs_publisher
from lightning_grpo.rollout.base import Rollout, RolloutEngine, SamplingConfig
from lightning_grpo.rollout.build import build_engine
from lightning_grpo.routing import RoutingReplay, attach_routing
from lightning_grpo.scoring import ChunkScorer
from lightning_grpo.update import AheadPass, DataParallel, LoopResult, Recorder, Split, Updater, batch_needs
from lightning_grpo.update.ahead import warn_if_unfrozen
from lightning_grpo.validation import greedy_scores
from lightning_grpo.vision import VisionProcessor, step_prompts, touch_vision, with_skipped_groups

# The sections' defaults: instances rather than None, so `--help` and `--print_config` show every field.
# Shared between modules, hence copied by GRPOModule.__init__ and never mutated.
_POLICY, _RL, _OPTIM, _ROLLOUT, _OPD = PolicyConfig(), GRPOConfig(), OptimConfig(), RolloutConfig(), OPDConfig()


class GRPOModule(UpdateModule):
    """GRPO on a causal-LM policy with exact micro-batching and per-batch mini-batching.

    Args:
        policy: which model to train (a Hugging Face folder, or ``tiny:<name>``).
        rl: batch sizes, clipping, KL, gradient clipping (see ``GRPOConfig``).
        optim: AdamW and its schedule, stepped once per optimizer step.
        rollout: the engine and how it samples.
        rewards: reward functions and weights (None = the built-in task's reward; [] = none, all rewards 0).
        seed: base seed of the module's random streams: rollout sampling (per rank and loop step streams derive
            from it) and a ``tiny:`` policy's init and warm start. None = the seed ``seed_everything`` applied
            (the CLI's ``--seed_everything``), else 0; set it to override that one source.
        objective: the loss, by name: ``grpo`` (clipped surrogate) or ``opd`` (on-policy distillation to a
            teacher, section ``opd``); see docs/objectives.md. From Python an ``Objective`` instance works too.
        opd: the teacher and distillation knobs, used when ``objective`` is ``opd``.
        env: a multi-turn environment with tools (None = single-turn completions); docs/environments.md.

    Example::

        module = GRPOModule(rl=GRPOConfig(batch_per_replica=16, group_size=4, micro_batch_per_replica=4))
        Trainer(max_steps=10, callbacks=[HandoffCallback()]).fit(module, datamodule=PromptDataModule())

        module = GRPOModule()     # outside a Trainer: build the policy yourself
        module.configure_model()  # module.policy, module.tokenizer now exist

    The policy is built in ``configure_model`` (Lightning calls it on each rank inside the strategy's
    init context, so it loads on its device and FSDP2 shards it before the optimizer exists), the
    engine in ``on_fit_start``. Subclasses override ``configure_policy`` (model construction),
    ``compute_rewards`` or ``build_engine`` to plug in their own parts.
    """

    def __init__(self, policy: PolicyConfig = _POLICY, rl: GRPOConfig = _RL, optim: OptimConfig = _OPTIM,
                 rollout: RolloutConfig = _ROLLOUT, rewards: list[RewardSpec] | None = None,
                 seed: int | None = None, objective: str | Objective = "grpo", opd: OPDConfig = _OPD,
                 env: EnvConfig | None = None) -> None:
        super().__init__(policy, optim, seed)
        self.rl = copy.deepcopy(rl or GRPOConfig())
        self.rollout_cfg, self.reward_specs = copy.deepcopy(rollout or RolloutConfig()), rewards
        check_sampler_logprobs(self.rl, self.rollout_cfg)  # config errors: before any model is built
        check_overlong(self.rl, self.rollout_cfg)
        warn_if_unfrozen(self.rl)
        self.opd_cfg, self.env_cfg = copy.deepcopy(opd), copy.deepcopy(env)
        self.objective = self.configure_objective(objective)
        self.vision: VisionProcessor | None = None  # a vision-language policy's image side (None: text-only)
        self.lora_base: lora.BaseFingerprint | None = None  # the frozen base under policy.lora
        self.engine: RolloutEngine | None = None
        self.routing: RoutingReplay | None = None  # MoE routing replay / aux loss: attached in configure_model
        self.scorer: ChunkScorer | None = None  # per-chunk logprobs of policy and reference: built in configure_model
        self._publisher: WeightPublisher = NoPublisher()  # found (or attached) when the engine is built
        self.reward_parts, self.last_rows = RewardParts(), None  # what CompletionLog writes (completions.py)

    # -- parts a subclass may replace ------------------------------------------------------------------------------
    def configure_objective(self, objective: str | Objective) -> Objective:
        """The loss: a registered name (``objectives.OBJECTIVES``) built for this module, or an instance as is."""
        if not isinstance(objective, str):
            return objective
        section = OBJECTIVES[objective].section if objective in OBJECTIVES else None
        if section != "opd" and self.opd_cfg is not None and self.opd_cfg != OPDConfig():
            # a sweep that sets opd.* but not the objective would otherwise silently train something else
            raise ValueError(f"objective={objective!r} but the opd section is set, which configures objective='opd': "
                             "set model.objective=opd or drop model.opd")
        if section == "opd" and self.opd_cfg is None:
            self.opd_cfg = OPDConfig()  # refused by the objective: a teacher is required
        if section == "opd" and self.opd_cfg.teacher is not None:  # a tiny: teacher is seeded like the policy
            self.opd_cfg.teacher = with_seed(self.opd_cfg.teacher, self.seed)
        return build_objective(objective, self)

    def configure_policy(self):
        """(model, tokenizer). Default: ``load_policy(self.policy_cfg)``."""
        return load_policy(self.policy_cfg)

    def configure_vision(self) -> VisionProcessor | None:
        """The policy's image side (None for a text-only policy); freezes the vision tower unless
        ``policy.train_vision_tower``. Default: ``load_vision`` on the policy folder."""
        return load_vision(self.policy_cfg, self.tokenizer, self.policy)

    def build_engine(self, will_sleep: bool = True) -> RolloutEngine:
        """The rollout engine (``rollout.engine``). ``will_sleep``: whether the hand-off puts it to sleep."""
        return async_rollouts.wrap(self, build_engine(self.rollout_cfg, self, will_sleep=will_sleep))

    def compute_rewards(self, rollouts: Sequence[Rollout]) -> tuple[Tensor, dict[str, float]]:
        """One reward per rollout. Recorded rewards (replay) are used as they are."""
        if all(r.reward is not None for r in rollouts):
            return torch.tensor([r.reward for r in rollouts], dtype=torch.float32), {}
        if self.reward_specs == []:  # no rewards at all (distillation alone on prompts without answers)
            return torch.zeros(len(rollouts), dtype=torch.float32), {}
        # Default: the built-in task reward. A SIGTERM / SIGUSR1 abandons a reward call still running.
        stop = stop_poll(self.trainer, "a reward function") if self._trainer is not None else None
        total, parts = score(rollouts, self.reward_specs or [RewardSpec()], should_stop=stop)
        self.reward_parts.add(rollouts, parts)
        # Per function: the mean over the samples it scored (None = no opinion, NaN in ``parts``).
        metrics = {f"reward/{name}": float(v.nanmean()) for name, v in parts.items()}
        metrics["reward/none_frac"] = float(torch.stack(list(parts.values())).isnan().float().mean())
        return total, metrics

    # -- Lightning hooks ---------------------------------------------------------------------------------------------
    @property
    def prompts_per_step(self) -> int:
        """Prompts per loop step (``data/seam.py``: what ``PromptDataModule`` draws when not told)."""
        return self.rl.prompts_per_batch

    def setup(self, stage: str) -> None:
        self.rl.validate(self.dp_size())  # per-rank divisibility needs the DP size
        quiet_upstream_warnings()
        lora.check_strategy(self.policy_cfg.lora, getattr(self._trainer, "strategy", None))
        if self._trainer is not None:  # Lightning's bars count batches (= loop steps) against optimizer steps
            count_loop_steps(self.trainer)
        if stage == "fit":
            self.resolve_horizon(self.rl.steps_per_loop_step)
        if self.rl.deterministic:  # before the policy and engine are built: they may start CUDA work
            enable_determinism(self.seed)

    def check_data(self) -> None:
        """Fit the datamodule's prompts to this policy (chat template, max_prompt_tokens) and check that every
        column a reward function requires exists. Raises before any step runs (``data/fitting.py``)."""
        fit_prompts(self, self._datamodule())
        episode_runner(self)  # loads model.env: an environment that does not import is refused here

    def max_prompt_tokens(self) -> int | None:
        """The prompt-length limit: ``rollout.max_prompt_tokens``, else the context left after the completion."""
        if self.rollout_cfg.max_prompt_tokens is not None:
            return self.rollout_cfg.max_prompt_tokens
        engine = {"vllm": self.rollout_cfg.vllm, "vllm_server": self.rollout_cfg.server}.get(self.rollout_cfg.engine)
        contexts = [self._context(), engine.max_model_len if engine is not None else None]
        context = min((c for c in contexts if c), default=None)
        return None if context is None else max(context - self.rollout_cfg.max_new_tokens, 1)

    def configure_model(self) -> None:
        """Build policy, tokenizer and (beta > 0) the frozen reference; FSDP2-shard them under ModelParallelStrategy.

        Idempotent: Lightning may call it again for a later ``validate``; outside a Trainer call it yourself.
        """
        if self.policy is None:
            policy, self.tokenizer = self.configure_policy()
            if self.policy_cfg.lora is not None:  # peft freezes the base: only the adapter trains
                policy = lora.apply_lora(policy, self.policy_cfg.lora, seed=self.seed)
                self.lora_base = lora.fingerprint(policy)  # checkpoints hold the adapter, and this to check the base
            self.policy = policy.train()  # from_pretrained returns eval(); Lightning trains (and checks) in train mode
            self.vision = self.configure_vision()  # before the optimizer and the reference: it may freeze a tower
            # k3 KL needs the initial policy, frozen; with beta == 0 none is built (no memory spent), and under LoRA
            # it is the base with the adapter disabled (no copy). It stays in train mode like every module Lightning
            # holds, and is scored under eval_mode (no dropout).
            copy_ref = self.objective.needs_reference() and self.policy_cfg.lora is None
            self.ref = copy.deepcopy(self.policy).requires_grad_(False) if copy_ref else None
            self.objective.setup(self.policy, self.tokenizer)  # OPD: loads the teacher, refuses another vocabulary
            # MoE routing: before FSDP2 shards the routers, and before an engine starts (refusals)
            self.routing = attach_routing(self.policy, self.rl, self.rollout_cfg.engine, self.dp_mean)
            has_ref = self.ref is not None or (lora.is_lora(self.policy) and self.objective.needs_reference())
            packing = Packing.resolve(self.rl.packed, self.policy, self.vision is not None, self.routing is not None,
                                      fuses_head(self.policy))  # refuses rl.packed=true where inexact
            self.scorer = ChunkScorer(self.policy, self.ref, self.vision, has_ref, lambda: self.rollout_cfg.temperature,
                                      lambda: int(self.rl.logits_keep_mb * 2**20), lambda: self.device, packing)
            self.updater = self.configure_updater()
        if self._trainer is None or not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return  # DDP wraps the whole module itself; one process needs nothing
        mesh = data_parallel_mesh(self.trainer.strategy)
        for model in (self.policy, self.ref):
            if model is not None:
                shard_fsdp2(model, mesh)

    def configure_recorders(self) -> list[Recorder]:
        """More per-token records for the ahead pass to take (``update/records.py``; none by default)."""
        return []

    def configure_updater(self) -> Updater:
        """The update of one collected batch: split by ``rl``, the objective on each chunk, the ahead pass (frozen
        pi_old, the one-shot probe, MoE routes) when ``plan.batch_needs`` asks for it."""
        extra = self.configure_recorders()
        hooks = [self.routing] if self.routing is not None else []  # per-chunk hooks (update/records.py ChunkHook)
        ahead = AheadPass(self.policy, lambda c: self.scorer.logprobs(self.policy, c.to(self.device)),
                          dp_sum=lambda t: self.dp_mean(t) * self.dp_size(), hooks=hooks, recorders=extra)
        dp = DataParallel(max=(lambda t: self.dp_all_reduce(t, "max")) if self.dp_size() > 1 else (lambda t: t),
                          grad_sync=self.dp_grad_sync, all_finite=self.dp_all_finite)
        split = lambda: Split.of(self.rl, self.dp_size(), self.scorer.packed)  # packed: budgets count real tokens
        return Updater(self.policy, self.forward_chunk, split=split,
                       needs=lambda: batch_needs(self.rl, self.objective, hooks, bool(extra)), ahead=ahead,
                       hooks=hooks, seed=self.seed, dp=dp, max_grad_norm=self.rl.max_grad_norm,
                       max_consecutive_skips=self.rl.max_consecutive_skips)

    def on_fit_start(self) -> None:
        # The weights are final here (precision plugin conversion, FSDP2 sharding): refuse or warn once per fit,
        # before an engine is built.
        check_precision(str(self.trainer.precision), self.policy, self.device.type == "cpu", self._scaler())
        # Outside configure_model: its default device/dtype contexts must not leak into an engine (vLLM). Before
        # Lightning restores optimizer state onto the device, so the hand-off can put the engine to sleep first.
        self.check_data()  # before the engine: a data problem is reported in seconds, not after vLLM starts
        publisher = find_publisher(self.trainer.callbacks)
        if self.engine is None:
            self.engine = self.build_engine(will_sleep=publisher is not None and publisher.sleeps_engine)
        if publisher is None:
            publisher = (attach_handoff(self.trainer, self.engine) if needs_publisher(self.engine, self.policy)
                         else NoPublisher())
        self._publisher = publisher
        publisher.on_engine_ready(self.trainer, self.engine, self.policy, self.rollout_cfg.sync_bucket_mb)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)  # the boundary state; refused (no weights) when any is non-finite
        async_rollouts.record(self, checkpoint)  # the prompts in flight (drawn again on resume)
        if "state_dict" in checkpoint and lora.is_lora(self.policy):  # the base is rebuilt from policy.path
            adapter_checkpoint.drop_base(checkpoint, self.lora_base, "policy.", self.policy)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)  # put back at on_train_start, once the updater has its loop
        async_rollouts.restore(self, checkpoint)
        if lora.is_lora(self.policy):  # before Lightning loads the state dict: the base comes from this policy
            adapter_checkpoint.restore_base(checkpoint, self.state_dict(), self.lora_base, "policy.")

    def training_step(self, records, batch_idx: int) -> None:
        # 1. rollout: this rank's prompts -> completions -> rewards -> group advantages
        batch, rollout_metrics = self.collect(records)
        self._publisher.on_rollout_end(self.trainer)  # the hand-off: the engine sleeps, the trainer onloads
        # 2.-3. pi_old and update: n_mini optimizer steps of n_micro chunks
        result = self.update(batch)
        self._publisher.on_update_end(self.trainer, self.loop_step)  # the engine is stale until the next draw
        # 4. report: one roll-up per collected batch
        self.report(result, rollout_metrics)
        self.end_loop_step()

    def validation_step(self, records, batch_idx: int) -> None:
        """Held-out prompts, greedy, through the same engine: ``val/reward`` (see ``lightning_grpo/validation.py``)."""
        if self.engine is None:  # trainer.validate() without a fit: nothing sleeps, nothing publishes
            self.check_data()
            self.engine = self.build_engine(will_sleep=False)
        metrics = greedy_scores(self, records)
        metrics["step"] = float(self.loop_step)  # x-axis: the loop step
        self.val_means.log(self, metrics, weight=len(records))

    # -- the phases ---------------------------------------------------------------------------------------------------
    def collect(self, records) -> tuple[RolloutBatch, dict[str, float]]:
        """Generate ``group_size`` completions per prompt, score them, normalize per group (``rl.dynamic_sampling``:
        only groups whose rewards differ, refilled from further prompts; ``dynamic_sampling.py``)."""
        self.reward_parts = RewardParts()  # this step's, kept by last_rows
        groups, metrics = self.draw(records)
        if self.rl.dynamic_sampling:
            groups, refill = fill(groups, self.rl.group_size, len(records), self.rl.max_refill_rounds, self._refill,
                                  self.dp_total)
            metrics.update(refill.metrics())
        trained, g = groups.trained, self.rl.group_size
        across = self.rl.scale_rewards == "batch" and self.dp_size() > 1  # the std of every rank's trained rewards
        batch_std = dp_batch_std(groups.rewards[trained], self.dp_all_reduce) if across else None
        rows = trained if bool(trained.any()) else groups.live  # nothing to train: the statistics of what was drawn
        advantages, adv_stats = group_advantages(groups.rewards[rows], g, self.rl.scale_rewards, batch_std=batch_std)
        advantages = scatter(advantages, rows).masked_fill(~trained, 0.0)
        batch = pack_rollouts(groups.rollouts, advantages, groups.rewards, self.tokenizer.pad_token_id, self._context())
        metrics.update({k: float(v) for k, v in adv_stats.items()})
        metrics.update(completion_metrics(groups, batch, self.rl, self.rollout_cfg.max_new_tokens))
        metrics["data/bad_records_skipped"] = self._data_counter("bad_records_skipped")
        self.last_rows = StepRows(self.loop_step + 1, groups.rollouts, groups.rewards, advantages, self.reward_parts)
        return counted_only(batch, groups, self.rl.mask_truncated_completions), metrics

    def draw(self, records) -> tuple[Groups, dict[str, float]]:
        """``group_size`` completions per record, scored and shaped (overlong penalty); a skipped bad record's
        group keeps its rows (the batch size is the config's) with nothing to learn from."""
        # A VLM's image placeholders are expanded here (its images decoded): an unreadable one is met at this step.
        prompts, skipped = step_prompts(records, self.tokenizer, self.vision, self._on_bad_record())
        live = [p for i, p in enumerate(prompts) if i not in skipped]
        rollouts, episode_metrics = draw_rollouts(self, live)  # completions, or multi-turn episodes (model.env)
        rewards, metrics = self.compute_rewards(rollouts)
        metrics.update(episode_metrics)
        rewards = rewards + overlong_of(rollouts, self.rl, self.rollout_cfg.max_new_tokens)
        keep = torch.ones(len(rollouts), dtype=torch.bool)
        if skipped:
            self._datamodule().bad_records_skipped += len(skipped)  # a PromptProvider counter
            rollouts, keep = with_skipped_groups(rollouts, prompts, skipped, self.rl.group_size,
                                                 self.tokenizer.eos_token_id)
            rewards = scatter(rewards, keep)
        return Groups(rollouts, rewards, keep, keep), metrics

    def update(self, batch: RolloutBatch) -> LoopResult:
        """Consume one collected batch (this rank's share) as mu_iterations x n_mini optimizer steps."""
        return self.updater.update(batch)

    def forward_chunk(self, chunk: RolloutBatch, old_logprobs: Tensor | None) -> tuple[Tensor, Tensor, Stats]:
        """Score one chunk with the objective: it asks the policy (and reference, teacher) for what it needs."""
        chunk = chunk.to(self.device)
        vision = self.scorer.materialize(chunk)  # this chunk's pixels only; freed once its backward has run
        if old_logprobs is None and self.rl.pi_old_is_sampler:
            if chunk.rollout_logprobs is None:
                raise ValueError("rl.rollout_correction.mode=bypass but the engine returned no sampler logprobs")
            old_logprobs = chunk.rollout_logprobs[:, 1:]
        loss, denom, stats = self.objective.chunk_loss(chunk, self.scorer.policy_view(chunk, vision), old_logprobs)
        if vision is None and self.vision is not None:  # no pixels: DDP still needs the vision side in the backward
            loss = touch_vision(loss, self.policy)
        return loss, denom, stats

    def report(self, result: LoopResult, rollout_metrics: dict[str, float]) -> None:
        metrics = {**rollout_metrics, **roll_up(result, stats=getattr(self.objective, "stats", None)),
                   **plan_metrics(self.updater.last_plan)}
        metrics["loop_step"] = float(self.loop_step)
        metrics["global_step"] = float(self.global_step)
        metrics["step"] = metrics["loop_step"]  # the logger's x-axis: collected batches
        ahead, whole = self.updater.ahead_seconds, self.updater.update_seconds
        metrics["grpo/ahead_seconds"] = ahead
        metrics["grpo/ahead_share"] = ahead / whole if whole > 0 else 0.0
        metrics["data/long_prompts_dropped"] = self._data_counter("long_prompts_dropped")
        if self.routing is not None:
            metrics.update(self.routing.metrics())  # moe/route_flip_frac, moe/aux_loss
        world = self.dp_size()
        if world > 1:  # one figure per metric for the whole job (reductions: docs/distributed.md)
            metrics = combine_ranks(metrics, self.dp_all_reduce, world, self.rl.rank_sizes(world).batch)
        metrics |= derived_metrics(metrics)  # ratios of the job-wide means (correction/ess, *_ppl)
        self.publish(metrics, {"reward": metrics.get("reward/mean", math.nan), "loss": metrics.get("grpo/loss", math.nan)})

    # -- helpers ------------------------------------------------------------------------------------------------------
    def sampling(self, ahead: int = 0) -> SamplingConfig:
        r, step = self.rollout_cfg, self.loop_step + ahead  # ahead: a later loop step's (async rollouts)
        # A distinct, reproducible seed per (seed, loop step, rank); the engines derive one stream per (prompt, sample).
        seed = (self.seed * 1_000_003 + step) * max(self.dp_size(), 1) + self.global_rank
        return SamplingConfig(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, logprobs=self.rl.needs_sampler_logprobs, seed=seed,
                              stop=tuple(r.stop or ()),
                              forbidden_token_ids=self.vision.special_ids if self.vision is not None else ())

    def _refill(self, generate: bool) -> Groups | None:
        """One refill round: every rank advances the refill cursor; a rank already full generates nothing."""
        records = self._datamodule().refill_records()
        return self.draw(records)[0] if generate else None

    def _on_bad_record(self) -> str:
        dm = self._datamodule()
        return dm.on_bad_record if isinstance(dm, PromptProvider) else "error"

    def _data_counter(self, name: str) -> float:
        dm = self._datamodule()
        return float(getattr(dm, name)) if isinstance(dm, PromptProvider) else 0.0

    def _datamodule(self):
        return getattr(self._trainer, "datamodule", None) if self._trainer is not None else None

    def _context(self) -> int | None:
        return getattr(self.policy.config, "max_position_embeddings", None)
