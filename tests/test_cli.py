"""``lightning-grpo fit``: ``--print_config`` round-trips, and every key of the resolved config is logged."""

from __future__ import annotations

import csv

import pytest
import yaml

from lightning_grpo.cli import flatten, main

TIMING = ("grpo/ahead_seconds", "grpo/ahead_share")
"""Wall-clock metrics: the only columns two identical runs may differ in."""


def _rows(csv_path) -> list[dict[str, str]]:
    with open(csv_path, newline="") as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


@pytest.mark.slow
def test_print_config_round_trips(quickstart_run, tmp_path, monkeypatch, capsys):
    """Print the quickstart's resolved config, fit from the printed file: the same run, metric for metric."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["fit", *quickstart_run.argv, "--print_config"])
    assert stop.value.code == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    main(["fit", "--config", str(printed)])
    first, again = _rows(quickstart_run.log_dir / "metrics.csv"), _rows(tmp_path / "runs/quickstart/version_0/metrics.csv")
    assert [r["step"] for r in first if r["reward/mean"]] == ["1", "2"]
    assert again == first  # every logged value, training and validation rows, identical


@pytest.mark.slow
def test_every_config_key_is_logged_as_a_dotted_param(quickstart_run):
    """The CSV logger's hparams.yaml holds the CLI's keys, the names a W&B sweep's parameters use."""
    params = yaml.safe_load((quickstart_run.log_dir / "hparams.yaml").read_text())
    assert params["model.rl.batch_per_replica"] == 64 and params["trainer.max_steps"] == 2
    assert params["data.val_size"] == 16 and params["model.rewards"] == [
        {"name": "arith", "weight": 1.0, "timeout_s": 60.0, "per_sample": False}]


def test_flatten_makes_dotted_keys_and_keeps_lists():
    tree = {"model": {"rl": {"group_size": 8}, "rewards": [{"name": "arith"}]}, "trainer": {"callbacks": None}, "e": {}}
    assert flatten(tree) == {"model.rl.group_size": 8, "model.rewards": [{"name": "arith"}],
                             "trainer.callbacks": None, "e": {}}


# -- a CLI run prints no warning our code causes ------------------------------------------------------------------
NOT_OURS = {
    "`isinstance(treespec, LeafSpec)` is deprecated":
        "Lightning 2.6's CombinedLoader (lightning/pytorch/utilities/_pytree.py) on torch 2.13: every Lightning fit",
}
"""Warnings a quickstart run still prints, none caused by our code: message start -> where it comes from."""

_RECORDING_RUN = """
import json, logging, sys, warnings
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(f"log {record.name}: {record.getMessage()}")
for name in ("", "lightning.pytorch", "lightning.fabric", "lightning_grpo"):
    logging.getLogger(name).addHandler(Keep(logging.WARNING))
out, args, sys.argv = sys.argv[1], sys.argv[2:], sys.argv[:1]
with warnings.catch_warnings(record=True) as caught:  # the default filters: what the run would print
    from lightning_grpo.cli import main
    main(args)
records += [f"{w.category.__name__}: {w.message}" for w in caught]
open(out, "w").write(json.dumps(records))
"""


@pytest.mark.slow
def test_a_quickstart_run_prints_no_warning_our_code_causes(tmp_path):
    """A fresh process (Lightning prints some warnings once per process); every warning it would print and every
    WARNING log record is collected."""
    import json
    import os
    import subprocess
    import sys

    from helpers import QUICKSTART_ARGS

    out = tmp_path / "warnings.json"
    proc = subprocess.run([sys.executable, "-c", _RECORDING_RUN, str(out), "fit", *QUICKSTART_ARGS], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(out.read_text())
    ours = [w for w in printed if not any(w.split(": ", 1)[-1].startswith(m) for m in NOT_OURS)]
    assert ours == [], "\n".join(ours)
    assert (tmp_path / "runs" / "quickstart" / "version_0" / "metrics.csv").is_file()  # the run itself happened
