"""The async schedule's gaps on the fake engine of test_async_schedule.py: the staleness a batch reports is the one
it has at every depth k, a resumed run re-issues exactly the prompts in flight, a changed draw is drawn afresh, a
sync never overlaps a draw, and the worker survives an error and stops on close."""

from __future__ import annotations

import threading

import pytest
from test_async_schedule import Trainer, VersionedEngine

from lightning_grpo.collect.async_rollouts import AsyncRollouts
from lightning_grpo.collect.schedule import in_flight_of
from lightning_grpo.rollout.base import Prompt, SamplingConfig


def drawn_version(texts: list[str]) -> int:
    """The weight version (= loop steps synced) that sampled a batch: its completions name it."""
    versions = {int(t[1:]) for t in texts}
    assert len(versions) == 1, f"a batch drawn with several weight versions: {versions}"
    return versions.pop()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_reported_staleness_is_the_true_one_and_never_past_k(k):
    run = Trainer(VersionedEngine(), k=k)
    for step in range(6):
        texts, metrics = run.step()
        true = step - drawn_version(texts)  # the trainer holds the weights of `step` syncs while it trains
        assert metrics["rollout/staleness"] == true <= k
        assert metrics[f"rollout/staleness_{true}_frac"] == 1.0
        assert sum(metrics[f"rollout/staleness_{i}_frac"] for i in range(k + 1)) == 1.0
    assert len(run.rollouts.in_flight()) == k  # always the next k batches in flight


def prompt_ids(run: Trainer) -> list[int]:
    return sorted({r.prompt.id for r in run.collector.last_rows.rollouts})


def test_a_resumed_run_draws_the_prompts_in_flight_again_and_loses_none():
    straight = Trainer(VersionedEngine())
    ids = []
    for _ in range(4):
        straight.step()
        ids.append(prompt_ids(straight))

    first = Trainer(VersionedEngine())
    first.step()
    first.step()
    checkpoint = {}
    first.schedule.record(checkpoint)  # taken at the boundary after loop step 2
    in_flight = in_flight_of(checkpoint, rank=0)
    first.rollouts.close()

    resumed = Trainer(VersionedEngine(), reissue=in_flight)
    resumed.loop_step = 2
    resumed.stream.position = 2  # the data position: it did not pass the prompts in flight
    resumed.step()
    assert [prompt_ids(resumed)] == list(in_flight.values()) == [ids[2]]
    resumed.step()
    assert prompt_ids(resumed) == ids[3]


def prompts(*ids: int) -> list[Prompt]:
    return [Prompt(i, (3, 4, i)) for i in ids]


def draw(engine):
    def job(batch, sampling):
        return engine.generate(batch, 1, sampling), {}

    return job


def test_a_draw_whose_prompts_or_seed_changed_is_drawn_afresh_with_the_current_weights():
    engine = VersionedEngine()
    rollouts = AsyncRollouts(engine, 1, weights_step=int)  # int() == 0: the trainer's weights of loop step 0
    sampling = SamplingConfig(max_new_tokens=2, seed=7)
    rollouts.submit_ahead(0, _one_batch(prompts(1, 2), sampling), draw(engine))
    rollouts.wait_idle()
    engine.reset_prefix_cache()  # weights move on after the batch was drawn ahead
    out, _, _ = rollouts.take(1, prompts(3, 4), sampling, draw(engine))
    assert [r.prompt.id for r in out] == [3, 4] and {r.text for r in out} == {"v1"}
    rollouts.submit_ahead(1, _one_batch(prompts(5), sampling), draw(engine))
    reseeded = SamplingConfig(max_new_tokens=2, seed=8)
    out, _, _ = rollouts.take(2, prompts(5), reseeded, draw(engine))
    assert engine.draws == 4  # the in-flight draw of step 2 was not the one asked for: drawn again
    assert rollouts.in_flight() == {}
    rollouts.close()


def _one_batch(batch, sampling):
    def upcoming(i):
        return (batch, sampling) if i == 1 else None

    return upcoming


class GatedEngine(VersionedEngine):
    """Each draw waits until the test opens the gate: a sync that does not wait would land mid-draw."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.loaded_while_drawing = False
        self.drawing = False

    def generate(self, prompts, group_size, sampling):
        self.drawing = True
        self.gate.wait(10)
        out = super().generate(prompts, group_size, sampling)
        self.drawing = False
        return out

    def load_weights(self, named_tensors) -> None:
        self.loaded_while_drawing |= self.drawing


def test_a_weight_sync_waits_until_nothing_is_in_flight():
    engine = GatedEngine()
    rollouts = AsyncRollouts(engine, 1, weights_step=int)
    sampling = SamplingConfig(max_new_tokens=2, seed=1)
    rollouts.submit_ahead(0, _one_batch(prompts(1), sampling), draw(engine))
    sync = threading.Thread(target=rollouts.load_weights, args=([],))
    sync.start()
    sync.join(0.3)
    assert sync.is_alive()  # blocked behind the draw in flight
    engine.gate.set()
    sync.join(10)
    assert not sync.is_alive() and not engine.loaded_while_drawing
    rollouts.close()


def test_the_worker_survives_a_failed_draw_and_stops_on_close():
    run = Trainer(VersionedEngine(fail_at=2))
    run.step()
    with pytest.raises(RuntimeError, match="the server went away"):
        run.step()
    run.loop_step += 1  # the next loop step draws again (the failed one was taken and dropped)
    texts, _ = run.step()
    assert texts and run.rollouts._worker.is_alive()
    run.rollouts.close()
    run.rollouts._worker.join(5)
    assert not run.rollouts._worker.is_alive()
