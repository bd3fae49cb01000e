"""GRPOModule: Lightning wiring whose ``training_step`` is one loop step: collect -> update -> report.

The rollout is a ``Collector`` (``collect/``, docs/collect.md), the update an ``Updater`` (``update/``,
docs/update.md), both without Lightning; what every module shares (optimizer, precision step, DP ops, checkpoint
state, the step timer, the row it logs) is ``base.UpdateModule``. Which hook builds what, and what a subclass
overrides: docs/lightning.md.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from lightning_grpo import collect
from lightning_grpo.base import UpdateModule
from lightning_grpo.collect_hooks import CollectHooks
from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.determinism import enable_determinism
from lightning_grpo.envs import EnvConfig
from lightning_grpo.metrics import update_metrics
from lightning_grpo.objectives import Objective
from lightning_grpo.objectives.opd import OPDConfig
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.publisher import NoPublisher, WeightPublisher
from lightning_grpo.run_check import check_module, check_parts, check_ranks
from lightning_grpo.timing import UPDATE, WAIT_BATCH
from lightning_grpo.trainer_side import TrainerSide
from lightning_grpo.update_hooks import UpdateHooks
from lightning_grpo.validation import greedy_scores

if TYPE_CHECKING:  # annotations only
    from lightning_grpo.batch import RolloutBatch
    from lightning_grpo.certificate import Certifier
    from lightning_grpo.envs import EpisodeRunner
    from lightning_grpo.rollout.base import RolloutEngine
    from lightning_grpo.routing import RoutingReplay
    from lightning_grpo.scoring import ChunkScorer
    from lightning_grpo.update import LoopResult
    from lightning_grpo.vision import VisionProcessor

# The sections' defaults: instances rather than None, so `--help` and `--print_config` show every field.
# Shared between modules, hence copied by GRPOModule.__init__ and never mutated.
_POLICY = PolicyConfig()
_RL = GRPOConfig()
_OPTIM = OptimConfig()
_ROLLOUT = RolloutConfig()
_OPD = OPDConfig()


class GRPOModule(CollectHooks, UpdateHooks, UpdateModule):
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
    """

    def __init__(
        self,
        policy: PolicyConfig = _POLICY,
        rl: GRPOConfig = _RL,
        optim: OptimConfig = _OPTIM,
        rollout: RolloutConfig = _ROLLOUT,
        rewards: list[RewardSpec] | None = None,
        seed: int | None = None,
        objective: str | Objective = "grpo",
        opd: OPDConfig = _OPD,
        env: EnvConfig | None = None,
    ) -> None:
        super().__init__(policy, optim, seed)
        self.rl = copy.deepcopy(rl or GRPOConfig())
        self.rollout_cfg = copy.deepcopy(rollout or RolloutConfig())
        self.reward_specs = rewards
        self.opd_cfg = copy.deepcopy(opd)
        self.env_cfg = copy.deepcopy(env)
        # an instance brings its own config
        named = objective if isinstance(objective, str) else None
        # before any model is built
        check_module(self.policy_cfg, self.rl, self.rollout_cfg, self.opd_cfg, named)
        self.objective = self.configure_objective(objective)
        # Built in configure_model: the image side (None: text-only), MoE routing replay, the per-chunk scorer;
        # built with the engine in on_fit_start: the collector.
        self.vision: VisionProcessor | None = None
        self.routing: RoutingReplay | None = None
        self.scorer: ChunkScorer | None = None
        self.engine: RolloutEngine | None = None
        # model.env's runner: check_data builds it first
        self.episodes: EpisodeRunner | None = None
        # rebuilt with the fit's stop poll
        self.reward_scorer = collect.RewardScorer(rewards)
        self.collector: collect.Collector | None = None
        # rollout.certificate: built with the engine
        self.certifier: Certifier | None = None
        # found (or attached) with the engine
        self._publisher: WeightPublisher = NoPublisher()
        # a loaded checkpoint's prompts in flight
        self._in_flight: dict[int, list[int]] = {}

    # -- Lightning hooks ---------------------------------------------------------------------------------------------
    @property
    def prompts_per_step(self) -> int:
        """Prompts per loop step (``data/seam.py``: what ``PromptDataModule`` draws when not told)."""
        return self.rl.prompts_per_batch

    @property
    def steps_per_loop_step(self) -> int:
        """Optimizer steps per collected batch: ``mu_iterations x n_mini`` (``trainer.max_steps`` counts these)."""
        return self.rl.steps_per_loop_step

    def check_strategy(self) -> None:
        strategy = TrainerSide(self._trainer).strategy
        check_ranks(
            self.policy_cfg, self.rl, self.rollout_cfg, self.dp_size(), strategy
        )

    def setup(self, stage: str) -> None:
        super().setup(stage)  # check_strategy, loop-step bars, the schedule's horizon
        side = TrainerSide(self._trainer)
        # what loads or answers without a weight: env, reward columns, hand-off, server URL (before a server launches)
        rewards = self.reward_specs or []
        check_parts(
            self.rollout_cfg,
            self.env_cfg,
            rewards,
            side.prompts,
            engine_sleeps=side.engine_sleeps,
        )
        # before the policy and engine are built: they may start CUDA work
        if self.rl.deterministic:
            enable_determinism(self.seed)

    def configure_model(self) -> None:
        """Build policy, tokenizer and (beta > 0) the frozen reference; FSDP2-shard them under ModelParallelStrategy.

        Idempotent: Lightning may call it again for a later ``validate``; outside a Trainer call it yourself.
        """
        if self.policy is None:
            self.build_parts()
        self.shard(self.policy, self.ref)

    def on_fit_start(self) -> None:
        super().on_fit_start()  # the precision check: before an engine is built
        # Outside configure_model: its default device/dtype contexts must not leak into an engine (vLLM). Before
        # Lightning restores optimizer state onto the device, so the hand-off can put the engine to sleep first.
        # before the engine: a data problem is reported in seconds, not after vLLM starts
        self.check_data()
        self.start_rollout()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # the boundary state (LoRA: the adapter alone), or no weights
        super().on_save_checkpoint(checkpoint)
        if self.collector is not None:  # the prompts in flight (drawn again on resume)
            self.collector.record(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # put back at on_train_start; LoRA: the base goes back in
        super().on_load_checkpoint(checkpoint)
        # checked when drawn again
        self._in_flight = collect.in_flight_of(checkpoint, self.global_rank)
        if self.collector is not None:  # a strategy that restores after on_fit_start
            self.collector.expect_reissue(self._in_flight)

    def training_step(self, records, batch_idx: int) -> None:
        # 1. rollout: this rank's prompts -> completions -> rewards -> group advantages
        with self.timer.phase(WAIT_BATCH):
            batch, rollout_metrics = self.collect(records)
        # the hand-off: the engine sleeps, the trainer onloads
        self._publisher.on_rollout_end(self.trainer)
        # 2.-3. pi_old and update: n_mini optimizer steps of n_micro chunks
        with self.timer.phase(UPDATE):
            result = self.update(batch)
        # the engine is stale until the next draw
        self._publisher.on_update_end(self.trainer, self.loop_step)
        # 4. report: one roll-up per collected batch
        self.report(result, rollout_metrics)
        self.end_loop_step()

    def validation_step(self, records, batch_idx: int) -> None:
        """Held-out prompts, greedy, through the same engine: ``val/reward`` (``lightning_grpo/validation.py``)."""
        # trainer.validate() without a fit: nothing sleeps, nothing publishes
        if self.engine is None:
            self.check_data()
            self.engine = self.build_engine(will_sleep=False)
            self.collector = self.configure_collector()
        data = TrainerSide(self._trainer).validation_draws
        k = data.val_samples_per_prompt
        metrics = greedy_scores(
            self.collector, records, self.loop_step, k, data.val_pass_reward
        )
        metrics["step"] = float(self.loop_step)  # x-axis: the loop step
        self.log_validation(metrics, weight=len(records))

    # -- the phases -----------------------------------------------------------------------------------------------
    def collect(self, records) -> tuple[RolloutBatch, dict[str, float]]:
        """This rank's collected batch and rollout metrics (``collect/``: docs/collect.md), the consistency
        certificate's first when one is due."""
        return self.collector.collect(records, self.loop_step)

    def update(self, batch: RolloutBatch) -> LoopResult:
        """Consume one collected batch (this rank's share) as mu_iterations x n_mini optimizer steps."""
        return self.updater.update(batch)

    def report(self, result: LoopResult, rollout_metrics: dict[str, float]) -> None:
        """One row per loop step: rollout, update and MoE routing, with the counters and timing
        (``UpdateModule.publish``)."""
        stats = getattr(self.objective, "stats", None)
        metrics = rollout_metrics | update_metrics(
            result, self.updater.last_plan, stats
        )
        if self.routing is not None:
            metrics |= self.routing.metrics()  # moe/route_flip_frac, moe/aux_loss
        rows = self.rl.rank_sizes(self.dp_size()).batch
        self.publish(metrics, rows, bar={"reward": "reward/mean", "loss": "grpo/loss"})
