"""The quickstart learns: `lightning-grpo fit --config configs/quickstart.yaml`, as `make run` runs it."""

import csv
from pathlib import Path

import pytest

from lightning_grpo.cli import main

CONFIG = Path(__file__).parents[1] / "configs" / "quickstart.yaml"


@pytest.mark.slow
def test_quickstart_reward_rises_and_writes_metrics_and_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(CONFIG), "--trainer.val_check_interval=40"])
    run = tmp_path / "runs" / "quickstart" / "version_0"
    rows = [r for r in csv.DictReader((run / "metrics.csv").open()) if r.get("reward/mean")]
    rewards = [float(r["reward/mean"]) for r in rows]
    assert len(rewards) == 80
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"reward did not rise: first 5 {first:.3f}, last 5 {last:.3f}"
    for column in ("grpo/loss", "grpo/denom", "completion/len_mean", "reward/frac_zero_std"):
        assert all(r[column] != "" for r in rows), column
    assert list(run.glob("checkpoints/*.ckpt")), "no checkpoint written"
