"""A resume under several nodes: every rank must see the checkpoint rank 0 resumes from (checkpoint/shared.py).

Two ranks simulated by threads: each has a trainer whose strategy broadcasts rank 0's object and all-gathers
across the threads, as Lightning's does across processes. The real two-node case: tests/test_nodes.py.
"""

import threading
from types import SimpleNamespace

import pytest
import torch

from lightning_grpo.checkpoint.shared import CheckpointNotSharedError, check_every_rank_sees


class ThreadStrategy:
    """Rank ``rank`` of ``world`` threads: ``broadcast`` from rank 0 and ``all_gather``, through shared slots."""

    def __init__(self, rank: int, world: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.world, self.slots, self.barrier = rank, world, slots, barrier
        self.root_device = torch.device("cpu")

    def _exchange(self, value):
        self.slots[self.rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def broadcast(self, obj):
        return self._exchange(obj)[0]

    def all_gather(self, t):
        return torch.stack(self._exchange(t))


def run_ranks(found: list) -> list:
    """``check_every_rank_sees`` on each simulated rank (rank r on node r, resuming ``found[r]``): what each raised."""
    world = len(found)
    slots, barrier, raised = [None] * world, threading.Barrier(world), [None] * world

    def work(r):
        trainer = SimpleNamespace(world_size=world, node_rank=r, strategy=ThreadStrategy(r, world, slots, barrier))
        try:
            check_every_rank_sees(trainer, found[r])
        except CheckpointNotSharedError as err:
            raised[r] = str(err)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return raised


def test_every_rank_seeing_rank_0s_checkpoint_passes(tmp_path):
    ckpt = tmp_path / "loop-step-000003.ckpt"
    ckpt.write_bytes(b"x")
    assert run_ranks([ckpt, ckpt]) == [None, None]
    assert run_ranks([None, None]) == [None, None]  # a fresh start everywhere


@pytest.mark.parametrize("case", ["rank1_found_nothing", "rank1_found_a_stale_copy", "rank0_found_nothing"])
def test_a_checkpoint_only_one_node_sees_stops_every_rank_naming_the_knob(tmp_path, case):
    ckpt = tmp_path / "node0" / "loop-step-000003.ckpt"
    stale = tmp_path / "node1" / "loop-step-000001.ckpt"
    for path in (ckpt, stale):
        path.parent.mkdir()
        path.write_bytes(b"x")
    found = {"rank1_found_nothing": [ckpt, None], "rank1_found_a_stale_copy": [ckpt, stale],
             "rank0_found_nothing": [None, ckpt]}[case]
    raised = run_ranks(found)
    assert raised[0] == raised[1] and raised[0] is not None  # both ranks stop, with one message: no rank waits
    assert raised[0].startswith("checkpoint.dirpath: rank 0 ")
    assert "rank 1 (node 1)" in raised[0] and "a filesystem every node mounts" in raised[0]
    if case != "rank0_found_nothing":
        assert f"resumes from {ckpt}, which rank 1 (node 1) cannot see" in raised[0]


def test_a_file_rank_0_names_but_that_is_gone_everywhere_is_refused_too(tmp_path):
    gone = tmp_path / "loop-step-000003.ckpt"
    raised = run_ranks([gone, gone])
    assert raised[0] is not None and "rank 0 (node 0), rank 1 (node 1)" in raised[0]
