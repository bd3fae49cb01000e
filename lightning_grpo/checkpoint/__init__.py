"""Complete, atomic checkpoints at the batch boundary, and exact resume (docs/checkpointing.md).

- ``state.py``: the module's own state (``checkpoint["grpo"]``), written by ``GRPOModule.on_save_checkpoint``
  into every checkpoint Lightning writes, and the per-rank RNG streams.
- ``callback.py``: ``GRPOCheckpoint``, the cadence in loop steps, keep-last and the config beside each file.
- ``atomic.py``: ``AtomicCheckpointIO`` (same-folder temp file + ``os.replace``; ``weights_only=True`` loads).
- ``paths.py``: checkpoint names, which files are complete, pruning, and ``--ckpt_path last``.
"""

from lightning_grpo.checkpoint.atomic import AtomicCheckpointIO, atomic_write
from lightning_grpo.checkpoint.callback import GRPOCheckpoint, resolved_config
from lightning_grpo.checkpoint.paths import (
    checkpoint_name,
    complete_checkpoints,
    config_path,
    find_last_checkpoint,
    resolve_ckpt_path,
)
from lightning_grpo.checkpoint.state import STATE_KEY, LoopState

__all__ = [
    "STATE_KEY",
    "AtomicCheckpointIO",
    "GRPOCheckpoint",
    "LoopState",
    "atomic_write",
    "checkpoint_name",
    "complete_checkpoints",
    "config_path",
    "find_last_checkpoint",
    "resolve_ckpt_path",
    "resolved_config",
]
