"""``Ranks``: the trainer ranks that share one run's ``vllm serve`` pools (``rollout.engine: vllm_server`` under data
parallelism).

Every rank generates its own share of prompts through its pool's servers; the weights are the same on every rank
after an update, so a pool's lead alone pushes them to it. The other ranks take part in each sync only to keep it in
step: a barrier before the first bucket (no rank is still sampling while the weights change) and one after the last
(no rank samples before the new weights landed). Barriers span every rank, whatever the placement.

Placement (``rollout.server.placement``): ``global``, one pool that global rank 0 launches and leads, shared by
every rank; ``per_node``, one pool per node that the node's local rank 0 launches and leads, used by that node's
ranks only (``placement.py`` picks the weight transport of each hop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer ranks (one rank: barriers and broadcasts do nothing)."""

    rank: int = 0
    size: int = 1
    node: int = 0
    """This rank's node (the launcher's node rank)."""
    local_rank: int = 0
    """This rank's place on its node."""
    local_size: int = 1
    """Ranks per node."""
    placement: str = "global"
    """``global`` (one pool, led by rank 0) or ``per_node`` (a pool per node, led by its local rank 0)."""

    @classmethod
    def current(
        cls,
        node: int = 0,
        local_rank: int = 0,
        local_size: int | None = None,
        placement: str = "global",
    ) -> Ranks:
        """The default process group's ranks (the data-parallel ranks under Lightning's DDP), else one rank; the
        node figures come from the trainer (the launcher's ``NODE_RANK`` / ``GROUP_RANK`` / ``SLURM_NODEID``)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            size = dist.get_world_size()
            return cls(
                dist.get_rank(), size, node, local_rank, local_size or size, placement
            )
        return cls(placement=placement)

    @property
    def per_node(self) -> bool:
        return self.placement == "per_node"

    @property
    def leads(self) -> bool:
        """This rank's pool's lead: launches the pool's servers and pushes the weights to them."""
        return self.local_rank == 0 if self.per_node else self.rank == 0

    @property
    def pool_rank(self) -> int:
        """This rank's place among the ranks sharing its pool (prompt groups interleave over servers by it)."""
        return self.local_rank if self.per_node else self.rank

    @property
    def pool_size(self) -> int:
        """How many ranks share this rank's pool."""
        return self.local_size if self.per_node else self.size

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

    def from_lead(self, obj):
        """The ``obj`` of this rank's pool lead (rank 0's, or its node's local rank 0's); a collective of all ranks."""
        if not self.per_node:
            return self.broadcast(obj)
        if self.size == 1:
            return obj
        every: list = [None] * self.size
        dist.all_gather_object(every, (self.node, self.leads, obj))
        return next(o for node, leads, o in every if node == self.node and leads)
