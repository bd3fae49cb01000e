"""The async schedule on a fake engine (unit tier; tests/collect/test_async.py runs it against a real ``vllm serve``).

A ``VersionedEngine`` stamps each completion with the weight version it holds when it samples, and a sync
(``load_weights`` .. ``reset_prefix_cache``) bumps that version, so each test reads off which weights drew a batch.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from lightning_grpo.collect import AsyncSchedule, Collector, Drawer, StepSampling
from lightning_grpo.collect.async_rollouts import AsyncRollouts
from lightning_grpo.collect.schedule import KEY, in_flight_of
from lightning_grpo.config import GRPOConfig
from lightning_grpo.data.seam import PromptProvider
from lightning_grpo.data.stream import PromptRecord
from lightning_grpo.rollout.base import Rollout
from lightning_grpo.tiny.tokenizer import make_char_tokenizer

RL = GRPOConfig(batch_per_replica=4, group_size=2, micro_batch_per_replica=4)


class VersionedEngine:
    """Completion texts name the weight version that sampled them; ``fail_at`` makes that draw raise."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.version = 0
        self.draws = 0
        self.fail_at = fail_at
        self.threads = set()

    def generate(self, prompts, group_size, sampling):
        self.draws += 1
        self.threads.add(threading.current_thread().name)
        if self.draws == self.fail_at:
            raise RuntimeError("the server went away")
        return [Rollout(p, [5] * (k + 1), f"v{self.version}", "stop") for p in prompts for k in range(group_size)]

    def load_weights(self, named_tensors) -> None:
        list(named_tensors)

    def reset_prefix_cache(self) -> None:
        self.version += 1


class Stream(PromptProvider):
    """Loop step ``s`` holds the records ``2s`` and ``2s + 1``; ``position`` is how many steps were fetched."""

    def __init__(self) -> None:
        self.position = 0

    def fetch(self) -> list[PromptRecord]:
        self.position += 1
        return records(self.position - 1)

    def upcoming_records(self, ahead: int) -> list[PromptRecord]:
        return records(self.position - 1 + ahead)


def records(step: int) -> list[PromptRecord]:
    return [PromptRecord(i, f"{i % 10}+1=", "2", {}) for i in (2 * step, 2 * step + 1)]


def zero_rewards(rollouts):
    return torch.zeros(len(rollouts)), {}


class RefillStream(PromptProvider):
    """Loop step ``s`` holds the records ``8s .. 8s + 7``; each refill round brings 4 new ids from 1000, every
    ``spacing``-th."""

    def __init__(self, spacing: int = 2) -> None:
        self.position = 0
        self.refilled = 0
        self.spacing = spacing

    def fetch(self) -> list[PromptRecord]:
        self.position += 1
        return self.upcoming_records(0)

    def upcoming_records(self, ahead: int) -> list[PromptRecord]:
        first = 8 * (self.position - 1 + ahead)
        return [PromptRecord(i, f"{i % 10}+1=", "2", {}) for i in range(first, first + 8)]

    def refill_records(self) -> list[PromptRecord]:
        first = 1000 + 4 * self.spacing * self.refilled
        self.refilled += 1
        return [PromptRecord(i, f"{i % 10}+1=", "2", {}) for i in range(first, first + 4 * self.spacing, self.spacing)]


def odd_ids_flat(rollouts):
    """An odd prompt id's group is flat (dropped by dynamic sampling); an even id's has rewards (1, 0)."""
    values = [float(r.prompt.id % 2 == 1 or r.token_ids == [5]) for r in rollouts]
    return torch.tensor(values), {}


def flat_unless_a_multiple_of_4(rollouts):
    values = [float(r.prompt.id % 4 != 0 or r.token_ids == [5]) for r in rollouts]
    return torch.tensor(values), {}


class Trainer:
    """What the module does around the collector: loop steps consumed, and a weight sync at each boundary."""

    def __init__(self, engine: VersionedEngine, k: int = 1, reissue=None, rl: GRPOConfig = RL,
                 stream: PromptProvider | None = None, score=zero_rewards) -> None:
        self.loop_step = 0
        self.stream = stream or Stream()
        self.rollouts = AsyncRollouts(engine, k, weights_step=self.weights_step)
        self.schedule = AsyncSchedule(self.rollouts, reissue=reissue)
        sampling = StepSampling(4, 1.0, 1.0, 0, (), False, seed=0)
        self.collector = Collector(Drawer(self.rollouts, None), score, rl=rl, max_new_tokens=4,
                                   sampling=sampling, tokenizer=make_char_tokenizer(), prompts=self.stream,
                                   schedule=self.schedule)

    def weights_step(self) -> int:
        return self.loop_step

    def step(self) -> tuple[list[str], dict[str, float]]:
        batch, metrics = self.collector.collect(self.stream.fetch(), self.loop_step)
        texts = [r.text for r in self.collector.last_rows.rollouts]
        self.loop_step += 1  # the update
        self.rollouts.load_weights([])  # the sync at the boundary: waits until nothing is in flight
        self.rollouts.reset_prefix_cache()
        return texts, metrics


def test_one_step_off_draws_each_batch_with_the_weights_of_two_steps_before():
    engine = VersionedEngine()
    run = Trainer(engine)
    seen = [run.step() for _ in range(4)]
    # step 1 is drawn now (version 0); step s >= 2 was put in flight during step s-1, before its sync
    assert [texts[0] for texts, _ in seen] == ["v0", "v0", "v1", "v2"]
    assert [m["rollout/staleness"] for _, m in seen] == [0.0, 1.0, 1.0, 1.0]
    assert [m["rollout/staleness_1_frac"] for _, m in seen] == [0.0, 1.0, 1.0, 1.0]
    assert engine.threads == {"lightning-grpo-rollouts"}  # every training draw ran on the worker thread
    assert run.rollouts.in_flight() == {5: [8, 9]}  # loop step 5 (its records: ids 8, 9) is in flight


def test_refill_rows_drawn_with_current_weights_count_as_current_in_the_staleness():
    """Async + dynamic sampling: half of loop step 2's trained rows come from a refill round drawn on the spot with
    the current weights (docs/async.md), so half the trained rows are 0 steps stale, half 1."""
    rl = GRPOConfig(batch_per_replica=16, group_size=2, micro_batch_per_replica=16, dynamic_sampling=True,
                    max_refill_rounds=2)
    run = Trainer(VersionedEngine(), rl=rl, stream=RefillStream(), score=odd_ids_flat)
    run.step()
    texts, metrics = run.step()
    assert texts == ["v0"] * 8 + ["v1"] * 8  # 4 groups drawn ahead (weights of step 0), 4 refilled now
    assert metrics["data/dynamic_refill_rounds"] == 1.0
    assert metrics["rollout/staleness"] == 0.5
    assert metrics["rollout/staleness_0_frac"] == 0.5
    assert metrics["rollout/staleness_1_frac"] == 0.5
    assert metrics["rollout/staleness_worst"] == 1.0
    assert metrics["rollout/version_span"] == 0.0  # one weight version from each group's first token to its last


def test_staleness_describes_the_trained_rows_never_the_padding():
    """Loop step 2 keeps 2 informative groups of its stale draw and 4 of a refill round drawn now; the batch stays 2
    groups short and pads with flat groups of the stale draw, which train nothing: 4 stale rows and 8 current ones
    are trained (with the padding counted it would read 0.5, per batch 1.0)."""
    rl = GRPOConfig(batch_per_replica=16, group_size=2, micro_batch_per_replica=16, dynamic_sampling=True,
                    max_refill_rounds=1)
    run = Trainer(VersionedEngine(), rl=rl, stream=RefillStream(spacing=4), score=flat_unless_a_multiple_of_4)
    with pytest.warns(UserWarning, match="short over all ranks"):
        run.step()
    with pytest.warns(UserWarning, match="short over all ranks"):
        texts, metrics = run.step()
    assert texts == ["v0"] * 4 + ["v1"] * 8 + ["v0"] * 4  # 2 stale groups, 4 refilled, 2 stale padding groups
    assert metrics["data/dynamic_batch_short"] == 2.0
    assert metrics["rollout/staleness"] == pytest.approx(1 / 3)
    assert metrics["rollout/staleness_0_frac"] == pytest.approx(2 / 3)
    assert metrics["rollout/staleness_worst"] == 1.0


def test_a_checkpoint_records_the_prompts_in_flight_and_rank_0_reads_them_back():
    run = Trainer(VersionedEngine())
    run.step()
    checkpoint = {}
    run.schedule.record(checkpoint)
    assert checkpoint[KEY] == {"in_flight": {2: [2, 3]}}
    assert in_flight_of(checkpoint, rank=0) == {2: [2, 3]} and in_flight_of(checkpoint, rank=1) == {}


def test_an_error_on_the_worker_thread_is_raised_when_its_batch_is_taken():
    run = Trainer(VersionedEngine(fail_at=2))  # the draw of loop step 2, in flight during step 1
    run.step()
    with pytest.raises(RuntimeError, match="the server went away"):
        run.step()


def test_a_resumed_run_says_whether_it_draws_the_checkpoints_prompts_again(caplog):
    run = Trainer(VersionedEngine(), reissue={1: [0, 1], 2: [7, 7]})
    with caplog.at_level(logging.INFO, logger="lightning_grpo.collect.schedule"):
        run.step()
        run.step()
    info, warning = [r for r in caplog.records if r.name == "lightning_grpo.collect.schedule"]
    assert info.levelno == logging.INFO and "drawing again the 2 prompts" in info.getMessage()
    assert warning.levelno == logging.WARNING and "[7, 7] in flight but the data now gives [2, 3]" in warning.getMessage()


def test_staleness_zero_is_the_synchronous_order():
    """Without the schedule every batch is drawn with the weights of the step before it."""
    engine = VersionedEngine()
    stream = Stream()
    sampling = StepSampling(4, 1.0, 1.0, 0, (), False, seed=0)
    collector = Collector(Drawer(engine, None), zero_rewards, rl=RL, max_new_tokens=4, sampling=sampling,
                          tokenizer=make_char_tokenizer(), prompts=stream)
    texts = []
    for step in range(3):
        collector.collect(stream.fetch(), step)
        texts.append(collector.last_rows.rollouts[0].text)
        engine.reset_prefix_cache()
    assert texts == ["v0", "v1", "v2"]


def test_a_checkpoint_loaded_after_the_schedule_was_built_is_still_checked(caplog):
    run = Trainer(VersionedEngine())
    run.schedule.expect_reissue({1: [0, 1]})
    with caplog.at_level(logging.INFO, logger="lightning_grpo.collect.schedule"):
        run.step()
    assert any("drawing again the 2 prompts" in r.getMessage() for r in caplog.records)
