"""``Ranks``: the trainer ranks that share one run's ``vllm serve`` pool (``rollout.engine: vllm_server`` under data
parallelism).

Every rank generates its own share of prompts through the servers; the weights are the same on every rank after an
update, so rank 0 alone pushes them. The other ranks take part in each sync only to keep it in step: a barrier before
the first bucket (no rank is still sampling while the weights change) and one after the last (no rank samples before
the new weights landed). A run that launches its servers launches them on rank 0, which broadcasts their URLs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer ranks (one rank: barriers and broadcasts do nothing)."""

    rank: int = 0
    size: int = 1

    @classmethod
    def current(cls) -> Ranks:
        """The default process group's ranks (the data-parallel ranks under Lightning's DDP), else one rank."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def leads(self) -> bool:
        """Rank 0: launches the servers and pushes the weights."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
