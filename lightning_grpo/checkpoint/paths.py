"""Checkpoint files on disk: their names, which are complete, which run owns them, where ``last`` looks, pruning.

Every rule about which files a run reads or deletes lives here. A name only ever points at a
finished save: torn writes and staging saves start with a dot and never match ``loop-step-<N>...``.

Ownership: each fit has a run id, and each chain of fits a **lineage** id (the first fit's run id,
inherited by every resume). A checkpoint's name carries its lineage
(``loop-step-000020-1a2b3c4d.ckpt``) and its manifest (``integrity.py``) both ids. A run prunes only
its own lineage's files, and ``last`` resumes the latest lineage of the folder (or the run's own),
falling back past damaged files (``resolve_last``; which folders a trainer searches is ``resume.py``'s).
Names without a lineage (``loop-step-000020.ckpt``) are from before ownership existed: they form one
lineage of their own, never pruned by a newer run.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from lightning_grpo.checkpoint.atomic import fsync_dir
from lightning_grpo.checkpoint.integrity import (
    DamagedCheckpointError,
    Manifest,
    manifest_path,
    problem,
    read_manifest,
)

log = logging.getLogger(__name__)

_NAME = re.compile(r"^loop-step-(\d+)(?:-([0-9a-f]{8}))?\.ckpt$")
LATEST = "latest"
"""``lineage=LATEST``: the lineage whose checkpoint was saved last (lineage ids are 8 hex digits, never this)."""


def checkpoint_name(loop_step: int, lineage: str | None = None) -> str:
    """``loop-step-000020-<lineage>.ckpt`` (without a lineage: the name written before run ownership existed)."""
    return f"loop-step-{loop_step:06d}" + (f"-{lineage}" if lineage else "") + ".ckpt"


def loop_step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def staging_path(path: Path) -> Path:
    """Where a save of ``path`` is written before it is renamed into place (never matches a checkpoint name)."""
    return path.with_name(f".{path.name}.staging")


def config_path(ckpt: Path) -> Path:
    """The resolved config saved beside ``ckpt`` (``loop-step-000004-<lineage>.config.yaml``)."""
    return ckpt.with_name(ckpt.stem + ".config.yaml")


def adapter_path(ckpt: Path) -> Path:
    """The LoRA adapter saved beside ``ckpt`` in peft's format (``loop-step-000004.adapter/``)."""
    return ckpt.with_name(ckpt.stem + ".adapter")


def publish(staging: Path, path: Path) -> None:
    """Rename a finished save (file or sharded folder) into place; the same loop step saved again replaces it."""
    if path.is_dir():
        shutil.rmtree(path)  # a folder cannot be renamed over
    os.replace(staging, path)
    fsync_dir(path.parent)


def complete_checkpoints(dirpath: str | os.PathLike | None) -> list[Path]:
    """Complete checkpoints (files, or sharded folders) in ``dirpath``, of every lineage, oldest loop step first."""
    if dirpath is None or not Path(dirpath).is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in Path(dirpath).iterdir()
        if (m := _NAME.match(p.name))
    ]
    return [p for _, p in sorted(found)]


@dataclass(frozen=True)
class Entry:
    """One complete checkpoint and who wrote it."""

    path: Path
    loop_step: int
    lineage: str | None
    """None: written before run ownership existed (no id in its name)."""
    saved_at: int
    """The manifest's save time (ns); the file's modification time without one."""
    manifest: Manifest | None


def entries(dirs: list[str | os.PathLike]) -> list[Entry]:
    """Every complete checkpoint in ``dirs``, oldest save first."""
    out = []
    for path in (p for d in dirs for p in complete_checkpoints(d)):
        try:
            manifest = read_manifest(path)
        except DamagedCheckpointError:
            # a torn manifest: ``problem`` reports it when the file is chosen
            manifest = None
        m = _NAME.match(path.name)
        saved_at = (
            manifest.saved_at if manifest is not None else path.stat().st_mtime_ns
        )
        out.append(Entry(path, int(m.group(1)), m.group(2), saved_at, manifest))
    return sorted(out, key=lambda e: (e.saved_at, e.loop_step))


def lineage_entries(
    dirs: list[str | os.PathLike], lineage: str | None = LATEST
) -> list[Entry]:
    """The checkpoints of ``lineage`` (None: those without an id), newest save first."""
    found = entries(dirs)
    if not found:
        return []
    if lineage == LATEST:
        lineage = found[-1].lineage
    return [e for e in reversed(found) if e.lineage == lineage]


def prune(dirpath: Path, keep_last: int, lineage: str) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints of ``lineage`` in ``dirpath`` (with config and manifest).

    Files of other lineages are never touched: another run's checkpoints are not this run's to delete.
    """
    if not keep_last:
        return []
    old = [e.path for e in lineage_entries([dirpath], lineage)[keep_last:]]
    for path in old:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        config_path(path).unlink(missing_ok=True)
        manifest_path(path).unlink(missing_ok=True)
        shutil.rmtree(adapter_path(path), ignore_errors=True)
    return old


def previous_checkpoint(ckpt: Path) -> Path | None:
    """The checkpoint of the same lineage in the same folder saved before ``ckpt`` (what to use when it is damaged)."""
    m = _NAME.match(ckpt.name)
    if m is None:
        return None
    chain = [e.path for e in lineage_entries([ckpt.parent], m.group(2))]
    later = chain.index(ckpt) + 1 if ckpt in chain else 0
    return chain[later] if later < len(chain) else None


def find_last_checkpoint(
    dirs: list[str | os.PathLike], lineage: str | None = LATEST
) -> Path | None:
    """Newest checkpoint of ``lineage`` (default: the latest lineage) in ``dirs``, without checking its bytes."""
    chain = lineage_entries(dirs, lineage)
    return chain[0].path if chain else None


def resolve_last(
    dirs: list[str | os.PathLike], lineage: str | None = LATEST
) -> Entry | None:
    """The newest intact checkpoint of ``lineage`` (default: the latest lineage), falling back past damaged ones.

    Each fallback is logged with the reason. Raises ``DamagedCheckpointError`` when every checkpoint of the
    lineage is damaged: resuming another run's checkpoint instead would be the wrong run.
    """
    chain = lineage_entries(dirs, lineage)
    damaged = []
    for entry in chain:
        why = problem(entry.path)
        if why is None:
            return entry
        damaged.append(f"{entry.path} {why}")
        log.warning(
            "ckpt_path='last': checkpoint %s %s; falling back to the previous checkpoint of run %s",
            entry.path,
            why,
            entry.lineage or "(no id)",
        )
    if damaged:
        raise DamagedCheckpointError(
            "ckpt_path='last': every checkpoint of the latest run is damaged:\n  "
            + "\n  ".join(damaged)
            + "\npass --ckpt_path <file> to resume another one"
        )
    return None
