"""The module's own checkpoint state: what Lightning's checkpoint lacks for an exact resume.

``GRPOModule.on_save_checkpoint`` writes ``checkpoint["grpo"]`` through ``LoopState.record`` and
``on_load_checkpoint`` reads it back, so any checkpoint Lightning writes (``ModelCheckpoint``,
``trainer.save_checkpoint``, ``OnExceptionCheckpoint``, ``GRPOCheckpoint``) resumes exactly.

The record is the state at the last **batch boundary** (the end of a loop step): loop progress,
accumulator and countdown, the pi_old probe, the data position and every rank's RNG streams. A
save that lands inside a loop step (an exception while generating or scoring) records that
boundary too, and writes the datamodule's state as it was there, so the resume draws the
interrupted step's prompts again. Lightning adds model, optimizer, LR scheduler, its loop
counters and the datamodule's ``state_dict``.
Everything here is plain ints, floats, dicts and tensors: ``weights_only=True`` loads it.
"""

from __future__ import annotations

import copy
import logging
import math
import random
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from lightning.pytorch import Trainer
from torch import Tensor

log = logging.getLogger(__name__)

STATE_KEY = "grpo"
FORMAT = 1


@runtime_checkable
class StreamPosition(Protocol):
    """A datamodule whose stream position can be read, and its state at an earlier position given (PromptDataModule)."""

    @property
    def position(self) -> int:
        """Loop steps of prompts drawn."""
        ...

    def state_dict_at(self, position: int) -> dict[str, Any]:
        """``state_dict()`` as it was when ``position`` loop steps had been drawn."""
        ...


# -- RNG states (plain tensors: weights_only-loadable, and gatherable across ranks) ------------------------------
def rng_state() -> dict[str, Tensor]:
    """This process's python, numpy, torch (and its current CUDA device's, if initialized) RNG states as tensors."""
    np_state = np.random.get_state(legacy=False)
    _, py_internal, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy_key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
        "numpy_pos": torch.tensor(
            [np_state["state"]["pos"], np_state["has_gauss"]], dtype=torch.int64
        ),
        "numpy_gauss": torch.tensor([np_state["gauss"]], dtype=torch.float64),
        "python": torch.tensor(py_internal, dtype=torch.int64),
        "python_gauss": torch.tensor(
            [math.nan if py_gauss is None else py_gauss], dtype=torch.float64
        ),
    }
    # one device per rank; get_rng_state_all would create a context on every GPU
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Tensor]) -> None:
    """Inverse of ``rng_state``."""
    # Copies: a row of a stacked (or loaded) tensor is a view at a storage offset, which torch.set_rng_state does
    # not handle (it segfaulted on rank 1 of a 2-process gloo check).
    state = {k: v.clone() for k, v in state.items()}
    torch.set_rng_state(state["torch"])
    pos, has_gauss = (int(x) for x in state["numpy_pos"])
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": state["numpy_key"].numpy().astype(np.uint32), "pos": pos},
            "has_gauss": has_gauss,
            "gauss": float(state["numpy_gauss"][0]),
        }
    )
    gauss = float(state["python_gauss"][0])
    random.setstate(
        (
            3,
            tuple(int(x) for x in state["python"]),
            None if math.isnan(gauss) else gauss,
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_rng_states(
    trainer: Trainer, mine: dict[str, Tensor] | None = None
) -> list[dict[str, Tensor]]:
    """Every rank's ``rng_state()`` (or ``mine``), indexed by global rank (a collective: all ranks call it)."""
    mine = rng_state() if mine is None else mine
    if trainer.world_size == 1:
        return [mine]
    device = trainer.strategy.root_device  # NCCL gathers device tensors only
    per_key = {
        k: _all_gather(v.to(device), trainer.world_size) for k, v in mine.items()
    }
    return [
        {k: parts[r].cpu() for k, parts in per_key.items()}
        for r in range(trainer.world_size)
    ]


def _all_gather(tensor: Tensor, world_size: int) -> list[Tensor]:
    """``torch.distributed.all_gather``: Lightning's ``strategy.all_gather`` goes through the deprecated
    ``torch.distributed.nn.functional.all_gather`` on torch 2.13 and warns at every save."""
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    torch.distributed.all_gather(parts, tensor)
    return parts


# -- parameters fit to save ---------------------------------------------------------------------------------------
class NonFiniteParametersError(RuntimeError):
    """A checkpoint would hold parameters with NaN/inf: nothing resumes from those."""

    def __init__(self, parameter: str, message: str | None = None) -> None:
        super().__init__(
            message
            or f"refusing to write a checkpoint: parameter {parameter!r} holds NaN/inf (the "
            "last finite weights are in the newest earlier checkpoint; resume from it with a lower "
            "optim.lr)"
        )
        self.parameter = parameter

    @classmethod
    def loading(cls, refused: str) -> NonFiniteParametersError:
        """Loading a checkpoint that was written without its weights because they held NaN/inf."""
        return cls(
            "",
            f"this checkpoint holds no weights, they were refused when it was written: {refused}",
        )


def nonfinite_parameter(trainer: Trainer) -> str | None:
    """Name of a parameter holding NaN/inf on any rank (FSDP2 shards differ: a collective under DP), else None."""
    named = list(trainer.lightning_module.named_parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for _, p in named]
    # 1-based index of the first non-finite parameter; one host sync for all of them
    bad = 0
    if local:
        device = local[0].device
        finite = torch.stack(
            [torch.isfinite(t.detach()).all().to(device) for t in local]
        )
        bad = 0 if bool(finite.all()) else int((~finite).nonzero()[0]) + 1
    if trainer.world_size > 1:
        flag = torch.tensor(
            float(bad or len(named) + 1), device=trainer.strategy.root_device
        )
        bad = int(trainer.strategy.reduce(flag, reduce_op="min"))
        bad = 0 if bad == len(named) + 1 else bad
    return named[bad - 1][0] if bad else None


def trained_loop_step(trainer: Trainer) -> int:
    """The trained module's ``loop_step`` (``UpdateModule``'s), refused for a module that does not count them."""
    module = trainer.lightning_module
    step = getattr(module, "loop_step", None)
    if not isinstance(step, int):
        raise TypeError(
            f"GRPOCheckpoint counts loop steps through module.loop_step, which {type(module).__name__} "
            "lacks (use it with GRPOModule)"
        )
    return step


# -- the module's state at the batch boundary ---------------------------------------------------------------------
class LoopState:
    """Keeps the module's state at the last batch boundary, writes it into checkpoints, and puts a loaded one back.

    The module calls ``boundary`` at the start of fit and at the end of every loop step,
    ``step_started`` right before each ``training_step`` (it also restores a loaded RNG state there: Lightning
    draws from the global RNG between ``on_train_start`` and the first batch, where an uninterrupted run did
    not), ``record`` from ``on_save_checkpoint``, ``load`` from ``on_load_checkpoint`` and ``resume`` once the
    loop exists (``on_train_start``).
    """

    def __init__(self) -> None:
        # the record at the last boundary, without RNG
        self._boundary: dict[str, Any] | None = None
        # set while a loop step is in flight
        self._rng_at_step_start: dict[str, Tensor] | None = None
        # read from a checkpoint, not yet put back
        self._loaded: dict[str, Any] | None = None
        self._rng_to_restore: dict[str, Tensor] | None = None

    def boundary(self, updater, global_step: int, datamodule) -> None:
        """Record the state now: a loop step just ended (or fit starts)."""
        data = None
        if isinstance(datamodule, StreamPosition):
            per_step = getattr(datamodule, "prompts_per_step", None)
            data = {
                "position": datamodule.position,
                "prompts_per_step": per_step,
                "next_prompt_id": datamodule.position * per_step if per_step else None,
            }
        # The updater's own state_dict (loop progress, accumulator, probe): the keys the format has always had.
        self._boundary = copy.deepcopy(
            {
                "loop_step": updater.loop_step,
                **updater.state_dict(),
                "global_step": global_step,
                "data": data,
            }
        )
        self._rng_at_step_start = None

    def at_boundary(self, global_step: int) -> bool:
        """Whether parameters and optimizer are still those of the last boundary (no optimizer step since)."""
        return (
            self._boundary is not None and self._boundary["global_step"] == global_step
        )

    def step_started(self) -> None:
        """A loop step begins: restore a loaded RNG state (once), then remember the streams as they are now."""
        if self._rng_to_restore is not None:
            set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None
        self._rng_at_step_start = rng_state()

    def write(self, trainer: Trainer, checkpoint: dict[str, Any]) -> None:
        """Add ``checkpoint["grpo"]``; a save inside a loop step also gets the datamodule's state at the boundary."""
        state = self.record(trainer)
        if state is None:
            return
        checkpoint[STATE_KEY] = state
        datamodule = trainer.datamodule
        data = state["data"]
        key = type(datamodule).__qualname__
        drawn_ahead = (
            isinstance(datamodule, StreamPosition)
            and data is not None
            and key in checkpoint
        )
        # drawn, not trained on: the resume redraws them
        if drawn_ahead and datamodule.position != data["position"]:
            checkpoint[key] = datamodule.state_dict_at(data["position"])

    def record(self, trainer: Trainer) -> dict[str, Any] | None:
        """``checkpoint["grpo"]``: the boundary state plus every rank's RNG (a collective under DP)."""
        if self._boundary is None:
            # saved before training started: pass a loaded state on unchanged
            return copy.deepcopy(self._loaded)
        in_flight = self._rng_at_step_start is not None
        if in_flight and trainer.global_step != self._boundary["global_step"]:
            log.warning(
                "checkpoint written inside loop step %d after %d of its optimizer steps: it records the "
                "state before that loop step, but parameters and optimizer state have already moved, so "
                "a resume from it repeats the loop step on moved weights (not exact)",
                self._boundary["loop_step"] + 1,
                trainer.global_step - self._boundary["global_step"],
            )
        # None: the streams as they are now
        mine = self._rng_at_step_start if in_flight else self._rng_to_restore
        rng = gather_rng_states(trainer, mine)
        return {
            "format": FORMAT,
            "world_size": trainer.world_size,
            **copy.deepcopy(self._boundary),
            "rng": rng,
        }

    def load(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(STATE_KEY)
        if state is None:
            log.warning(
                "checkpoint has no %r state (written by an older version or another module): loop counters, "
                "accumulator, probe and RNG streams start fresh; the continuation is not exact",
                STATE_KEY,
            )
        self._loaded = state

    @property
    def pending_loop_step(self) -> int | None:
        """The loop step of a loaded checkpoint not yet put back: under ``validate``, and in a resumed fit before
        ``on_train_start`` (its sanity check); None otherwise."""
        return None if self._loaded is None else int(self._loaded.get("loop_step", 0))

    def resume(self, trainer: Trainer, updater, datamodule) -> None:
        """Put a loaded state back into the fresh updater; check the datamodule resumed at the boundary."""
        state = self._loaded
        self._loaded = None
        if state is None:
            return
        updater.load_state_dict(state)
        _check_data_position(datamodule, state.get("data"))
        rng = state.get("rng", [])
        if len(rng) == trainer.world_size:
            self._rng_to_restore = rng[trainer.global_rank]
        else:
            log.warning(
                "checkpoint holds RNG states of %d ranks but this run has %d: RNG streams are not restored, "
                "so the continuation is not bit-identical to an uninterrupted run",
                len(rng),
                trainer.world_size,
            )


def _check_data_position(datamodule, saved: dict[str, Any] | None) -> None:
    if saved is None or not isinstance(datamodule, StreamPosition):
        return
    at = datamodule.position
    boundary = saved["position"]
    if at != boundary:
        raise RuntimeError(
            f"resumed {type(datamodule).__name__} at position {at} but the checkpoint had consumed {boundary} "
            "loop steps of prompts: prompts would be replayed or skipped. Resume with the same datamodule class "
            "(its state is saved under its class name)."
        )
