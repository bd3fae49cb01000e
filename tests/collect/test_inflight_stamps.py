"""Version stamps and staleness under in-flight updates (``collect/staleness.py``): a group's first token may be older
than its last; the figures describe the counted rows, token by token where tokens differ."""

from __future__ import annotations

import threading

import torch
from test_async_schedule import Trainer

from lightning_grpo.collect.staleness import drawn_stamps, staleness_metrics, stamps, token_staleness
from lightning_grpo.rollout.base import Prompt, Rollout


def row(versions: list[int] | None, n: int = 4) -> Rollout:
    return Rollout(Prompt(0, [1]), [5] * n, "", "length", versions=versions)


def test_without_per_token_versions_the_stamps_are_the_batchs_version():
    rollouts = [row(None) for _ in range(4)]
    assert torch.equal(drawn_stamps(rollouts, 3, 2), stamps(4, 3))


def test_a_group_spans_from_its_oldest_first_token_to_its_newest_token():
    # group 0: one row cut by a sync (2 -> 3), one row sent after it; group 1: drawn under 2 throughout
    rollouts = [row([2, 2, 3, 3]), row([3, 3, 3, 3]), row([2, 2, 2, 2]), row([2, 2, 2, 2])]
    out = drawn_stamps(rollouts, 2, 2)
    assert out.tolist() == [[2, 3], [2, 3], [2, 2], [2, 2]]
    metrics = staleness_metrics(out, torch.ones(4, dtype=torch.bool), 3, 1)
    assert metrics["rollout/staleness"] == 1.0 and metrics["rollout/version_span"] == 1.0  # a group is as old as
    # its oldest first token (the row sent after the sync does not make group 0 fresher)


def test_token_staleness_weighs_each_counted_token_by_its_own_version():
    rollouts = [row([2, 2, 3, 3]), row([3, 3, 3, 3]), row([2, 2, 2, 2]), row([2, 2, 2, 2])]
    counted = torch.tensor([True, True, False, True])
    metrics = token_staleness(rollouts, counted, trainer_version=3)
    assert metrics["rollout/token_staleness"] == (1 + 1 + 0 + 0 + 0 + 0 + 0 + 0 + 1 + 1 + 1 + 1) / 12
    assert metrics["rollout/inflight_tokens_frac"] == 2 / 12


class CutEngine:
    """A fake in-flight engine: each completion samples 2 tokens, then (a sync landing mid-completion) waits up to
    1 s for the next sync and samples 2 more with whatever version the engine then holds."""

    updates_in_flight = True

    def __init__(self) -> None:
        self.version = 0
        self.synced = threading.Condition()
        self.drawn: list[tuple[int, ...]] = []

    def generate(self, prompts, group_size, sampling):
        self.drawn.append(tuple(p.id for p in prompts))
        first = self.version
        with self.synced:
            self.synced.wait_for(lambda: self.version > first, timeout=1.0)
        second = self.version
        return [Rollout(p, [5, 5, 5, 5], "", "length", versions=[first, first, second, second])
                for p in prompts for _ in range(group_size)]

    def load_weights(self, named_tensors) -> None:
        list(named_tensors)

    def reset_prefix_cache(self) -> None:
        with self.synced:
            self.version += 1
            self.synced.notify_all()


def test_the_collector_reports_groups_cut_by_a_sync_token_by_token():
    engine = CutEngine()
    run = Trainer(engine)
    assert run.rollouts.inflight
    seen = []
    records = run.stream.fetch()
    for _ in range(4):
        seen.append(run.collector.collect(records, run.loop_step)[1])
        run.loop_step += 1  # the update
        records = run.stream.fetch()  # Lightning hands the next batch over before the hand-off publishes
        run.rollouts.load_weights([])
        run.rollouts.reset_prefix_cache()
    assert sorted(run.rollouts.in_flight()) == [5, 6]  # the sync put the step after next in flight at once ...
    assert len(engine.drawn) == len(set(engine.drawn)) == 6  # ... with that step's prompts: none drawn twice
    for metrics in seen[1:]:  # drawn one step off, cut by the sync of the step that drew it
        assert metrics["rollout/staleness"] == 1.0 and metrics["rollout/staleness_worst"] == 1.0
        assert metrics["rollout/version_span"] == 1.0
        assert metrics["rollout/token_staleness"] == 0.5 and metrics["rollout/inflight_tokens_frac"] == 0.5
