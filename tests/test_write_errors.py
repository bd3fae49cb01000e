"""A full disk under a run file (issue 47): the run saves its last batch boundary, stops with a short report naming
the file and the fix, and resumes from that checkpoint.

The writers: completions.jsonl (``CompletionLog``, pointed at /dev/full: every write fails with ENOSPC, as on a
full disk), metrics.csv (Lightning's CSV writer, whose write raises ``OSError(28, ...)`` here), curves.png (drawn
at the end: a failed plot is reported and the finished run kept).
"""

from __future__ import annotations

import csv
import errno
from pathlib import Path

import pytest
import torch
from helpers import fit_tiny, tiny_grpo_module
from lightning.fabric.loggers.csv_logs import _ExperimentWriter
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo.checkpoint import GRPOCheckpoint, checkpoint_name, complete_checkpoints, read_manifest
from lightning_grpo.cli import main
from lightning_grpo.completions import FILE, CompletionLog
from lightning_grpo.errors import RunWriteError, write_failed

SMALL = ["--data.val_size=0", "--model.rl.batch_per_replica=16", "--model.rl.micro_batch_per_replica=16",
         "--trainer.enable_progress_bar=false", "--checkpoint.every_n_loop_steps=0"]


def _steps(folder: Path) -> list[int]:
    with open(folder / "metrics.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("grpo/loss")]


def test_a_full_disk_under_completions_saves_the_boundary_with_its_row_and_resumes(tiny_policy_dir, tmp_path):
    """completions.jsonl failed with a raw OSError and the loop step's metrics row was never written. The failure
    is raised once the row is logged: the emergency checkpoint of that boundary has its row, and the run resumes."""
    folder = tmp_path / "run" / "version_0"
    folder.mkdir(parents=True)
    (folder / FILE).symlink_to("/dev/full")
    saver = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=10)
    logger = CSVLogger(tmp_path, name="run", version=0)
    with pytest.raises(OSError) as failed:
        fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps=3, callbacks=[CompletionLog(), saver],
                 logger=logger, log_every_n_steps=1)
    assert (failed.value.errno, failed.value.filename) == (errno.ENOSPC, str(folder / FILE))
    saved = saver.dirpath / checkpoint_name(1, saver.lineage)
    assert read_manifest(saved).reason == "error:OSError"  # the boundary of loop step 1, where the write failed
    assert torch.load(saved, weights_only=True)["grpo"]["loop_step"] == 1
    assert _steps(folder) == [1]  # its row is there: no checkpoint without its row
    (folder / FILE).unlink()  # room again
    resumed = GRPOCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_loop_steps=10)
    fit_tiny(tiny_grpo_module(tiny_policy_dir), tmp_path, loop_steps=3, callbacks=[CompletionLog(), resumed],
             ckpt_path=saved, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=1)
    assert _steps(tmp_path / "run" / "version_1") == [2, 3]
    assert complete_checkpoints(resumed.dirpath)[-1].name == checkpoint_name(3, saver.lineage)  # the same lineage


def test_write_failed_names_the_file_or_the_folder_and_passes_other_errors(tmp_path):
    class Trainer:  # what write_failed reads of a trainer: its logger folder, callbacks, module
        logger = CSVLogger(tmp_path, name="run", version=0)
        callbacks, default_root_dir, lightning_module = [], str(tmp_path), None

    full = OSError(errno.ENOSPC, "No space left on device")
    report = write_failed(full, Trainer())
    assert isinstance(report, RunWriteError) and report.errno == errno.ENOSPC
    assert str(report).splitlines()[0] == (f"could not write a file of the run folder {tmp_path / 'run' / 'version_0'}: "
                                           "[Errno 28] No space left on device")
    cleanup = RuntimeError("a cleanup that failed after the write")
    cleanup.__context__ = OSError(errno.EFBIG, "File too large", "x/metrics.csv")  # ulimit -f
    assert str(write_failed(cleanup, Trainer())).startswith("could not write x/metrics.csv: [Errno 27] File too large")
    for other in (OSError(errno.ENOENT, "No such file"), ValueError("x"), report):
        assert write_failed(other, Trainer()) is None  # not the disk's, or already reported


@pytest.mark.heavy  # two fits: CI and `make test-integration`
def test_a_full_disk_under_metrics_csv_is_a_short_report_and_the_run_resumes(tiny_policy_dir, tmp_path, monkeypatch,
                                                                            capsys):
    """Through the CLI: metrics.csv's write fails at loop step 2; stderr is the short report (the file's folder, the
    errno's words, the checkpoint), not a traceback; ``--ckpt_path=last`` continues from loop step 2 to the end."""
    from helpers import QUICKSTART_ARGS

    monkeypatch.chdir(tmp_path)
    real_save, calls = _ExperimentWriter.save, []

    def save_fails_at_step_2(writer):
        if any(m.get("step") == 2 and "grpo/loss" in m for m in writer.metrics):
            calls.append(2)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(writer)

    monkeypatch.setattr(_ExperimentWriter, "save", save_fails_at_step_2)
    args = ["fit", *QUICKSTART_ARGS, *SMALL, "--trainer.max_steps=3", "--trainer.val_check_interval=null"]
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    report = err[err.index("lightning-grpo: error:"):].splitlines()
    first = complete_checkpoints(Path("runs/quickstart/version_0/checkpoints"))
    assert stop.value.code == 2 and calls and "Traceback" not in err
    assert report[0] == ("lightning-grpo: error: could not write a file of the run folder runs/quickstart/version_0: "
                         "[Errno 28] No space left on device")
    assert report[1] == f"  the run stopped after loop step 2; its newest checkpoint: {first[-1]}"
    assert "resume with --ckpt_path=last" in report[2] and len(report) <= 5
    assert first[-1].name.startswith(checkpoint_name(2)[:-5])  # the emergency save of the last boundary
    monkeypatch.setattr(_ExperimentWriter, "save", real_save)  # room again
    main([*args, "--ckpt_path=last"])
    assert _steps(Path("runs/quickstart/version_1")) == [3]
