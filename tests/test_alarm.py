"""The learning-signal alarm: the quickstart at temperature 0.01 warns within 10 loop steps, naming the knobs."""

from __future__ import annotations

import warnings

import pytest
from helpers import QUICKSTART_ARGS

from lightning_grpo.alarm import SignalAlarm
from lightning_grpo.cli import main

SMALL = ["--trainer.max_steps=10", "--data.val_size=0", "--model.rl.batch_per_replica=16",
         "--model.rl.micro_batch_per_replica=16", "--trainer.enable_progress_bar=false"]
"""The quickstart at 2 prompts x 8 completions, 10 loop steps, no validation."""


def _alarms(tmp_path, monkeypatch, *extra: str) -> list[str]:
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["fit", *QUICKSTART_ARGS, *SMALL, *extra])
    return [str(w.message) for w in caught if str(w.message).startswith("no learning signal")]


@pytest.mark.slow
def test_a_near_greedy_quickstart_warns_naming_temperature_group_size_and_difficulty(tmp_path, monkeypatch):
    alarms = _alarms(tmp_path, monkeypatch, "--model.rollout.temperature=0.01")
    assert len(alarms) == 1, alarms  # once per fit, not every step
    assert "reward/frac_zero_std" in alarms[0]
    for knob in ("model.rollout.temperature=0.01", "model.rl.group_size=8", "too easy or too hard", "reward/mean"):
        assert knob in alarms[0]
    assert int(alarms[0].split("to loop step ")[1].split(";")[0]) <= 10


@pytest.mark.slow
def test_completions_cut_at_max_new_tokens_warn_naming_the_cap(tmp_path, monkeypatch):
    alarms = _alarms(tmp_path, monkeypatch, "--model.rollout.max_new_tokens=1", "--alarm.patience=3")
    clipped = [a for a in alarms if "max_new_tokens" in a]
    assert len(clipped) == 1 and "model.rollout.max_new_tokens=1 for 3 loop steps (to loop step 3)" in clipped[0]


def test_bad_thresholds_are_refused_naming_the_call():
    with pytest.raises(ValueError, match=r"SignalAlarm\(zero_std_frac=1.5"):
        SignalAlarm(zero_std_frac=1.5)
