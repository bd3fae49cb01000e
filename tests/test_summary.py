"""RunSummary: what a person reads when a fit ends, validation included."""

from __future__ import annotations

import re
from types import SimpleNamespace

from lightning_grpo.summary import RunSummary


def test_quickstart_summary_prints_first_and_last_val_reward(quickstart_run):
    lines = quickstart_run.stdout.splitlines()
    first = next(line for line in lines if "val/reward first" in line)
    last = next(line for line in lines if "val/reward last" in line)
    # The config's num_sanity_val_steps: -1 validates every held-out prompt before training: loop step 0.
    assert re.search(r"val/reward first \d\.\d{3}  \(loop step 0\)", first)
    assert re.search(r"val/reward last  \d\.\d{3}  \(loop step 2, [+-]\d\.\d{3}; 3 validations\)", last)


def test_validations_are_recorded_with_their_loop_step_and_survive_a_checkpoint():
    summary = RunSummary()
    trainer = SimpleNamespace(sanity_checking=True, callback_metrics={"val/reward": 0.5},
                              num_sanity_val_batches=[2], num_val_batches=[8])
    summary.on_validation_end(trainer, None)  # Lightning's sanity check over 2 of 8 batches: not a measurement
    summary._rewards = [0.1, 0.2]
    trainer.sanity_checking, trainer.callback_metrics = False, {"val/reward": 0.25}
    summary.on_validation_end(trainer, None)
    summary._rewards.append(0.3)
    trainer.callback_metrics = {"val/reward": 0.75}
    summary.on_validation_end(trainer, None)
    restored = RunSummary()
    restored.load_state_dict(summary.state_dict())
    assert restored._val_lines() == ["  val/reward first 0.250  (loop step 2)",
                                     "  val/reward last  0.750  (loop step 3, +0.500; 2 validations)"]
    assert "not measured" in RunSummary()._val_lines()[0]
    # A sanity check over every held-out batch (num_sanity_val_steps: -1) measures the starting weights.
    whole = RunSummary()
    trainer = SimpleNamespace(sanity_checking=True, callback_metrics={"val/reward": 0.125},
                              num_sanity_val_batches=[8], num_val_batches=[8])
    whole.on_validation_end(trainer, None)
    assert whole._val == [(0, 0.125)]
