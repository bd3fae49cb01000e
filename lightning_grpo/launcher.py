"""What the launcher (torchrun, ``srun``) started, read from its environment, checked against the Trainer's topology.

Lightning computes its world as ``num_nodes x devices``. Under torchrun it refuses a product that differs
from ``WORLD_SIZE`` (naming neither CLI flag), under SLURM only where ``SLURM_NNODES`` and
``SLURM_NTASKS_PER_NODE`` are set; elsewhere a mismatch leaves ranks waiting at the rendezvous for
peers that never come. ``check_launch`` names the flags and the launcher's own numbers, before the
Trainer exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchedWorld:
    """The ranks a launcher started: ``nodes`` x ``per_node``."""

    launcher: str
    nodes: int
    per_node: int

    @property
    def size(self) -> int:
        return self.nodes * self.per_node


def launched_world(env: Mapping[str, str]) -> LaunchedWorld | None:
    """The world torchrun or ``srun`` describes in ``env``; None outside both (Lightning launches its own)."""
    if "TORCHELASTIC_RUN_ID" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        per_node = int(env.get("LOCAL_WORLD_SIZE", world))
        return LaunchedWorld("torchrun", world // max(per_node, 1), per_node)
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in (
        "bash",
        "interactive",
    ):
        tasks = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", 1))
        per_node = int(
            env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or tasks // max(nodes, 1)
        )
        return LaunchedWorld("srun", nodes, per_node)
    return None


def check_launch(
    num_nodes: object, devices: object, env: Mapping[str, str]
) -> list[str]:
    """``trainer.num_nodes`` / ``trainer.devices`` against the launcher's world, as problem lines (none = fine).

    ``devices`` that is not a count (``auto``, a list of ids) is left to Lightning.
    """
    world = launched_world(env)
    if world is None or not _is_count(num_nodes):
        return []
    per_node = int(devices) if _is_count(devices) else None
    if int(num_nodes) == world.nodes and per_node in (None, world.per_node):
        return []
    flags = {
        "torchrun": "--nnodes / --nproc-per-node",
        "srun": "--nodes / --ntasks-per-node",
    }[world.launcher]
    return [
        f"trainer.num_nodes={num_nodes} x trainer.devices={devices}: {world.launcher} started "
        f"{world.nodes} node(s) x {world.per_node} rank(s) ({flags}), so the ranks would wait for peers that "
        f"never come. Set --trainer.num_nodes={world.nodes} --trainer.devices={world.per_node}"
    ]


def _is_count(value: object) -> bool:
    return isinstance(value, int) or (isinstance(value, str) and value.isdigit())
