"""A new fit never writes into a run folder that already holds a run, unless told to.

``--trainer.logger.init_args.version=0`` names a folder; when ``version_0`` already holds a run, Lightning's
CSVLogger warns that "previous log files will be deleted" and a new fit overwrites its metrics.csv, config.yaml and
curves.png and mixes its checkpoints with the old run's. ``refuse_reused_version`` stops that before the fit writes
anything: a resume (``--ckpt_path``) continues its run there, ``--overwrite_run=true`` says the old run may go, and
without an explicit version the logger makes a fresh ``version_N`` as always.

A ``WandbLogger`` has no version folders: ``trainer.log_dir`` is its ``save_dir``, so two W&B runs (two trials of a
sweep) wrote completions.jsonl, config.yaml, curves.png and checkpoints into one folder. ``version_wandb_logger``
gives each such run a ``version_N`` folder of its own, claimed like the CSV logger's (``claim_folder``).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

RUN_FILES = (
    "metrics.csv",
    "config.yaml",
    "hparams.yaml",
    "checkpoints",
    "completions.jsonl",
    "curves.png",
)
"""What a run leaves in its folder."""


class RunFolderInUseError(ValueError):
    """A new fit was pointed at a run folder that already holds a run."""


def refuse_reused_version(
    loggers, explicit_version: bool, resuming: bool, overwrite: bool
) -> None:
    """Raise ``RunFolderInUseError`` when a logger's explicitly chosen folder already holds a run.

    Args:
        loggers: the trainer's loggers (only CSV and TensorBoard loggers number their folders).
        explicit_version: the config set ``trainer.logger.init_args.version`` (else the logger picks a new one).
        resuming: ``--ckpt_path`` is given: the run continues in its own folder.
        overwrite: ``--overwrite_run=true``.
    """
    if not explicit_version or resuming or overwrite:
        return
    for logger in loggers:
        if not isinstance(logger, (CSVLogger, TensorBoardLogger)):
            continue
        folder = Path(logger.log_dir)
        held = [name for name in RUN_FILES if (folder / name).exists()]
        if held:
            raise RunFolderInUseError(
                f"trainer.logger version={logger.version!r}: {folder} already holds a run ({', '.join(held)}); a new "
                "fit would overwrite it. Drop the version (a new version_N is made), choose another, resume that run "
                "with --ckpt_path, or pass --overwrite_run=true to replace it"
            )


def explicit_version(logger_config) -> bool:
    """Whether the CLI's ``trainer.logger`` config (one logger or a list) sets ``init_args.version``."""
    configs = logger_config if isinstance(logger_config, list) else [logger_config]
    return any(
        getattr(getattr(c, "init_args", None), "version", None) is not None
        for c in configs
    )


VERSIONS_LOCK = ".versions.lock"


def claim_versions(loggers) -> None:
    """Give each CSV/TensorBoard logger its own ``version_N`` folder, created now under a lock on the experiment.

    Two runs started at once in one ``save_dir`` would both pick the next free ``version_N`` (the logger picks it by
    listing the folders) and write their config.yaml, metrics and checkpoints into one folder. The pick and the
    ``mkdir`` happen under an exclusive ``flock`` of ``<save_dir>/<name>/.versions.lock``, so the second run sees the
    first one's folder and takes the next number. An explicit version is left as chosen (``refuse_reused_version``).
    """
    for logger in loggers:
        if not isinstance(logger, (CSVLogger, TensorBoardLogger)):
            continue
        root = Path(logger.root_dir)
        root.mkdir(parents=True, exist_ok=True)
        with _flocked(root / VERSIONS_LOCK):
            # log_dir resolves the version (a fresh pick)
            Path(logger.log_dir).mkdir(parents=True, exist_ok=True)


def claim_folder(root: str | os.PathLike) -> Path:
    """Create and return ``<root>/version_N``, N one past the highest there, under the lock CSV loggers pick with."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with _flocked(root / VERSIONS_LOCK):
        taken = [
            int(p.name[8:])
            for p in root.glob("version_*")
            if p.name[8:].isdigit() and p.is_dir()
        ]
        folder = root / f"version_{max(taken, default=-1) + 1}"
        folder.mkdir()
    return folder


def version_wandb_logger(
    logger_config, first_process: bool | None = None
) -> Path | None:
    """Point a ``WandbLogger`` config's ``save_dir`` at a new ``<save_dir>/<name>/version_N`` (in place); returns
    ``<save_dir>/<name>``, the folder of every version of the experiment, on every rank (None without a W&B logger):
    ``--ckpt_path last`` searches its versions' checkpoints.

    Everything that writes under ``trainer.log_dir`` (config.yaml, completions.jsonl, curves.png, checkpoints, and
    W&B's own ``wandb/`` files) then lands in a folder of this run only. Only the first listed logger gives
    ``trainer.log_dir``. Other ranks keep the config as is: ``trainer.log_dir`` is rank 0's (a broadcast), and a
    second claim would leave an empty folder.

    Args:
        logger_config: the CLI's ``trainer.logger`` (a class_path/init_args namespace, a list of them, or a bool).
        first_process: this process is global rank 0; None = Lightning's ``rank_zero_only.rank == 0`` (read from
            the launcher's environment: the Trainer does not exist yet).
    """
    first_process = rank_zero_only.rank == 0 if first_process is None else first_process
    first = (
        logger_config[0]
        if isinstance(logger_config, list) and logger_config
        else logger_config
    )
    init = getattr(first, "init_args", None)
    if init is None or not _is_wandb(getattr(first, "class_path", "")):
        return None
    save_dir = getattr(init, "save_dir", None) or "."
    name = getattr(init, "name", None) or "lightning_logs"
    experiment = Path(save_dir) / name
    if first_process:
        init.save_dir = str(claim_folder(experiment))
    return experiment


def _is_wandb(class_path: str) -> bool:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except ImportError:
        return False
    return isinstance(cls, type) and issubclass(cls, WandbLogger)


@contextlib.contextmanager
def _flocked(path: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        # blocks while another run picks its version (milliseconds)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock
