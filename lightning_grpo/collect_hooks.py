"""GRPOModule's rollout half: the parts one loop step's rollout is built from (engine,
episode runner, rewards, collector), each behind a hook a subclass may override.

A mixin of ``GRPOModule`` (module.py): it reads the module's config sections and
models, and builds nothing before the hook that needs it runs (docs/lightning.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_grpo import collect
from lightning_grpo.data.fitting import PromptFit, fit_prompts
from lightning_grpo.engines import EngineParts, build_engine
from lightning_grpo.publisher import NoPublisher
from lightning_grpo.trainer_side import TrainerSide

if TYPE_CHECKING:  # annotations only
    from collections.abc import Sequence

    from torch import Tensor

    from lightning_grpo.rollout.base import Rollout, RolloutEngine, SamplingConfig
    from lightning_grpo.timing import StepTimer


class CollectHooks:
    """Builds and holds the rollout's parts for ``GRPOModule`` (which sets the fields)."""

    timer: StepTimer

    def build_engine(self, will_sleep: bool = True) -> RolloutEngine:
        """The rollout engine (``rollout.engine``), drawing ahead under
        ``rollout.max_off_policy_steps``. ``will_sleep``: whether the hand-off puts it
        to sleep."""
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
        """One reward per rollout, and reward metrics (``collect/rewards.py``).
        Recorded rewards (replay) are used as they are; ``rewards: []`` scores 0."""
        return self.reward_scorer(rollouts)

    def configure_collector(self) -> collect.Collector:
        """The rollout of one loop step, from this module's parts and ``self.engine``
        (``collect/wiring.py``). Built once the strategy is known (the sampling seed
        and the reductions depend on the ranks)."""
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
        """How each loop step samples on this rank (``rollout`` section; a seed per
        seed, loop step and rank)."""
        logprobs = self.rl.needs_sampler_logprobs
        rank = self.global_rank
        return collect.StepSampling.of(
            self.rollout_cfg, logprobs, self.seed, self.dp_size(), rank, self.vision
        )

    def check_data(self) -> None:
        """Fit the datamodule's prompts to this policy and its rewards before any step
        runs (``data/fitting.py``)."""
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
        """``model.env``'s runner, built once (``collect.episodes_of``): an environment
        that does not import is refused here."""
        if self.episodes is None:
            self.episodes = collect.episodes_of(
                self.env_cfg, self.policy, self.tokenizer, self.context_length()
            )

    def start_rollout(self) -> None:
        """The engine (unless one is set), the Trainer's weight publisher, the
        consistency certificate and the collector, in that order (``on_fit_start``)."""
        side = TrainerSide(self._trainer)
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

    @property
    def last_rows(self) -> collect.StepRows | None:
        """The last loop step's rows on this rank (``completions.py`` writes a few),
        with the objective's per-token figure when it has one (OPD's KL to the
        teacher: ``ExplainsTokens``)."""
        rows = self.collector.last_rows if self.collector is not None else None
        if rows is None:
            return None
        return self.scorer.explained(rows, self.objective, self.tokenizer)

    def _weights_step(self) -> int:
        """The loop step whose weights the trainer holds (an async engine reads it
        when a sync ends)."""
        return self.loop_step
