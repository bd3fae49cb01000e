"""Complete, atomic checkpoints at the batch boundary, and exact resume.

- ``GRPOCheckpoint`` saves every ``every_n_loop_steps`` collected batches (never per optimizer
  step), beside the resolved config, and keeps the last ``keep_last``.
- Every checkpoint written while it is attached (its own, a ``ModelCheckpoint``'s, a manual
  ``trainer.save_checkpoint``) carries ``checkpoint["grpo"]``: loop progress, accumulator,
  the pi_old probe, the data position / prompt-id counter and every rank's RNG states. Lightning
  adds model, optimizer, LR scheduler, loop counters and the datamodule's state.
- ``AtomicCheckpointIO`` writes to a temp file in the same folder, fsyncs and ``os.replace``s
  it, so a crash mid-save leaves the previous checkpoint intact; it loads with
  ``torch.load(weights_only=True)`` only, so nothing in a checkpoint can execute code.
- ``resolve_ckpt_path("last", trainer)`` is the newest complete checkpoint of the experiment.

See docs/checkpointing.md (what each counter counts, how cadence maps to ``global_step``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from torch import Tensor
from typing_extensions import override

log = logging.getLogger(__name__)

STATE_KEY = "grpo"
FORMAT = 1
_NAME = re.compile(r"^loop-step-(\d+)\.ckpt$")


def checkpoint_name(loop_step: int) -> str:
    return f"loop-step-{loop_step:06d}.ckpt"


def config_path(ckpt: Path) -> Path:
    """The resolved config saved beside ``ckpt`` (``loop-step-000004.config.yaml``)."""
    return ckpt.with_name(ckpt.stem + ".config.yaml")


# -- atomic files ----------------------------------------------------------------------------------------------------
def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """``write(f)`` into a temp file beside ``path``, fsync, then rename over ``path`` (all or nothing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # same folder: the rename never crosses a filesystem
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # data on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power cut
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with a same-folder temp file + ``os.replace``, and ``weights_only=True`` loads.

    Lightning's own ``_atomic_save`` stages through fsspec, which on a local disk writes the temp file
    under ``/tmp`` and moves it: across filesystems that move is a copy, so a crash can leave a torn file.
    Remote (``scheme://``) paths keep Lightning's behaviour.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_write(path, lambda f: torch.save(checkpoint, f))

    @override
    def load_checkpoint(self, path, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is False:
            log.warning("AtomicCheckpointIO loads with weights_only=True only (nothing in a checkpoint may run code)")
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)


# -- RNG states (plain tensors: weights_only-loadable, and gatherable across ranks) ------------------------------
def rng_state() -> dict[str, Tensor]:
    """This process's python, numpy, torch (and its current CUDA device's, if initialized) RNG states as tensors."""
    np_state = np.random.get_state(legacy=False)
    _, py_internal, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy_key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
        "numpy_pos": torch.tensor([np_state["state"]["pos"], np_state["has_gauss"]], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_state["gauss"]], dtype=torch.float64),
        "python": torch.tensor(py_internal, dtype=torch.int64),
        "python_gauss": torch.tensor([math.nan if py_gauss is None else py_gauss], dtype=torch.float64),
    }
    if torch.cuda.is_initialized():  # one device per rank; get_rng_state_all would create a context on every GPU
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Tensor]) -> None:
    """Inverse of ``rng_state``."""
    # Copies: a row of a stacked (or loaded) tensor is a view at a storage offset, which torch.set_rng_state does
    # not handle (it segfaulted on rank 1 of a 2-process gloo check).
    state = {k: v.clone() for k, v in state.items()}
    torch.set_rng_state(state["torch"])
    pos, has_gauss = (int(x) for x in state["numpy_pos"])
    np.random.set_state({"bit_generator": "MT19937", "state": {"key": state["numpy_key"].numpy().astype(np.uint32),
                         "pos": pos}, "has_gauss": has_gauss, "gauss": float(state["numpy_gauss"][0])})
    gauss = float(state["python_gauss"][0])
    random.setstate((3, tuple(int(x) for x in state["python"]), None if math.isnan(gauss) else gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_rng_states(trainer: Trainer) -> list[dict[str, Tensor]]:
    """Every rank's ``rng_state()``, indexed by global rank (a collective: all ranks call it while saving)."""
    mine = rng_state()
    if trainer.world_size == 1:
        return [mine]
    device = trainer.strategy.root_device  # NCCL gathers device tensors only
    stacked = {k: trainer.strategy.all_gather(v.to(device)).cpu() for k, v in mine.items()}  # [W, ...] each
    return [{k: v[r].clone() for k, v in stacked.items()} for r in range(trainer.world_size)]  # own storage each


# -- the GRPO state -------------------------------------------------------------------------------------------------
def capture_state(trainer: Trainer, module: LightningModule) -> dict[str, Any]:
    """What Lightning's checkpoint lacks for an exact resume (plain containers, numbers and tensors only)."""
    state: dict[str, Any] = {"format": FORMAT, "global_step": trainer.global_step, "world_size": trainer.world_size,
                             "rng": gather_rng_states(trainer)}
    loop = getattr(module, "loop", None)
    if loop is not None:
        state["loop_step"] = loop.progress.loop_step
        state["loop_progress"] = loop.progress.state_dict()
        state["accumulator"] = loop.accumulator.state_dict()
    if getattr(module, "old_logprobs", None) is not None:
        state["old_logprobs"] = module.old_logprobs.state_dict()
    dm = trainer.datamodule
    if dm is not None and hasattr(dm, "position"):
        per_step = getattr(dm, "prompts_per_step", None)
        state["data"] = {"position": dm.position, "prompts_per_step": per_step,
                         "next_prompt_id": dm.position * per_step if per_step else None}
    return state


def restore_state(trainer: Trainer, module: LightningModule, state: dict[str, Any]) -> None:
    """Put ``capture_state``'s record back (loop, accumulator, probe, this rank's RNG streams)."""
    loop = getattr(module, "loop", None)
    if loop is not None and "loop_progress" in state:
        loop.progress.load_state_dict(state["loop_progress"])
        loop.accumulator.load_state_dict(state["accumulator"])
    if "old_logprobs" in state and getattr(module, "old_logprobs", None) is not None:
        module.old_logprobs.load_state_dict(state["old_logprobs"])
    rng = state.get("rng", [])
    if len(rng) == trainer.world_size:
        set_rng_state(rng[trainer.global_rank])
    else:
        log.warning("checkpoint holds RNG states of %d ranks but this run has %d: RNG streams are not restored, so "
                    "the continuation is not bit-identical to an uninterrupted run", len(rng), trainer.world_size)


def _check_data_position(trainer: Trainer, state: dict[str, Any]) -> None:
    saved, dm = state.get("data"), trainer.datamodule
    if saved is None or dm is None or not hasattr(dm, "position"):
        return
    if dm.position != saved["position"]:
        raise RuntimeError(
            f"resumed {type(dm).__name__} at position {dm.position} but the checkpoint had consumed {saved['position']} "
            "loop steps of prompts: prompts would be replayed or skipped. Resume with the same datamodule class "
            "(its state is saved under its class name)."
        )


# -- the callback ---------------------------------------------------------------------------------------------------
class GRPOCheckpoint(Checkpoint):
    """Saves a complete checkpoint every ``every_n_loop_steps`` collected batches, atomically, beside its config.

    Cadence is in loop steps (``GRPOModule.loop.progress.loop_step``), whatever ``n_mini`` is.
    Lightning's ``global_step`` counts ``optimizer.step()`` calls: loop steps x n_mini, less every
    window skipped for a non-finite loss, so a ``global_step`` cadence would drift off the batch
    boundary. While attached it also installs ``AtomicCheckpointIO`` (if the strategy uses the
    stock ``TorchCheckpointIO``) and adds the GRPO state to every checkpoint written.

    Args:
        dirpath: folder of the checkpoints; None = ``<trainer.log_dir>/checkpoints`` (one folder per
            run version; ``--ckpt_path last`` searches the versions of the experiment).
        every_n_loop_steps: save after every n-th loop step; 0 = no scheduled saves.
        keep_last: complete checkpoints kept in ``dirpath`` (older ones deleted after a save); 0 = all.
        save_on_train_end: also save when fit ends, unless that loop step was just saved.

    Raises:
        ValueError: a knob out of range (all problems listed at once).

    Example::

        trainer = Trainer(max_steps=100, callbacks=[GRPOCheckpoint(every_n_loop_steps=10, keep_last=3)])
        trainer.fit(GRPOModule(), datamodule=PromptDataModule())  # killed at loop step 57: 50 is the newest
        trainer = Trainer(max_steps=100, callbacks=[GRPOCheckpoint(every_n_loop_steps=10, keep_last=3)])
        trainer.fit(GRPOModule(), datamodule=PromptDataModule(), ckpt_path=resolve_ckpt_path("last", trainer))
    """

    def __init__(self, dirpath: str | None = None, every_n_loop_steps: int = 10, keep_last: int = 2,
                 save_on_train_end: bool = True) -> None:
        problems = []
        if not isinstance(every_n_loop_steps, int) or every_n_loop_steps < 0:
            problems.append(f"every_n_loop_steps={every_n_loop_steps!r}: must be an integer >= 0 (0 = no schedule)")
        if not isinstance(keep_last, int) or keep_last < 0:
            problems.append(f"keep_last={keep_last!r}: must be an integer >= 0 (0 = keep every checkpoint)")
        if problems:
            raise ValueError("GRPOCheckpoint(" + "; ".join(problems) + ")")
        self.every_n_loop_steps, self.keep_last, self.save_on_train_end = every_n_loop_steps, keep_last, save_on_train_end
        self._dirpath_arg = dirpath
        self.dirpath: Path | None = Path(dirpath) if dirpath else None
        self._last_saved: int | None = None
        self._pending: dict[str, Any] | None = None  # GRPO state loaded from a checkpoint, applied at the first batch
        self.last_path: Path | None = None
        """The newest checkpoint this callback wrote."""

    # -- hooks -------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # a custom IO is the user's choice
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if self._dirpath_arg is None:
            self.dirpath = Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.ckpt_path is None and trainer.is_global_zero and complete_checkpoints(self.dirpath):
            log.warning("%s already holds checkpoints of another run; they are pruned and overwritten by this one "
                        "(resume with --ckpt_path last to continue them)", self.dirpath)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # As late as possible before training_step: Lightning draws from the global RNG between on_train_start and
        # the first batch (e.g. the DataLoader iterator's base seed); the uninterrupted run did not at this point.
        if self._pending is not None:
            restore_state(trainer, pl_module, self._pending)
            self._pending = None

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = _loop_step(pl_module)
        if self.every_n_loop_steps and step % self.every_n_loop_steps == 0:
            self.save(trainer, step)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = _loop_step(pl_module)
        if self.save_on_train_end and step > 0 and step != self._last_saved:
            self.save(trainer, step)

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[STATE_KEY] = capture_state(trainer, pl_module)

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(STATE_KEY)
        if state is None:
            log.warning("checkpoint has no %r state (written without GRPOCheckpoint): loop counters, accumulator, "
                        "probe and RNG streams start fresh; the continuation is not exact", STATE_KEY)
            return
        _check_data_position(trainer, state)
        self._pending = state

    # -- saving ------------------------------------------------------------------------------------------------------
    def save(self, trainer: Trainer, loop_step: int) -> Path:
        """Config beside it first, then the checkpoint under a staging name renamed into place, then prune.

        The staging rename covers strategies that bypass ``CheckpointIO`` too (FSDP2's sharded
        folder): a checkpoint name only ever points at a finished save, file or folder.
        """
        path = self.dirpath / checkpoint_name(loop_step)
        staging = path.with_name(f".{path.name}.staging")  # never matches a checkpoint name
        if trainer.is_global_zero:
            text = resolved_config(trainer).encode()
            atomic_write(config_path(path), lambda f: f.write(text))
        try:
            trainer.save_checkpoint(staging, weights_only=False)  # every rank (collectives), then a barrier
        except BaseException:
            if trainer.is_global_zero and not path.exists():
                config_path(path).unlink(missing_ok=True)  # no checkpoint, no config beside it
            raise
        if trainer.is_global_zero:
            if path.is_dir():
                shutil.rmtree(path)  # the same loop step saved again: a folder cannot be renamed over
            os.replace(staging, path)
            _fsync_dir(path.parent)
        self._last_saved, self.last_path = loop_step, path
        if trainer.is_global_zero and self.keep_last:
            for old in complete_checkpoints(self.dirpath)[: -self.keep_last]:
                if old.is_dir():
                    shutil.rmtree(old)
                else:
                    old.unlink(missing_ok=True)
                config_path(old).unlink(missing_ok=True)
        return path


def _loop_step(module: LightningModule) -> int:
    loop = getattr(module, "loop", None)
    if loop is None:
        raise TypeError(f"GRPOCheckpoint counts loop steps through module.loop.progress.loop_step, which "
                        f"{type(module).__name__} lacks (use it with GRPOModule)")
    return loop.progress.loop_step


def resolved_config(trainer: Trainer) -> str:
    """The run's full config as YAML: LightningCLI's parsed config, else the module's config dataclasses."""
    from lightning.pytorch.cli import SaveConfigCallback

    for cb in trainer.callbacks:
        if isinstance(cb, SaveConfigCallback):
            return cb.parser.dump(cb.config, skip_none=False)
    import yaml

    module, out = trainer.lightning_module, {}
    for name in ("policy_cfg", "rl", "optim_cfg", "rollout_cfg", "seed"):
        value = getattr(module, name, None)
        out[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return yaml.safe_dump({"model": out, "trainer": {"max_steps": trainer.max_steps}}, sort_keys=False)


# -- finding checkpoints -------------------------------------------------------------------------------------------
def complete_checkpoints(dirpath: str | os.PathLike | None) -> list[Path]:
    """Complete checkpoints (files, or sharded folders) in ``dirpath``, oldest loop step first.

    Temp and staging names of a torn save start with a dot and never match.
    """
    if dirpath is None or not Path(dirpath).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(dirpath).iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def find_last_checkpoint(dirs: list[str | os.PathLike]) -> Path | None:
    """Newest complete checkpoint (modification time, then loop step) in ``dirs``."""
    found = [p for d in dirs for p in complete_checkpoints(d)]
    return max(found, key=lambda p: (p.stat().st_mtime_ns, int(_NAME.match(p.name).group(1))), default=None)


def search_dirs(trainer: Trainer) -> list[Path]:
    """Where ``last`` looks: each GRPOCheckpoint's explicit dirpath, else ``checkpoints/`` of every run version."""
    explicit = [cb.dirpath for cb in trainer.callbacks if isinstance(cb, GRPOCheckpoint) and cb._dirpath_arg]
    if explicit:
        return explicit
    logger = trainer.logger
    root = Path(getattr(logger, "root_dir", None) or trainer.default_root_dir)
    return [root / "checkpoints", *sorted(root.glob("*/checkpoints"))]


def resolve_ckpt_path(ckpt_path: str | os.PathLike | None, trainer: Trainer) -> str | os.PathLike | None:
    """``"last"`` -> the newest complete checkpoint (None, with a warning, when there is none); else unchanged."""
    if ckpt_path != "last":
        return ckpt_path
    dirs = search_dirs(trainer)
    found = find_last_checkpoint(dirs)
    if found is None:  # like Lightning: "last" may be set before the first run of a job
        log.warning("ckpt_path='last': no complete checkpoint under %s; starting from scratch",
                    ", ".join(str(d) for d in dirs))
        return None
    log.info("ckpt_path='last' resolved to %s", found)
    return str(found)
