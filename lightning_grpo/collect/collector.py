"""The Collector owns one rollout: a loop step's records in, this rank's ``RolloutBatch`` and its metrics out.

One collection, in call order (docs/collect.md draws it):

1. ``_round``: records -> prompts (``prompts.py``: a VLM's images expanded, unreadable ones skipped) -> rollouts
   (``draw.py``; under async rollouts through ``schedule.py``) -> rewards (``rewards.py``) shaped by
   ``shaping.REWARD_RULES`` (the overlong penalty) -> whole groups (``groups.py``), each stamped with the weight
   version that drew it (``staleness.py``).
2. ``rl.dynamic_sampling``: only groups whose rewards differ, refilled from further prompts (``refill.py``); under
   async rollouts the staleness of the trained rows.
3. ``_advantages``: group-normalized advantages of the trained rows (``advantages.py``).
4. ``pack_rollouts`` -> the ``RolloutBatch`` and ``shaping.BATCH_METRICS`` over it; shaping leaves only the tokens
   that count in the loss.

No Lightning in here: a module builds one Collector once the engine exists and the strategy is known, from
explicit parts, and calls ``collect`` from ``training_step``; a test drives it with a fake engine the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_grpo.advantages import dp_batch_std, group_advantages
from lightning_grpo.batch import RolloutBatch, pack_rollouts
from lightning_grpo.certificate import Certifier
from lightning_grpo.collect.async_rollouts import unwrapped
from lightning_grpo.collect.draw import Drawer
from lightning_grpo.collect.groups import Groups, scatter
from lightning_grpo.collect.prompts import (
    StepSampling,
    live_prompts,
    step_prompts,
    with_skipped_groups,
)
from lightning_grpo.collect.refill import Refill, fill
from lightning_grpo.collect.rewards import RewardScorer
from lightning_grpo.collect.rows import RewardParts, StepRows
from lightning_grpo.collect.schedule import AsyncSchedule
from lightning_grpo.collect.shaping import (
    batch_metrics,
    counted_only,
    counted_rows,
    shape_rewards,
)
from lightning_grpo.collect.staleness import (
    drawn_stamps,
    staleness_metrics,
    token_staleness,
)
from lightning_grpo.config import GRPOConfig
from lightning_grpo.data.seam import PromptProvider
from lightning_grpo.distributed import ONE_PROCESS_GROUP, DataParallelGroup
from lightning_grpo.rollout.base import Prompt, RestartsServers, Rollout, SamplingConfig
from lightning_grpo.vision import VisionProcessor

Score = Callable[[Sequence[Rollout]], tuple[Tensor, dict[str, float]]]
"""``rollouts -> ([N] float32 total rewards, metrics)``: ``GRPOModule.compute_rewards``, or a ``RewardScorer``."""


class Collector:
    """Owns one rollout: prompts -> draw -> rewards -> shaping / refill -> advantages -> ``RolloutBatch``.

    Args:
        drawer: draws rollouts with the run's engine (completions or episodes).
        score: one total reward per rollout, and reward metrics.
        rewards: the scorer whose per-function parts the completions log shows (begun afresh each loop step), or
            None (no parts shown).
        rl: group size, advantages, dynamic sampling and shaping knobs.
        max_new_tokens: the completion cap (``rollout.max_new_tokens``; the overlong penalty counts from it).
        sampling: the loop step's sampling (its seed per rank).
        tokenizer: the policy's tokenizer (prompt encoding, pad and EOS ids).
        vision: a vision-language policy's image side (None: text-only).
        context: the policy's context in tokens (None = unknown): rows are cut to it.
        prompts: the datamodule's side (refills, counters, what a bad record does), or None (not a
            ``PromptProvider``: nothing is asked of it).
        dp: the data-parallel ranks (batch-wide reward std, agreed refill rounds).
        schedule: async rollouts (``rollout.max_off_policy_steps``), or None (drawn now).
        certifier: ``rollout.certificate``, run before each draw (the sync of this step is done and nothing is in
            flight), or None (off).

    Example::

        scorer = RewardScorer(None)  # the built-in task's reward
        collector = Collector(Drawer(engine, None), scorer, rewards=scorer, rl=rl, max_new_tokens=16,
                              sampling=sampling, tokenizer=tokenizer)
        batch, metrics = collector.collect(records, loop_step=0)
    """

    def __init__(
        self,
        drawer: Drawer,
        score: Score,
        *,
        rl: GRPOConfig,
        max_new_tokens: int,
        sampling: StepSampling,
        tokenizer,
        rewards: RewardScorer | None = None,
        vision: VisionProcessor | None = None,
        context: int | None = None,
        prompts: PromptProvider | None = None,
        dp: DataParallelGroup = ONE_PROCESS_GROUP,
        schedule: AsyncSchedule | None = None,
        certifier: Certifier | None = None,
    ) -> None:
        self.drawer = drawer
        self.score = score
        self.rewards = rewards
        self.rl = rl
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.tokenizer = tokenizer
        self.vision = vision
        self.context = context
        self.prompts = prompts
        self.dp = dp
        self.schedule = schedule
        self.certifier = certifier
        # Under async rollouts the worker thread draws with the engine the schedule wraps (never through the wrapper,
        # whose draws wait for the worker).
        self._worker_drawer = (
            Drawer(schedule.rollouts.engine, drawer.episodes)
            if schedule is not None
            else None
        )
        self.last_rows: StepRows | None = None
        """The last loop step's rows on this rank (``completions.py`` writes a few)."""

    def collect(
        self, records: Sequence, loop_step: int
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """This rank's collected batch for the loop step after ``loop_step`` (batches consumed so far), and metrics.

        ``group_size`` completions per record, scored and normalized per group (``rl.dynamic_sampling``: only groups
        whose rewards differ, refilled from further prompts). First the consistency certificate, when one is due.
        """
        mismatch = (
            self.certifier(unwrapped(self.drawer.engine), loop_step)
            if self.certifier is not None
            else {}
        )
        if self.rewards is not None:
            self.rewards.begin_step()
        groups, metrics = self._round(records, loop_step)
        if self.rl.dynamic_sampling:
            groups, counts = self._filled(groups, len(records), loop_step)
            metrics.update(counts.metrics())
        # over the rows trained: a refill round is drawn now, with current weights
        if self.schedule is not None:
            metrics.update(self._staleness(groups, loop_step))
        advantages, adv_metrics = self._advantages(groups)
        batch = pack_rollouts(
            groups.rollouts,
            advantages,
            groups.rewards,
            self.tokenizer.pad_token_id,
            self.context,
        )
        metrics.update(adv_metrics)
        metrics.update(batch_metrics(groups, batch, self.rl, self.max_new_tokens))
        metrics.update(self._data_counters())
        metrics.update(mismatch)  # mismatch/*
        # no parts shown
        parts = self.rewards.parts if self.rewards is not None else RewardParts()
        counted = counted_rows(groups, self.rl.mask_truncated_completions)
        self.last_rows = StepRows(
            loop_step + 1,
            groups.rollouts,
            groups.rewards,
            advantages,
            parts,
            trained=counted,
        )
        return counted_only(batch, groups, self.rl.mask_truncated_completions), metrics

    # -- its share of a checkpoint ------------------------------------------------------------------------------------
    def record(self, checkpoint: dict) -> None:
        """Under async rollouts the prompts in flight go into ``checkpoint`` (drawn again on resume); else nothing."""
        if self.schedule is not None:
            self.schedule.record(checkpoint)

    def expect_reissue(self, in_flight: dict[int, list[int]]) -> None:
        """A loaded checkpoint's prompts in flight (``schedule.in_flight_of``), for a checkpoint loaded after this
        collector was built (a strategy that restores after ``on_fit_start``)."""
        if self.schedule is not None:
            self.schedule.expect_reissue(in_flight)

    # -- the pieces validation shares ---------------------------------------------------------------------------------
    def prompts_of(self, records: Sequence) -> tuple[list[Prompt], list[int]]:
        """``(prompts, skipped)`` of ``records`` (``prompts.step_prompts`` with the data's bad-record rule)."""
        return step_prompts(records, self.tokenizer, self.vision, self._on_bad_record())

    def draw(
        self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingConfig
    ) -> tuple[list[Rollout], dict[str, float]]:
        """``group_size`` rollouts per prompt now, with the engine as it is (validation; never in flight)."""
        return self.drawer(prompts, group_size, sampling)

    # -- one round ----------------------------------------------------------------------------------------------------
    def _round(
        self, records: Sequence, loop_step: int
    ) -> tuple[Groups, dict[str, float]]:
        """``group_size`` completions per record, scored and shaped; a skipped bad record's group keeps its rows (the
        batch size is the config's) with nothing to learn from."""
        # A VLM's image placeholders are expanded here (its images decoded): an unreadable one is met at this step.
        prompts, skipped = self.prompts_of(records)
        rollouts, metrics, version = self._training_draw(
            live_prompts(prompts, skipped), loop_step
        )
        rewards, reward_metrics = self.score(rollouts)
        metrics = {**reward_metrics, **metrics}
        rewards = shape_rewards(rollouts, rewards, self.rl, self.max_new_tokens)
        keep = torch.ones(len(rollouts), dtype=torch.bool)
        if skipped:
            if self.prompts is not None:
                self.prompts.count_skipped(len(skipped))
            rollouts, keep = with_skipped_groups(
                rollouts,
                prompts,
                skipped,
                self.rl.group_size,
                self.tokenizer.eos_token_id,
            )
            rewards = scatter(rewards, keep)
        return Groups(
            rollouts,
            rewards,
            keep,
            keep,
            drawn_stamps(rollouts, version, self.rl.group_size),
        ), metrics

    def _training_draw(
        self, prompts: list[Prompt], loop_step: int
    ) -> tuple[list[Rollout], dict[str, float], int]:
        """(rollouts, episode metrics, the weight version that drew them: ``loop_step`` when drawn now)."""
        sampling = self.sampling.at(loop_step)
        if self.schedule is None:
            rollouts, metrics = self.drawer(prompts, self.rl.group_size, sampling)
            version = loop_step
        else:
            upcoming = functools.partial(self._upcoming, loop_step)
            rollouts, metrics, version = self.schedule.draw(
                loop_step + 1, prompts, sampling, self._job, upcoming
            )
        engine = unwrapped(self.drawer.engine)
        # counted over the run: a restart in a sync shows at the next draw
        if isinstance(engine, RestartsServers):
            metrics = {
                **metrics,
                "rollout/server_restarts": float(engine.server_restarts),
            }
        return rollouts, metrics, version

    def _job(
        self, prompts: Sequence[Prompt], sampling: SamplingConfig
    ) -> tuple[list[Rollout], dict[str, float]]:
        """One training batch drawn with the engine the async schedule wraps (on its worker thread)."""
        return self._worker_drawer(prompts, self.rl.group_size, sampling)

    def _upcoming(
        self, loop_step: int, ahead: int
    ) -> tuple[list[Prompt], SamplingConfig] | None:
        """Loop step ``loop_step + 1 + ahead``'s prompts (without the bad records the draw would skip) and sampling."""
        records = (
            self.prompts.upcoming_records(ahead) if self.prompts is not None else None
        )
        if records is None:
            # not a PromptDataModule: its next batch is unknown until Lightning fetches it
            return None
        try:
            prompts, skipped = self.prompts_of(records)
        # noqa: BLE001 - the step itself meets (and reports) a bad record when it comes
        except Exception:
            return None
        return live_prompts(prompts, skipped), self.sampling.at(loop_step + ahead)

    def _refill(self, loop_step: int, generate: bool) -> Groups | None:
        """One refill round: every rank advances the refill cursor; a rank already full generates nothing."""
        records = self.prompts.refill_records()
        if not generate:
            return None
        return self._round(records, loop_step)[0]

    # -- dynamic sampling and staleness -------------------------------------------------------------------------------
    def _filled(
        self, groups: Groups, n_records: int, loop_step: int
    ) -> tuple[Groups, Refill]:
        """``rl.dynamic_sampling``: only groups whose rewards differ, refilled from further prompts."""
        refill = functools.partial(self._refill, loop_step)
        return fill(
            groups,
            self.rl.group_size,
            n_records,
            self.rl.max_refill_rounds,
            refill,
            self.dp.total,
            self.dp.rank,
        )

    def _staleness(self, groups: Groups, loop_step: int) -> dict[str, float]:
        """Under async rollouts, how many weight versions behind the trained rows were drawn."""
        # as _advantages: what was drawn
        rows = groups.trained if bool(groups.trained.any()) else groups.live
        metrics = staleness_metrics(
            groups.versions, rows, loop_step, self.schedule.rollouts.k
        )
        # tokens of one row may come from two versions
        if self.schedule.rollouts.inflight:
            metrics.update(token_staleness(groups.rollouts, rows, loop_step))
        return metrics

    # -- advantages ---------------------------------------------------------------------------------------------------
    def _advantages(self, groups: Groups) -> tuple[Tensor, dict[str, float]]:
        """``[N]`` group-normalized advantages, 0 on rows not trained, and their statistics."""
        trained = groups.trained
        # the std of every rank's trained rewards
        across = self.rl.scale_rewards == "batch" and self.dp.size > 1
        batch_std = (
            dp_batch_std(groups.rewards[trained], self.dp.reduce) if across else None
        )
        # nothing to train: the statistics of what was drawn
        rows = trained if bool(trained.any()) else groups.live
        advantages, stats = group_advantages(
            groups.rewards[rows],
            self.rl.group_size,
            self.rl.scale_rewards,
            batch_std=batch_std,
        )
        advantages = scatter(advantages, rows).masked_fill(~trained, 0.0)
        return advantages, {k: float(v) for k, v in stats.items()}

    def _on_bad_record(self) -> str:
        return self.prompts.on_bad_record if self.prompts is not None else "error"

    def _data_counters(self) -> dict[str, float]:
        skipped = self.prompts.bad_records_skipped if self.prompts is not None else 0
        dropped = self.prompts.long_prompts_dropped if self.prompts is not None else 0
        return {
            "data/bad_records_skipped": float(skipped),
            "data/long_prompts_dropped": float(dropped),
        }
