"""``AtomicCheckpointIO``: Lightning's checkpoint IO with atomic writes and verified, code-free loads.

- Saves go through ``atomic.atomic_write`` (same-folder temp file + ``os.replace``), which also records
  each file's SHA-256 and size for the manifest ``GRPOCheckpoint`` writes beside it.
- Loads use ``torch.load(weights_only=True)`` whatever the caller asks, after verifying the file against
  its manifest (``integrity.py``); a damaged file names the previous checkpoint of its run (``paths.py``).
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from typing_extensions import override

from lightning_grpo.checkpoint.atomic import atomic_write
from lightning_grpo.checkpoint.integrity import (
    DamagedCheckpointError,
    check_intact,
    digest,
    read_manifest,
)
from lightning_grpo.checkpoint.paths import previous_checkpoint

log = logging.getLogger(__name__)


def _as_stored(storage: Any, location: str) -> Any:
    """``map_location`` that keeps each storage where it was saved (Lightning's default)."""
    return storage


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with a same-folder temp file + ``os.replace``, and ``weights_only=True`` loads.

    Lightning's own ``_atomic_save`` stages through fsspec, which on a local disk writes the temp file
    under ``/tmp`` and moves it: across filesystems that move is a copy, so a crash can leave a torn file.
    Remote (``scheme://``) paths keep Lightning's behaviour.
    """

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, tuple[str, int]] = {}
        """SHA-256 and size of each file this IO wrote, by path (read by GRPOCheckpoint for the manifest)."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        self.written[str(path)] = atomic_write(
            path, functools.partial(torch.save, checkpoint)
        )

    @override
    def load_checkpoint(
        self,
        path,
        map_location: Any = _as_stored,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if weights_only is False:
            log.warning(
                "AtomicCheckpointIO loads with weights_only=True only (nothing in a checkpoint may run code)"
            )
        # a missing file: Lightning's own "not found" error
        local = "://" not in str(path) and Path(path).exists()
        if local:
            check_intact(Path(path), previous_checkpoint(Path(path)))
        checkpoint = super().load_checkpoint(
            path, map_location=map_location, weights_only=True
        )
        if local and not Path(path).is_dir() and read_manifest(Path(path)) is None:
            check_values(checkpoint, Path(path))
        return checkpoint


def save_digest(checkpoint_io: object, path: Path) -> tuple[str, int]:
    """SHA-256 and size of a finished save: recorded by ``AtomicCheckpointIO`` while writing, else read back."""
    recorded = getattr(checkpoint_io, "written", {}).pop(str(path), None)
    return recorded if recorded is not None else digest(path)


IMPLAUSIBLE = 1e30
"""No weight or optimizer moment of a trainable model gets near this; a flipped exponent bit lands beyond it."""


def check_values(checkpoint: dict[str, Any], path: Path) -> None:
    """A checkpoint without a manifest (no hash to verify): refuse NaN/inf or implausible values in its weights and
    optimizer state, the marks a flipped byte leaves in a float; warn that it is otherwise unverified."""
    tensors = [
        (f"state_dict[{k!r}]", v)
        for k, v in (checkpoint.get("state_dict") or {}).items()
    ]
    for i, opt in enumerate(checkpoint.get("optimizer_states") or []):
        for pid, state in (opt.get("state") or {}).items():
            tensors += [
                (f"optimizer_states[{i}] param {pid} {k!r}", v)
                for k, v in state.items()
            ]
    for name, t in tensors:
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()):
            continue
        worst = float(t.detach().abs().max())
        if not math.isfinite(worst) or worst > IMPLAUSIBLE:
            raise DamagedCheckpointError(
                f"checkpoint {path} has no manifest to verify it, and {name} holds {worst:.3g} (NaN/inf or beyond "
                f"{IMPLAUSIBLE:g}: a damaged file). Resume from an intact checkpoint of the run"
            )
    log.warning(
        "checkpoint %s has no manifest (not written by GRPOCheckpoint, or its manifest was lost): its bytes are "
        "unverified; its weights and optimizer state are finite",
        path,
    )
