"""The quickstart learns: `lightning-grpo fit --config configs/quickstart.yaml`, as `make run` runs it."""

import csv
import re
from pathlib import Path

import pytest

from lightning_grpo.cli import main

CONFIG = Path(__file__).parents[1] / "configs" / "quickstart.yaml"


@pytest.mark.slow
def test_quickstart_reward_rises_and_writes_metrics_and_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(CONFIG)])  # as `make run` runs it
    run = tmp_path / "runs" / "quickstart" / "version_0"
    every = list(csv.DictReader((run / "metrics.csv").open()))
    val = [float(r["val/reward"]) for r in every if r.get("val/reward")]
    assert len(val) == 9 and val[0] > 0, val  # held-out prompts the policy can get right (main: 0.0 throughout)
    # The first val/reward is the starting policy's (num_sanity_val_steps: -1), a row at loop step 0 and the
    # summary's first: the rise over the run.
    out = capsys.readouterr().out
    start = float(re.search(r"val/reward first (\d\.\d{3})  \(loop step 0\)", out).group(1))
    assert abs(start - val[0]) < 6e-4 and "; 9 validations)" in out
    assert val[-1] > start + 0.05, f"val/reward did not rise: {start} before training, then {val}"
    rows = [r for r in every if r.get("reward/mean")]
    rewards = [float(r["reward/mean"]) for r in rows]
    assert len(rewards) == 80
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"reward did not rise: first 5 {first:.3f}, last 5 {last:.3f}"
    for column in ("grpo/loss", "grpo/denom", "completion/len_mean", "reward/frac_zero_std"):
        assert all(r[column] != "" for r in rows), column
    assert list(run.glob("checkpoints/*.ckpt")), "no checkpoint written"


VLM_CONFIG = Path(__file__).parents[1] / "configs" / "vlm-quickstart.yaml"


@pytest.mark.slow
def test_vlm_quickstart_reward_rises(tmp_path, monkeypatch):
    """`lightning-grpo fit --config configs/vlm-quickstart.yaml` as shipped: a tiny Qwen2.5-VL learns which colour
    the square in the image is (only the pixels tell)."""
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(VLM_CONFIG)])
    run = tmp_path / "runs" / "vlm-quickstart" / "version_0"
    every = list(csv.DictReader((run / "metrics.csv").open()))
    rows = [r for r in every if r.get("reward/mean")]
    rewards = [float(r["reward/mean"]) for r in rows]
    assert len(rewards) == 40
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"reward did not rise: first 5 {first:.3f}, last 5 {last:.3f}"
    assert all(r["data/bad_records_skipped"] == "0.0" for r in rows)
    assert list(run.glob("checkpoints/*.ckpt")), "no checkpoint written"
