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
from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
from lightning_grpo.data.fitting import PromptFit, fit_prompts
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.determinism import enable_determinism
from lightning_grpo.engines import EngineParts, build_engine
from lightning_grpo.envs import EnvConfig, EpisodeRunner
from lightning_grpo.metrics import update_metrics
from lightning_grpo.model_parts import build_updater, scoring_parts, trainable
from lightning_grpo.objectives import Objective, ObjectiveParts, Stats, build_objective
from lightning_grpo.objectives.opd import OPDConfig
from lightning_grpo.policy import PolicyConfig, load_vision
from lightning_grpo.publisher import NoPublisher, WeightPublisher
from lightning_grpo.run_check import check_module, check_parts, check_ranks
from lightning_grpo.timing import UPDATE, WAIT_BATCH
from lightning_grpo.trainer_side import TrainerSide
from lightning_grpo.update import LoopResult, Recorder, Split, Updater, pi_old_source
from lightning_grpo.validation import greedy_scores

if TYPE_CHECKING:  # annotations only
    from collections.abc import Sequence

    from torch import Tensor

    from lightning_grpo.batch import RolloutBatch
    from lightning_grpo.certificate import Certifier
    from lightning_grpo.rollout.base import Rollout, RolloutEngine, SamplingConfig
    from lightning_grpo.routing import RoutingReplay
    from lightning_grpo.scoring import ChunkScorer
    from lightning_grpo.vision import VisionProcessor

# The sections' defaults: instances rather than None, so `--help` and `--print_config` show every field.
# Shared between modules, hence copied by GRPOModule.__init__ and never mutated.
_POLICY = PolicyConfig()
_RL = GRPOConfig()
_OPTIM = OptimConfig()
_ROLLOUT = RolloutConfig()
_OPD = OPDConfig()


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

    # -- parts a subclass may replace ------------------------------------------------------------------------------
    def configure_objective(self, objective: str | Objective) -> Objective:
        """The loss: a registered name (``objectives.OBJECTIVES``) built for this module, or an instance as is."""
        if not isinstance(objective, str):
            return objective
        max_new_tokens = self.rollout_cfg.max_new_tokens
        parts = ObjectiveParts(
            self.rl, self.dp_mean, max_new_tokens, opd=self.opd_cfg, seed=self.seed
        )
        return build_objective(objective, parts)

    def configure_vision(self) -> VisionProcessor | None:
        """The policy's image side (None for a text-only policy); freezes the vision tower unless
        ``policy.train_vision_tower``. Default: ``load_vision`` on the policy folder."""
        return load_vision(self.policy_cfg, self.tokenizer, self.policy)

    def build_engine(self, will_sleep: bool = True) -> RolloutEngine:
        """The rollout engine (``rollout.engine``), drawing ahead under ``rollout.max_off_policy_steps``.
        ``will_sleep``: whether the hand-off puts it to sleep."""
        parts = EngineParts(
            self.policy,
            self.tokenizer,
            self.policy_cfg,
            self.rl,
            self.vision,
            trainer=self._trainer,
        )
        engine = build_engine(self.rollout_cfg, parts, will_sleep=will_sleep)
        ahead = self.rollout_cfg.max_off_policy_steps
        return collect.draws_ahead(engine, ahead, self._weights_step)

    def compute_rewards(
        self, rollouts: Sequence[Rollout]
    ) -> tuple[Tensor, dict[str, float]]:
        """One reward per rollout, and reward metrics (``collect/rewards.py``). Recorded rewards (replay) are used
        as they are; ``rewards: []`` scores 0."""
        return self.reward_scorer(rollouts)

    def configure_collector(self) -> collect.Collector:
        """The rollout of one loop step, from this module's parts and ``self.engine`` (``collect/wiring.py``). Built
        once the strategy is known (the sampling seed and the reductions depend on the ranks)."""
        side = TrainerSide(self._trainer)
        self.load_episodes()
        # a SIGTERM abandons a reward call still running, or the wait for rollouts in flight
        self.reward_scorer = collect.RewardScorer(
            self.reward_specs, side.stop_poll("a reward function")
        )
        parts = collect.CollectParts(
            self.engine,
            self.episodes,
            self.compute_rewards,
            self.reward_scorer,
            self.rl,
            self.rollout_cfg,
            self.step_sampling(),
            self.tokenizer,
            vision=self.vision,
            context=self.context_length(),
            prompts=side.prompts,
            dp=self.dp_group(),
            waiting_stop=side.stop_poll("rollouts in flight"),
            in_flight=self._in_flight,
            certifier=self.certifier,
        )
        return collect.wire_collector(parts)

    def sampling(self) -> SamplingConfig:
        """The sampling of this rank's next training draw."""
        return self.step_sampling().at(self.loop_step)

    def step_sampling(self) -> collect.StepSampling:
        """How each loop step samples on this rank (``rollout`` section; a seed per seed, loop step and rank)."""
        logprobs = self.rl.needs_sampler_logprobs
        rank = self.global_rank
        return collect.StepSampling.of(
            self.rollout_cfg, logprobs, self.seed, self.dp_size(), rank, self.vision
        )

    def configure_recorders(self) -> list[Recorder]:
        """More per-token records for the ahead pass to take (``update/records.py``; none by default)."""
        return []

    def configure_updater(self) -> Updater:
        """The update of one collected batch (``model_parts.build_updater``, docs/update.md). Built for one process:
        the ranks' split and reductions join with the optimizer (``on_train_start``), once the strategy is known."""
        return build_updater(
            self.policy,
            self.forward_chunk,
            self.scorer,
            self.routing,
            self.objective,
            self.rl,
            recorders=self.configure_recorders(),
            dp_sum=self.dp_sum,
            seed=self.seed,
            timer=self.timer,
        )

    def split(self) -> Split:
        """How this rank cuts a collected batch (packed: token budgets count real tokens)."""
        return Split.of(self.rl, self.dp_size(), self.scorer.packed)

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

    def check_data(self) -> None:
        """Fit the datamodule's prompts to this policy and its rewards before any step runs (``data/fitting.py``)."""
        fit = PromptFit.of(
            self.tokenizer,
            self.context_length(),
            self.rollout_cfg,
            self.rl,
            self.reward_specs,
            self.policy_cfg.path,
            self.vision is not None,
            self.objective.name,
        )
        fit_prompts(fit, TrainerSide(self._trainer).datamodule)
        self.load_episodes()

    def load_episodes(self) -> None:
        """``model.env``'s runner, built once (``collect.episodes_of``): an environment that does not import is
        refused here."""
        if self.episodes is None:
            self.episodes = collect.episodes_of(
                self.env_cfg, self.policy, self.tokenizer, self.context_length()
            )

    def configure_model(self) -> None:
        """Build policy, tokenizer and (beta > 0) the frozen reference; FSDP2-shard them under ModelParallelStrategy.

        Idempotent: Lightning may call it again for a later ``validate``; outside a Trainer call it yourself.
        """
        if self.policy is None:
            model, self.tokenizer = self.configure_policy()
            # model_parts.py
            trained = trainable(model, self.policy_cfg.lora, self.seed)
            self.policy = trained.policy
            self.lora_base = trained.lora_base  # base.py leaves it out of checkpoints
            # before the optimizer and the reference: it may freeze a tower
            self.vision = self.configure_vision()
            parts = scoring_parts(
                self.policy,
                self.tokenizer,
                self.vision,
                self.objective,
                self.rl,
                # OPD's teacher
                self.rollout_cfg.temperature,
                trained.has_adapter,
                self.dp_mean,
            )
            self.ref = parts.ref
            self.routing = parts.routing
            self.scorer = parts.scorer
            self.updater = self.configure_updater()
        self.shard(self.policy, self.ref)

    def on_fit_start(self) -> None:
        super().on_fit_start()  # the precision check: before an engine is built
        # Outside configure_model: its default device/dtype contexts must not leak into an engine (vLLM). Before
        # Lightning restores optimizer state onto the device, so the hand-off can put the engine to sleep first.
        # before the engine: a data problem is reported in seconds, not after vLLM starts
        self.check_data()
        side = TrainerSide(self.trainer)
        if self.engine is None:
            self.engine = self.build_engine(will_sleep=side.engine_sleeps)
        # the Trainer's publisher (attached when none is), told the engine is ready
        self._publisher = side.publisher(
            self.engine, self.policy, self.rollout_cfg.sync_bucket_mb, self.timer
        )
        # a publisher syncs the engine every loop step
        syncs = not isinstance(self._publisher, NoPublisher)
        self.certifier = collect.certifier_of(
            self.rollout_cfg.certificate, self.policy, self.tokenizer, syncs
        )
        # the certificate runs before each training draw
        self.collector = self.configure_collector()

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

    def forward_chunk(
        self, chunk: RolloutBatch, old_logprobs: Tensor | None
    ) -> tuple[Tensor, Tensor, Stats]:
        """Score one chunk with the objective (``ChunkScorer.chunk_loss``)."""
        sampler = pi_old_source(self.rl) == "sampler"
        return self.scorer.chunk_loss(self.objective, chunk, old_logprobs, sampler)

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

    # -- helpers ------------------------------------------------------------------------------------------------------
    @property
    def last_rows(self) -> collect.StepRows | None:
        """The last loop step's rows on this rank (``completions.py`` writes a few), with the objective's per-token
        figure when it has one (OPD's KL to the teacher: ``ExplainsTokens``)."""
        rows = self.collector.last_rows if self.collector is not None else None
        if rows is None:
            return None
        return self.scorer.explained(rows, self.objective, self.tokenizer)

    def _weights_step(self) -> int:
        """The loop step whose weights the trainer holds (an async engine reads it when a sync ends)."""
        return self.loop_step
