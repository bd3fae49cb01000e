"""A new fit on an explicit logger version that already holds a run is refused, unless --overwrite_run=true."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import QUICKSTART_ARGS

from lightning_grpo.cli import main

SMALL = ["--trainer.max_steps=1", "--data.val_size=0", "--model.rl.batch_per_replica=16",
         "--model.rl.micro_batch_per_replica=16", "--trainer.enable_progress_bar=false",
         "--trainer.logger.init_args.version=0"]


@pytest.mark.slow
def test_reusing_a_version_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["fit", *QUICKSTART_ARGS, *SMALL])
    folder = tmp_path / "runs" / "quickstart" / "version_0"
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(["fit", *QUICKSTART_ARGS, *SMALL, "--seed_everything=3"])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert "version=0: runs/quickstart/version_0 already holds a run (metrics.csv, config.yaml" in err
    assert "--overwrite_run=true" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before  # untouched, no error.log
    main(["fit", *QUICKSTART_ARGS, *SMALL, "--seed_everything=3", "--overwrite_run=true"])
    assert "seed_everything: 3" in (folder / "config.yaml").read_text()  # replaced, as asked


def test_two_runs_starting_at_once_in_one_save_dir_get_two_version_folders(tmp_path):
    """Fault 4: both runs picked version_0 (the next free number) and the second one's config.yaml replaced the
    first one's. The pick and the mkdir now happen under one lock: a run that picks while another is picking waits
    for it and takes the next number."""
    import threading
    import time

    from lightning.pytorch.loggers import CSVLogger

    from lightning_grpo.run_folder import VERSIONS_LOCK, _flocked, claim_versions

    first, second = CSVLogger(tmp_path, name="exp"), CSVLogger(tmp_path, name="exp")
    (tmp_path / "exp").mkdir()
    picked = {}
    with _flocked(tmp_path / "exp" / VERSIONS_LOCK):  # the first run, between its pick and its mkdir
        other = threading.Thread(target=lambda: (claim_versions([second]), picked.setdefault("second", second.version)))
        other.start()
        time.sleep(0.3)
        assert "second" not in picked  # waiting for the lock, not picking version_0 beside the first run
        assert first.version == 0
        Path(first.log_dir).mkdir()
    other.join(timeout=10)
    assert picked == {"second": 1} and Path(second.log_dir).is_dir()


def _logger(class_path: str, **init_args):
    from jsonargparse import Namespace

    return Namespace(class_path=class_path, init_args=Namespace(**init_args))


def test_each_wandb_run_claims_a_version_folder_of_its_own(tmp_path):
    """Issue 47: a WandbLogger has no version folders, so trainer.log_dir was its save_dir for every run and two sweep
    trials wrote one completions.jsonl and config.yaml. Each run now gets <save_dir>/<name>/version_N, numbered with
    the CSV runs of that experiment (one lock)."""
    from lightning_grpo.run_folder import version_wandb_logger

    (tmp_path / "quickstart" / "version_0").mkdir(parents=True)  # a CSV run of the same experiment
    first = _logger("lightning.pytorch.loggers.WandbLogger", save_dir=str(tmp_path), name="quickstart")
    second = [_logger("lightning.pytorch.loggers.WandbLogger", save_dir=str(tmp_path), name="quickstart"),
              _logger("lightning.pytorch.loggers.CSVLogger", save_dir=str(tmp_path))]  # the first logger gives log_dir
    assert version_wandb_logger(first, first_process=True) == tmp_path / "quickstart"  # every version's folder
    version_wandb_logger(second, first_process=True)
    assert first.init_args.save_dir == str(tmp_path / "quickstart" / "version_1")
    assert second[0].init_args.save_dir == str(tmp_path / "quickstart" / "version_2")
    assert second[1].init_args.save_dir == str(tmp_path)  # a CSV logger numbers its own folders
    assert (tmp_path / "quickstart" / "version_2").is_dir()


def test_other_ranks_and_versioned_loggers_keep_their_config(tmp_path):
    from lightning_grpo.run_folder import version_wandb_logger

    other_rank = _logger("lightning.pytorch.loggers.WandbLogger", save_dir=str(tmp_path), name="x")
    # trainer.log_dir is rank 0's (a broadcast); the experiment's folder is every rank's (--ckpt_path last)
    assert version_wandb_logger(other_rank, first_process=False) == tmp_path / "x"
    csv = _logger("lightning.pytorch.loggers.CSVLogger", save_dir=str(tmp_path), name="x")
    assert version_wandb_logger(csv, first_process=True) is None
    assert version_wandb_logger(False, first_process=True) is None  # --trainer.logger=false
    assert other_rank.init_args.save_dir == csv.init_args.save_dir == str(tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.heavy  # two CLI fits: CI and `make test-integration`
def test_a_wandb_run_resumes_with_ckpt_path_last_from_its_experiments_last_version(tmp_path, monkeypatch, capsys):
    """A W&B run's checkpoints live in its own <save_dir>/<name>/version_N (version_wandb_logger); `--ckpt_path last`
    looked under the working folder only, found nothing and started from scratch. It now searches every version of
    the experiment and resumes the newest intact checkpoint of the latest run."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb = ["--trainer.logger=lightning.pytorch.loggers.WandbLogger", "--trainer.logger.init_args.save_dir=runs",
             "--trainer.logger.init_args.name=qs", "--trainer.logger.init_args.offline=true"]
    small = [arg for arg in SMALL if "logger" not in arg]
    main(["fit", *QUICKSTART_ARGS, *small, *wandb])
    [first] = (tmp_path / "runs" / "qs" / "version_0" / "checkpoints").glob("*.ckpt")
    capsys.readouterr()
    main(["fit", *QUICKSTART_ARGS, *small, *wandb, "--trainer.max_steps=2", "--ckpt_path=last"])
    out = capsys.readouterr().out
    assert "runs/qs/version_1  (loop steps 2-2; loop steps 1-1: runs/qs/version_0)" in out  # the summary's lineage
    [second] = (tmp_path / "runs" / "qs" / "version_1" / "checkpoints").glob("*.ckpt")
    assert second.name == first.name.replace("loop-step-000001-", "loop-step-000002-")  # the same run, one step on
