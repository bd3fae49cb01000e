"""The step timer: one mechanism per loop step, its ``time/*`` columns in every metrics.csv row."""

import csv
import time

import pytest
from helpers import fit_tiny, global_determinism_restored, tiny_grpo_module
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo.timing import AHEAD, PHASES, SYNC, UPDATE, WAIT_BATCH, StepTimer, is_timing

COLUMNS = {f"time/{p}" for p in PHASES} | {"time/ahead_share"}


def test_every_phase_has_a_column_and_the_next_step_starts_from_zero():
    timer = StepTimer()
    with timer.phase(UPDATE):
        with timer.phase(AHEAD):  # nested: counted in both
            time.sleep(0.01)
        time.sleep(0.01)
    with timer.phase(UPDATE):  # a phase run twice adds up
        time.sleep(0.01)
    first = timer.columns()
    assert set(first) == {f"time/{p}" for p in PHASES}
    assert first["time/wait_batch"] == first["time/sync"] == 0.0  # not run: 0.0, never missing
    assert 0.01 <= first["time/ahead"] < first["time/update"] <= first["time/step"]
    assert first["time/update"] >= 0.03
    second = timer.columns()
    assert second["time/update"] == second["time/ahead"] == 0.0
    assert second["time/step"] < first["time/step"]


def test_a_phase_that_raises_is_not_counted():
    timer = StepTimer()
    with pytest.raises(RuntimeError), timer.phase(WAIT_BATCH):
        raise RuntimeError("draw failed")
    assert timer.seconds(WAIT_BATCH) == 0.0


def test_timing_names_are_recognised_and_nothing_else():
    assert all(is_timing(c) for c in COLUMNS)
    assert not any(is_timing(c) for c in ("grpo/loss", "reward/mean", "step", "data/dynamic_refill_rounds"))


def test_every_metrics_row_has_the_time_columns(tiny_policy_dir, tmp_path):
    """GRPO at n_mini = 2 on the HF engine: an ahead pass each loop step, no engine to publish to."""
    module = tiny_grpo_module(tiny_policy_dir)
    assert module.rl.n_mini == 2
    with global_determinism_restored():
        fit_tiny(module, tmp_path, loop_steps=3, logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1)
    with open(next(tmp_path.glob("csv/**/metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r["grpo/loss"]]
    assert len(rows) == 3
    for row in rows:
        t = {c: float(row[c]) for c in COLUMNS}
        assert t["time/wait_batch"] > 0 and t["time/update"] > 0 and t["time/ahead"] > 0
        assert t["time/ahead"] < t["time/update"] and 0 < t["time/ahead_share"] < 1
        assert t["time/sync"] == 0.0  # the HF engine generates with the policy: no publisher, nothing timed
        assert t["time/step"] >= t["time/wait_batch"] + t["time/update"]
    assert module.timer.seconds(SYNC) == 0.0


def test_ranks_take_the_slowest_phase_and_the_mean_share():
    """The slowest rank sets the step's time; the share is a ratio, averaged (docs/distributed.md)."""
    from lightning_grpo.rank_metrics import rank_reduction

    assert {rank_reduction(f"time/{p}") for p in PHASES} == {"max"}
    assert rank_reduction("time/ahead_share") == "mean"
