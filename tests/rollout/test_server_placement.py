"""Where the ``vllm serve`` pools run and how each weight bucket reaches each server (``rollout/server/placement.py``,
``rollout/server/ranks.py``): per-hop transport, pool leads, and the lead's launch reaching its own node's ranks."""

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import forked_context

from lightning_grpo.config import RolloutConfig, ServerConfig
from lightning_grpo.rollout.server.placement import bucket_bodies, check_reachable_pool, hop_transport, on_this_node
from lightning_grpo.rollout.server.ranks import Ranks

pytestmark = [pytest.mark.integration, pytest.mark.heavy]  # a fit with a transformers policy: not the unit tier
# heavy: 4 gloo ranks in fork-server children; CI and `make test-integration` run it

HERE = frozenset({"gpu-node-3"})  # this node's names, as this_node_names() would give them on gpu-node-3


@pytest.mark.parametrize(("requested", "url", "transport"), [
    ("auto", "http://127.0.0.1:8000", "shm"),
    ("auto", "http://localhost:8000", "shm"),
    ("auto", "http://0.0.0.0:8001", "shm"),  # a launched server listening on every interface, on this node
    ("auto", "http://gpu-node-3:8000", "shm"),
    ("auto", "http://gpu-node-4:8000", "http"),
    ("auto", "http://10.0.0.7:8000", "http"),
    ("http", "http://127.0.0.1:8000", "http"),  # asked for: kept
    ("shm", "http://localhost:8000", "shm"),
])
def test_the_transport_is_picked_per_hop(requested, url, transport):
    assert hop_transport(requested, url, HERE) == transport


def test_shared_memory_to_a_server_on_another_node_is_refused_naming_the_knob():
    with pytest.raises(ValueError, match=r"weight_transport=shm with the server at http://gpu-node-4:8000: .* "
                                         r"gpu-node-4 is another host .* set weight_transport: auto"):
        hop_transport("shm", "http://gpu-node-4:8000", HERE)


def test_this_machines_own_hostname_is_this_node():
    assert on_this_node(f"http://{socket.gethostname()}:8000")
    assert not on_this_node("http://no-such-node.invalid:8000")


def test_a_mixed_pool_gets_each_body_once(tmp_path):
    tensors = {"w": torch.arange(6, dtype=torch.float32)}
    path = tmp_path / "bucket-1.safetensors"
    bodies = bucket_bodies(tensors, {"shm", "http"}, path)
    assert bodies["shm"] == {"update_info": {"path": str(path)}} and path.exists()
    assert set(bodies["http"]["update_info"]) == {"data"}
    assert bucket_bodies(tensors, {"http"}, tmp_path / "none.safetensors").keys() == {"http"}
    assert not (tmp_path / "none.safetensors").exists()  # no file where no server maps it


# -- who leads a pool ------------------------------------------------------------------------------------------------
def node_ranks(placement: str, nodes: int = 2, per_node: int = 2) -> list[Ranks]:
    return [Ranks(n * per_node + local, nodes * per_node, n, local, per_node, placement)
            for n in range(nodes) for local in range(per_node)]


def test_global_placement_has_one_lead_and_interleaves_every_rank():
    ranks = node_ranks("global")
    assert [r.leads for r in ranks] == [True, False, False, False]
    assert [(r.pool_rank, r.pool_size) for r in ranks] == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_per_node_placement_has_a_lead_per_node_over_its_own_ranks():
    ranks = node_ranks("per_node")
    assert [r.leads for r in ranks] == [True, False, True, False]
    assert [(r.pool_rank, r.pool_size) for r in ranks] == [(0, 2), (1, 2), (0, 2), (1, 2)]


def test_a_global_pool_on_loopback_across_nodes_is_refused():
    with pytest.raises(ValueError, match=r"rollout.server.host=127.0.0.1 with placement=global on 2 nodes: .*"
                                         r"placement: per_node"):
        check_reachable_pool("127.0.0.1", node_ranks("global")[0])
    check_reachable_pool("127.0.0.1", node_ranks("per_node")[0])  # each node's ranks use their own node's pool
    check_reachable_pool("gpu-node-3", node_ranks("global")[0])  # a name the other nodes resolve
    check_reachable_pool("127.0.0.1", node_ranks("global", nodes=1)[1])  # one node


def test_per_node_with_urls_is_refused_by_the_config():
    with pytest.raises(ValueError, match="placement=per_node with url set"):
        ServerConfig(url="http://127.0.0.1:8000", placement="per_node")


def test_run_check_refuses_shm_to_a_remote_url_and_an_adapter_over_an_http_hop():
    from lightning_grpo.lora import LoraConfig
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.run_check import server_problems

    remote = RolloutConfig(engine="vllm_server", server=ServerConfig(url="http://10.9.9.9:8000", weight_transport="shm"))
    assert any("weight_transport=shm with the server at http://10.9.9.9:8000" in p
               for p in server_problems(PolicyConfig(), remote, 1))
    auto = RolloutConfig(engine="vllm_server", server=ServerConfig(url="http://10.9.9.9:8000"))
    assert server_problems(PolicyConfig(), auto, 1) == []
    adapter = PolicyConfig(lora=LoraConfig(rank=4, sync="adapter"))
    assert any("a server on another node (HTTP under weight_transport: auto)" in p
               for p in server_problems(adapter, auto, 1))


# -- the lead's launch reaches its own node's ranks (4 gloo processes: 2 nodes x 2 ranks) ---------------------------
def _from_lead(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for placement in ("global", "per_node"):
        me = Ranks.current(node=rank // 2, local_rank=rank % 2, local_size=2, placement=placement)
        launched = [f"http://node{me.node}:{9000 + me.rank}"] if me.leads else None
        results[placement] = me.from_lead(launched)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_each_rank_hears_its_own_pool_leads_urls(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forked_context()  # the session's fork server (torch imported once), not 4 fresh interpreters
    mp.start_processes(_from_lead, args=(4, port, str(tmp_path)), nprocs=4, join=True, start_method="forkserver")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert [g["global"] for g in got] == [["http://node0:9000"]] * 4
    assert [g["per_node"] for g in got] == [["http://node0:9000"]] * 2 + [["http://node1:9002"]] * 2
