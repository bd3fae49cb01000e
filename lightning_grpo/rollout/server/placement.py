"""How each weight bucket reaches each server: the transport of one hop (pool lead -> server).

``lightning_grpo_shm`` moves a bucket either as a safetensors file in ``/dev/shm`` (the server maps it: one
memory copy, but only a server on the pusher's node can read that file) or as its bytes in the request body
(HTTP: any node, +33% base64). ``rollout.server.weight_transport: auto`` picks per hop: shared memory for a
server on this node (every launched server is: its pool lead launched it), HTTP for one on another host.
``shm`` asked for a server on another host cannot work and is refused, naming the URL.
"""

from __future__ import annotations

import base64
import socket
from pathlib import Path
from urllib.parse import urlsplit

from lightning_grpo.rollout.server.ranks import Ranks

LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"})
"""Hosts that always mean the machine the request starts on."""


def this_node_names() -> frozenset[str]:
    """The names this machine answers to without asking DNS: its hostname, short and as set."""
    name = socket.gethostname()
    return frozenset({name, name.split(".")[0]})


def on_this_node(url: str, names: frozenset[str] | None = None) -> bool:
    """Whether the server at ``url`` runs on this node (loopback, or this machine's hostname)."""
    host = urlsplit(url).hostname or ""
    return host in LOOPBACK or host in (this_node_names() if names is None else names)


def hop_transport(requested: str, url: str, names: frozenset[str] | None = None) -> str:
    """``shm`` or ``http`` for the hop to the server at ``url`` (``requested``: auto, shm or http).

    Raises:
        ValueError: ``shm`` for a server on another node (it cannot read this node's ``/dev/shm``).
    """
    local = on_this_node(url, names)
    if requested == "auto":
        return "shm" if local else "http"
    if requested == "shm" and not local:
        raise ValueError(
            f"rollout.server.weight_transport=shm with the server at {url}: shared memory reaches only servers on "
            f"this node, and {urlsplit(url).hostname} is another host (it cannot read this node's /dev/shm); set "
            "weight_transport: auto (HTTP for that hop) or http"
        )
    return requested


def bucket_bodies(tensors: dict, transports: set[str], path: Path) -> dict[str, dict]:
    """The ``/update_weights`` body of one bucket for each transport in use, each made once (``shm`` writes ``path``,
    which the caller removes once every server loaded it)."""
    bodies = {}
    if "http" in transports:
        from safetensors.torch import save

        bodies["http"] = {
            "update_info": {"data": base64.b64encode(save(tensors)).decode()}
        }
    if "shm" in transports:
        from safetensors.torch import save_file

        # tmpfs: a memory copy every server on this node maps
        save_file(tensors, str(path))
        bodies["shm"] = {"update_info": {"path": str(path)}}
    return bodies


def check_reachable_pool(host: str, ranks: Ranks) -> None:
    """Refuse a pool that rank 0 launches on its loopback when ranks on other nodes would sample from it."""
    spans_nodes = ranks.size > ranks.local_size
    if ranks.placement == "global" and spans_nodes and host in LOOPBACK:
        raise ValueError(
            f"rollout.server.host={host} with placement=global on {ranks.size // ranks.local_size} nodes: the servers "
            "rank 0 launches answer on node 0 only, which the other nodes' ranks cannot reach; set "
            "rollout.server.placement: per_node (a pool on every node), or host: node 0's hostname"
        )
