"""Complete, atomic checkpoints at the batch boundary, owned by their run, and exact resume (docs/checkpointing.md).

- ``state.py``: the module's own state (``checkpoint["grpo"]``), written by ``GRPOModule.on_save_checkpoint``
  into every checkpoint Lightning writes, and the per-rank RNG streams; parameters with NaN/inf are never saved.
- ``callback.py``: ``GRPOCheckpoint``, the cadence in loop steps, keep-last of the run's own files, the config
  beside each file, published after the loop step's metrics row, the emergency save on SIGTERM / SIGUSR1
  and on a failure before the update stepped.
- ``staging.py``: a save under a staging name, published (manifest, rename, prune) after the step's row.
- ``beside.py``: what travels beside each checkpoint (the resolved config, a LoRA policy's adapter).
- ``emergency.py``: when a run failing inside a loop step may save the batch boundary it left.
- ``atomic.py``: ``atomic_write`` (same-folder temp file + ``os.replace``; a full disk says so, naming the file).
- ``checkpoint_io.py``: ``AtomicCheckpointIO`` (Lightning's checkpoint IO writing through ``atomic_write``;
  ``weights_only=True`` loads, verified against the manifest).
- ``paths.py``: checkpoint names, lineages (which run owns a file), pruning, the newest intact file of a lineage.
- ``resume.py``: ``--ckpt_path last`` (``resolve_ckpt_path``: which folders a trainer searches, which file it resumes).
- ``integrity.py``: the manifest beside each checkpoint (run ids, SHA-256) and its verification.
- ``lock.py``: one live run per checkpoint folder.
- ``revalidate.py``: a validation cut short runs again when the run resumes (the manifest's ``validation``).
- ``signals.py``: SIGTERM / SIGUSR1 recorded, acted on at the next safe point, Lightning's handlers kept.
"""

from lightning_grpo.checkpoint.atomic import atomic_write
from lightning_grpo.checkpoint.beside import resolved_config
from lightning_grpo.checkpoint.callback import GRPOCheckpoint
from lightning_grpo.checkpoint.checkpoint_io import AtomicCheckpointIO
from lightning_grpo.checkpoint.integrity import (
    DamagedCheckpointError,
    Manifest,
    manifest_path,
    read_manifest,
)
from lightning_grpo.checkpoint.lock import FolderInUseError
from lightning_grpo.checkpoint.paths import (
    checkpoint_name,
    complete_checkpoints,
    config_path,
    find_last_checkpoint,
    lineage_entries,
    loop_step_of,
)
from lightning_grpo.checkpoint.resume import resolve_ckpt_path
from lightning_grpo.checkpoint.signals import Preempted
from lightning_grpo.checkpoint.state import (
    STATE_KEY,
    LoopState,
    NonFiniteParametersError,
)

__all__ = [
    "STATE_KEY",
    "AtomicCheckpointIO",
    "DamagedCheckpointError",
    "FolderInUseError",
    "GRPOCheckpoint",
    "LoopState",
    "Manifest",
    "NonFiniteParametersError",
    "Preempted",
    "atomic_write",
    "checkpoint_name",
    "complete_checkpoints",
    "config_path",
    "find_last_checkpoint",
    "lineage_entries",
    "loop_step_of",
    "manifest_path",
    "read_manifest",
    "resolve_ckpt_path",
    "resolved_config",
]
