"""GRPOModule: a manual-optimization LightningModule whose ``training_step`` is one loop step.

One ``training_step`` consumes one collected batch: rollout -> rewards -> advantages ->
``mu_iterations x n_mini`` optimizer steps of their chunks -> one roll-up of metrics. Counters:
``trainer.global_step`` counts optimizer steps (Lightning's meaning under manual optimization,
so ``trainer.max_steps`` is in optimizer steps = loop steps x mu_iterations x n_mini);
``loop_step`` counts collected batches and is the logged x-axis (``step``).

The module owns its state: ``on_save_checkpoint`` writes loop progress, accumulator, probe, data
position and per-rank RNG into every checkpoint Lightning writes (``checkpoint/state.py``), so a plain
``ModelCheckpoint`` resumes exactly. It keeps its engine current through a ``WeightPublisher``
(``publisher.py``), attaching a ``HandoffCallback`` itself when the engine holds its own weights.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Sequence

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerStatus
from torch import Tensor, nn

from lightning_grpo import lora
from lightning_grpo.accumulate import DeferredAccumulator
from lightning_grpo.advantages import group_advantages
from lightning_grpo.batch import RolloutBatch, pack_rollouts
from lightning_grpo.checkpoint import adapter as adapter_checkpoint
from lightning_grpo.checkpoint.state import STATE_KEY, LoopState, NonFiniteParametersError, nonfinite_parameter
from lightning_grpo.chunks import ChunkPlan, plan_update
from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig, check_sampler_logprobs
from lightning_grpo.data.rewards import RewardSpec, check_reward_columns, score
from lightning_grpo.determinism import enable_determinism, run_seed
from lightning_grpo.distributed import DataParallelOps, data_parallel_mesh, root_call, shard_fsdp2
from lightning_grpo.handoff import attach_handoff
from lightning_grpo.logprobs import token_logprobs
from lightning_grpo.loop import CollectedBatchLoop, LoopResult
from lightning_grpo.metrics import combine_ranks, plan_metrics, roll_up
from lightning_grpo.objectives import OBJECTIVES, Objective, PolicyView, Stats, build_objective
from lightning_grpo.objectives.opd import OPDConfig
from lightning_grpo.old_logprobs import OldLogprobCache, eval_mode, needs_ahead_pass, warn_if_unfrozen
from lightning_grpo.policy import PolicyConfig, load_policy, load_vision, with_seed
from lightning_grpo.precision import PluginStep, adamw_kernel, check_precision
from lightning_grpo.progress import count_loop_steps
from lightning_grpo.publisher import NoPublisher, WeightPublisher, find_publisher, needs_publisher
from lightning_grpo.rollout.base import Rollout, RolloutEngine, SamplingConfig
from lightning_grpo.rollout.build import build_engine
from lightning_grpo.routing import RoutingReplay, attach_routing
from lightning_grpo.schedule import build_scheduler, check_horizon, run_length
from lightning_grpo.validation import ValidationMeans, greedy_scores
from lightning_grpo.vision import VisionInputs, VisionProcessor, step_prompts, touch_vision, with_skipped_groups

log = logging.getLogger(__name__)

# The sections' defaults: instances rather than None, so `--help` and `--print_config` show every field.
# Shared between modules, hence copied by GRPOModule.__init__ and never mutated.
_POLICY, _RL, _OPTIM, _ROLLOUT, _OPD = PolicyConfig(), GRPOConfig(), OptimConfig(), RolloutConfig(), OPDConfig()


class GRPOModule(DataParallelOps, LightningModule):
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
                 seed: int | None = None, objective: str | Objective = "grpo", opd: OPDConfig = _OPD) -> None:
        super().__init__()
        self.automatic_optimization = False  # the loop steps the optimizer itself
        resolved = run_seed(seed)  # one source of truth: model.seed, else seed_everything's
        self.seed, self.seed_source = resolved.value, resolved.source
        self.policy_cfg = with_seed(copy.deepcopy(policy or PolicyConfig()), self.seed)  # the tiny build it used
        self.rl, self.optim_cfg = copy.deepcopy(rl or GRPOConfig()), copy.deepcopy(optim or OptimConfig())
        self.rollout_cfg, self.reward_specs = copy.deepcopy(rollout or RolloutConfig()), rewards
        check_sampler_logprobs(self.rl, self.rollout_cfg)  # a config error: before any model is built
        warn_if_unfrozen(self.rl)
        self.opd_cfg = copy.deepcopy(opd)
        self.objective = self.configure_objective(objective)
        self.policy: nn.Module | None = None  # built by configure_model, with the tokenizer, reference, pi_old cache
        self.tokenizer = None
        self.vision: VisionProcessor | None = None  # a vision-language policy's image side (None: text-only)
        self.ref: nn.Module | None = None
        self.lora_base: lora.BaseFingerprint | None = None  # the frozen base under policy.lora
        self.old_logprobs: OldLogprobCache | None = None
        self.engine: RolloutEngine | None = None
        self.loop: CollectedBatchLoop | None = None
        self.ahead_seconds = self.update_seconds = 0.0  # wall time of the last ahead pass / whole update
        self.last_plan: ChunkPlan | None = None  # the ChunkPlan of the last collected batch (metrics, tests)
        self._publisher: WeightPublisher = NoPublisher()  # found (or attached) when the engine is built
        self.val_means = ValidationMeans()  # epoch means of val/* (torchmetrics: synced across ranks)
        self._state = LoopState()  # what every checkpoint records (see on_save_checkpoint)
        self.schedule_horizon: int | None = self.optim_cfg.total_steps or None  # resolved from the Trainer at setup
        self.routing: RoutingReplay | None = None  # MoE routing replay / aux loss: attached in configure_model

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
        return build_engine(self.rollout_cfg, self, will_sleep=will_sleep)

    def compute_rewards(self, rollouts: Sequence[Rollout]) -> tuple[Tensor, dict[str, float]]:
        """One reward per rollout. Recorded rewards (replay) are used as they are."""
        if all(r.reward is not None for r in rollouts):
            return torch.tensor([r.reward for r in rollouts], dtype=torch.float32), {}
        if self.reward_specs == []:  # no rewards at all (distillation alone on prompts without answers)
            return torch.zeros(len(rollouts), dtype=torch.float32), {}
        # Default: the built-in task reward. A SIGTERM (Lightning's flag) abandons a reward call still running.
        stop = (lambda: self.trainer.received_sigterm) if self._trainer is not None else None
        total, parts = score(rollouts, self.reward_specs or [RewardSpec()], should_stop=stop)
        # Per function: the mean over the samples it scored (None = no opinion, NaN in ``parts``).
        metrics = {f"reward/{name}": float(v.nanmean()) for name, v in parts.items()}
        metrics["reward/none_frac"] = float(torch.stack(list(parts.values())).isnan().float().mean())
        return total, metrics

    # -- Lightning hooks ---------------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        self.rl.validate(self._world_size())  # per-rank divisibility needs the DP size
        lora.check_strategy(self.policy_cfg.lora, getattr(self._trainer, "strategy", None))
        if self._trainer is not None:  # Lightning's bars count batches (= loop steps) against optimizer steps
            count_loop_steps(self.trainer)
        if stage == "fit":  # a decaying LR schedule needs a horizon: refused here, before the model is set up
            run = run_length(self.trainer, self.rl.steps_per_loop_step)
            self.schedule_horizon = self.optim_cfg.total_steps or run
            check_horizon(self.optim_cfg, self.schedule_horizon, run)
        if self.rl.deterministic:  # before the policy and engine are built: they may start CUDA work
            enable_determinism(self.seed)

    def check_data(self) -> None:
        """Fit the datamodule's prompts to this policy (chat template, max_prompt_tokens) and check that every
        column a reward function requires exists. Raises before any step runs."""
        dm = self._datamodule()
        if dm is None or not hasattr(dm, "prepare_prompts"):
            return
        if self.vision is None and getattr(dm, "has_images", False):
            raise ValueError(
                f"data.source={_source_name(dm)} has prompts with images but policy.path="
                f"{self.policy_cfg.path!r} is a text-only model; use a vision-language policy (Qwen2-VL, Qwen2.5-VL, "
                "Qwen3-VL, or tiny.arch=qwen2_5_vl) or a text-only data source"
            )
        if getattr(dm, "has_images", False) and self.objective.name != "grpo":  # OPD scores hidden states, no pixels
            raise ValueError(f"model.objective={self.objective.name} does not score prompts with images (data.source="
                             f"{_source_name(dm)} has some); use model.objective=grpo for image prompts")
        dm.prepare_prompts(self.tokenizer, self.max_prompt_tokens(), self.rollout_cfg.long_prompts)
        check_reward_columns(self.reward_specs or [], dm.columns)

    def max_prompt_tokens(self) -> int | None:
        """The prompt-length limit: ``rollout.max_prompt_tokens``, else the context left after the completion."""
        if self.rollout_cfg.max_prompt_tokens is not None:
            return self.rollout_cfg.max_prompt_tokens
        vllm = self.rollout_cfg.vllm if self.rollout_cfg.engine == "vllm" else None
        contexts = [self._context(), vllm.max_model_len if vllm is not None else None]
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
            # Frozen pi_old across the window (the ahead pass); also holds the one-shot probe's state.
            self.old_logprobs = OldLogprobCache(self.policy, lambda c: self.logprobs(self.policy, c.to(self.device)),
                                                dp_sum=lambda t: self._dp_mean(t) * self._world_size())
            self.attach_routing()  # before FSDP2 shards the routers, and before an engine starts (refusals)
        from lightning.pytorch.strategies import ModelParallelStrategy

        if self._trainer is None or not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return  # DDP wraps the whole module itself; one process needs nothing
        mesh = data_parallel_mesh(self.trainer.strategy)
        for model in (self.policy, self.ref):
            if model is not None:
                shard_fsdp2(model, mesh)

    def configure_optimizers(self):
        o = self.optim_cfg
        params = [p for p in self.policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                **adamw_kernel(params, o.fused, self._scaler()))
        return [opt], [build_scheduler(opt, o, self.schedule_horizon)]

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

    def on_train_start(self) -> None:
        opt, sched = self.optimizers(), self.lr_schedulers()
        plugin_step = PluginStep(self.trainer, self.policy, opt)  # unscale -> 1/sum -> clip -> step via the plugin
        self.loop = self.make_loop(opt, sched, self.manual_backward, step=plugin_step, clip=plugin_step.clip)
        self._state.resume(self.trainer, self.loop, self.old_logprobs, self.trainer.datamodule)
        self._state.boundary(self.loop, self.old_logprobs, self.global_step, self.trainer.datamodule)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self._state.step_started()  # the last hook before training_step: a loaded RNG state is restored here

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Every checkpoint Lightning writes carries the state at the last batch boundary (checkpoint/state.py).

        Parameters holding NaN/inf are never written, whoever saves: a save is refused
        (``NonFiniteParametersError``). On the way out of a failure (``OnExceptionCheckpoint``) raising would
        replace that failure and skip Lightning's teardown, so the file is written without weights or optimizer
        state instead, saying why, and loading it refuses with that reason.
        """
        if (bad := nonfinite_parameter(self.trainer)) is not None:  # a collective under DP: every rank refuses
            refused = NonFiniteParametersError(bad)
            if self.trainer.state.status != TrainerStatus.INTERRUPTED:
                raise refused
            log.error("%s: the checkpoint written while handling the failure holds no weights", refused)
            for key in ("state_dict", "optimizer_states", "lr_schedulers"):
                checkpoint.pop(key, None)
            checkpoint[STATE_KEY] = {"refused": str(refused)}
            return
        self._state.write(self.trainer, checkpoint)
        if lora.is_lora(self.policy):  # the frozen base is rebuilt from policy.path: checkpoints hold the adapter
            adapter_checkpoint.drop_base(checkpoint, self.lora_base, "policy.", self.policy)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        refused = (checkpoint.get(STATE_KEY) or {}).get("refused")
        if refused:  # written without weights on the way out of a failure: nothing to resume
            raise NonFiniteParametersError.loading(refused)
        self._state.load(checkpoint)  # put back at on_train_start, once the loop exists
        if lora.is_lora(self.policy):  # before Lightning loads the state dict: the base comes from this policy
            adapter_checkpoint.restore_base(checkpoint, self.state_dict(), self.lora_base, "policy.")

    def on_before_optimizer_step(self, optimizer) -> None:
        step = self.loop.accumulator.step if self.loop is not None else None
        if isinstance(step, PluginStep):  # in a GradScaler step the plugin has unscaled: now the divisor and the clip
            step.before_optimizer_step()

    def attach_routing(self) -> None:
        """Hook the policy's MoE routers when ``rl.routing_replay`` or the model's aux loss asks (idempotent)."""
        if self.routing is None:
            self.routing = attach_routing(self.policy, self.rl, self.rollout_cfg.engine, self._dp_mean)
            self.old_logprobs.routing = self.routing

    def make_loop(self, optimizer, scheduler=None, backward=None, step=None, clip=None) -> CollectedBatchLoop:
        """The collected-batch loop over this module's policy (also usable without a Trainer)."""
        self.attach_routing()
        acc = DeferredAccumulator(self.policy.parameters(), optimizer, grad_accum=self.rl.n_micro,
                                  max_grad_norm=self.rl.max_grad_norm, backward=backward, scheduler=scheduler,
                                  grad_sync=self._grad_sync, all_finite=self._all_ranks_finite, step=step, clip=clip)
        return CollectedBatchLoop(acc, self.forward_chunk, self.routing.scope if self.routing is not None else None,
                                  max_consecutive_skips=self.rl.max_consecutive_skips)

    def training_step(self, records, batch_idx: int) -> None:
        # 1. rollout: this rank's prompts -> completions -> rewards -> group advantages
        batch, rollout_metrics = self.collect(records)
        self._publisher.on_rollout_end(self.trainer)  # the hand-off: the engine sleeps, the trainer onloads
        # 2.-3. pi_old and update: n_mini optimizer steps of n_micro chunks
        result = self.update(batch)
        self._publisher.on_update_end(self.trainer, self.loop_step)  # the engine is stale until the next draw
        # 4. report: one roll-up per collected batch
        self.report(result, rollout_metrics)
        # the batch boundary: what any checkpoint records until the next loop step ends
        self._state.boundary(self.loop, self.old_logprobs, self.global_step, self.trainer.datamodule)

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
        """Generate ``group_size`` completions per prompt, score them, normalize per group."""
        # A VLM's image placeholders are expanded here (its images decoded): an unreadable one is met at this step.
        prompts, skipped = step_prompts(records, self.tokenizer, self.vision, self._on_bad_record())
        live = [p for i, p in enumerate(prompts) if i not in skipped]
        rollouts = self.engine.generate(live, self.rl.group_size, self.sampling())
        rewards, metrics = self.compute_rewards(rollouts)
        advantages, adv_stats = group_advantages(rewards, self.rl.group_size, self.rl.scale_rewards,
                                                 batch_std=self._dp_batch_std(rewards))
        keep = torch.ones(len(rollouts), dtype=torch.bool)
        if skipped:  # skipped groups keep their rows (the batch size is the config's) with nothing to learn from
            self._datamodule().bad_records_skipped += len(skipped)
            rollouts, keep = with_skipped_groups(rollouts, prompts, skipped, self.rl.group_size,
                                                 self.tokenizer.eos_token_id)
            advantages, rewards = _scatter(advantages, keep), _scatter(rewards, keep)
        batch = pack_rollouts(rollouts, advantages, rewards, self.tokenizer.pad_token_id, self._context())
        lengths = batch.completion_mask.sum(-1).float()[keep]
        metrics.update({k: float(v) for k, v in adv_stats.items()})
        metrics["completion/len_mean"], metrics["completion/len_max"] = float(lengths.mean()), float(lengths.max())
        stopped = [r.finish_reason == "stop" for r, k in zip(rollouts, keep.tolist()) if k]
        metrics["completion/stop_frac"] = sum(stopped) / len(stopped)
        metrics["data/bad_records_skipped"] = float(getattr(self._datamodule(), "bad_records_skipped", 0))
        return batch, metrics

    def update(self, batch: RolloutBatch) -> LoopResult:
        """Consume one collected batch (this rank's share) as mu_iterations x n_mini optimizer steps."""
        start = time.perf_counter()
        plan, ahead = self.plan(batch)
        self.last_plan = plan
        # pi_old per chunk in walk order, frozen before the first step; None = no ahead pass (n_mini == 1, ...).
        ahead_pass = needs_ahead_pass(self.rl, self.objective)
        walk = ahead_pass or (self.routing is not None and self.routing.needs_walk(self.rl))
        pi_old = self.old_logprobs.compute(batch, plan, ahead) if walk else None
        self.ahead_seconds = self.old_logprobs.last_seconds if walk else 0.0
        if self.routing is not None:  # MoE: each chunk's recorded experts, replayed in training (routing.py)
            self.routing.begin(batch, plan, self.old_logprobs.last_routes if walk else None)
        result = self.loop.run(batch, plan, pi_old if ahead_pass else None)
        self.update_seconds = time.perf_counter() - start
        return result

    def plan(self, batch: RolloutBatch) -> tuple[ChunkPlan, ChunkPlan | None]:
        """The ChunkPlan of this collected batch (every epoch) and the ahead pass's own, computed once and shared by
        the ahead pass and the training walk. Token-budgeted counts are agreed over ranks in one all-reduce."""
        rl, world = self.rl, self._world_size()
        ahead_rows = None
        if needs_ahead_pass(rl, self.objective) and rl.ahead_budget:
            size = len(batch) // rl.n_mini
            first = size if self.old_logprobs.skips_first_mini(rl.mu_iterations) else 0
            ahead_rows = list(range(first, len(batch)))
        dp_max = (lambda t: self._all_reduce(t, "max")) if world > 1 else (lambda t: t)
        plan, ahead = plan_update(batch, rl.n_mini, rl.n_micro, rl.max_tokens_per_micro, ahead_rows,
                                  rl.ahead_budget, dp_max, expected_rows=rl.rank_sizes(world).batch)
        if rl.mu_iterations > 1:  # the later epochs' mini-batch order: the same on every rank, new every loop step
            plan = plan.with_epochs(rl.mu_iterations, seed=self.seed * 1_000_003 + self.loop_step)
        return plan, ahead

    def forward_chunk(self, chunk: RolloutBatch, old_logprobs: Tensor | None) -> tuple[Tensor, Tensor, Stats]:
        """Score one chunk with the objective: it asks the policy (and reference, teacher) for what it needs."""
        chunk = chunk.to(self.device)
        vision = self.materialize(chunk)  # this chunk's pixels only; freed once its backward has run
        if old_logprobs is None and self.rl.use_rollout_logprobs_for_loss:
            if chunk.rollout_logprobs is None:
                raise ValueError("rl.use_rollout_logprobs_for_loss=true but the engine returned no sampler logprobs")
            old_logprobs = chunk.rollout_logprobs[:, 1:]
        loss, denom, stats = self.objective.chunk_loss(chunk, self.policy_view(chunk, vision), old_logprobs)
        if vision is None and self.vision is not None:  # no pixels: DDP still needs the vision side in the backward
            loss = touch_vision(loss, self.policy)
        return loss, denom, stats

    def policy_view(self, chunk: RolloutBatch | None = None, vision: VisionInputs | None = None) -> PolicyView:
        """What an objective may ask of the policy (``objectives/base.py``). ``vision``: ``chunk``'s pixels,
        materialized once and shared by the policy and the reference (another chunk materializes its own)."""
        has_ref = self.ref is not None or (lora.is_lora(self.policy) and self.objective.needs_reference())
        pixels = lambda c: vision if c is chunk else None
        return PolicyView(model=self.policy, temperature=self.rollout_cfg.temperature,
                          logprobs=lambda c: self.logprobs(self.policy, c, pixels(c)),
                          reference=(lambda c: self.reference_logprobs(c, pixels(c))) if has_ref else None,
                          call=lambda fn, *args: root_call(self.policy, fn, *args))

    def reference_logprobs(self, chunk: RolloutBatch, vision: VisionInputs | None = None) -> Tensor:
        """``[B, T-1]`` logprobs of the frozen reference: the copy, or under LoRA the policy with its adapter off."""
        if self.ref is not None:
            with torch.no_grad(), eval_mode(self.ref):
                return self.logprobs(self.ref, chunk, vision)
        with torch.no_grad(), eval_mode(self.policy), lora.reference_mode(self.policy):
            return self.logprobs(self.policy, chunk, vision)

    def logprobs(self, model, chunk: RolloutBatch, vision: VisionInputs | None = None) -> Tensor:
        """``[B, T-1]`` logprobs of the completion tokens at the sampling temperature, 0 at prompt and padding. A chunk
        with images is scored with ``vision`` (materialized here when not given: the ahead pass scores chunk by chunk
        too, so only one chunk's pixels are alive)."""
        vision = vision if vision is not None else self.materialize(chunk)
        extra = None if vision is None else {k: v.to(self.device) for k, v in vision.as_kwargs().items()}
        # root_call: under FSDP2 the root's hooks gather embeddings/head around the decoder + fused head.
        return root_call(model, token_logprobs, model, chunk.input_ids, chunk.attention_mask,
                         positions=chunk.completion_mask[:, 1:], temperature=self.rollout_cfg.temperature,
                         keep_bytes=int(self.rl.logits_keep_mb * 2**20), model_inputs=extra)

    def materialize(self, chunk: RolloutBatch) -> VisionInputs | None:
        """The pixels of ``chunk``'s rows (decoded and processed now), or None for a chunk without images."""
        if chunk.images is None or self.vision is None:
            return None
        return self.vision.materialize(chunk.images, chunk.input_ids.cpu(), chunk.group_ids.tolist())

    def report(self, result: LoopResult, rollout_metrics: dict[str, float]) -> None:
        metrics = {**rollout_metrics, **roll_up(result, stats=getattr(self.objective, "stats", None)),
                   **plan_metrics(self.last_plan)}
        metrics["loop_step"] = float(self.loop_step)
        metrics["global_step"] = float(self.global_step)
        metrics["step"] = metrics["loop_step"]  # the logger's x-axis: collected batches
        metrics["grpo/ahead_seconds"] = self.ahead_seconds
        metrics["grpo/ahead_share"] = self.ahead_seconds / self.update_seconds if self.update_seconds > 0 else 0.0
        metrics["data/long_prompts_dropped"] = float(getattr(self._datamodule(), "long_prompts_dropped", 0))
        if self.routing is not None:
            metrics.update(self.routing.metrics())  # moe/route_flip_frac, moe/aux_loss
        world = self._world_size()
        if world > 1:  # one figure per metric for the whole job (reductions: docs/distributed.md)
            metrics = combine_ranks(metrics, self._all_reduce, world, self.rl.rank_sizes(world).batch)
        bar = {"reward": metrics.get("reward/mean", math.nan), "loss": metrics.get("grpo/loss", math.nan)}
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        self.log_dict(bar, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)
        self.last_metrics = metrics

    # -- helpers ------------------------------------------------------------------------------------------------------
    @property
    def loop_step(self) -> int:
        """Collected batches consumed so far (the logged ``step``; checkpoint cadence counts these)."""
        return self.loop.progress.loop_step if self.loop is not None else 0

    def sampling(self) -> SamplingConfig:
        r = self.rollout_cfg
        step = self.loop_step
        # A distinct, reproducible seed per (seed, loop step, rank); the engines derive one stream per (prompt, sample).
        seed = (self.seed * 1_000_003 + step) * max(self._world_size(), 1) + self.global_rank
        return SamplingConfig(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, logprobs=self.rl.use_rollout_logprobs_for_loss, seed=seed,
                              stop=tuple(r.stop or ()),
                              forbidden_token_ids=self.vision.special_ids if self.vision is not None else ())

    def _on_bad_record(self) -> str:
        return getattr(self._datamodule(), "on_bad_record", "error")

    def _datamodule(self):
        return getattr(self._trainer, "datamodule", None) if self._trainer is not None else None

    def _scaler(self):
        """The precision plugin's GradScaler (16-mixed), or None."""
        return getattr(self.trainer.precision_plugin, "scaler", None) if self._trainer is not None else None

    def _context(self) -> int | None:
        return getattr(self.policy.config, "max_position_embeddings", None)

    def _dp_batch_std(self, rewards: Tensor) -> Tensor | None:
        """``scale_rewards="batch"`` under DP: the unbiased std of every rank's rewards (None: the local one)."""
        if self.rl.scale_rewards != "batch" or self._world_size() == 1:
            return None
        r = rewards.detach().double()
        total, squares, n = self._all_reduce(torch.stack([r.sum(), r.square().sum(), r.new_tensor(r.numel())]), "sum")
        return ((squares - total * total / n).clamp(min=0) / (n - 1)).sqrt().float()



def _scatter(values: Tensor, keep: Tensor) -> Tensor:
    """``[len(keep)]``: ``values`` at the kept rows, 0 at the others."""
    out = values.new_zeros(keep.shape)
    out[keep] = values
    return out


def _source_name(dm) -> str:
    source = getattr(dm, "source", "?")
    return repr(source) if isinstance(source, str) else f"<{type(source).__name__}>"
