"""``ServerConfig``: the ``vllm serve`` engine (``rollout.server``; ``lightning_grpo.config`` re-exports it).

A plain dataclass beside the engines, like ``VLLMConfig``: it imports nothing but ``checks.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from lightning_grpo.checks import is_finite, is_int, raise_problems

BACKEND = "lightning_grpo_shm"
"""The weight-transfer backend a server is started with (``--weight-transfer-config``;
``rollout/server/shm_transfer.py``)."""


@dataclass
class ServerConfig:
    """The ``vllm serve`` engine (``rollout.engine: vllm_server``): a child process this run starts, or a URL."""

    url: str | list[str] | None = None
    """A running server (``http://host:port``) to connect to, or a list of them (requests are spread by prompt group,
    every sync reaches each); None = launch ``replicas`` child processes (``launch``)."""
    launch: bool = True
    """With url=None: start ``vllm serve`` on the policy folder as a child of this run (stopped with it)."""
    replicas: int = 1
    """With url=None: how many servers to launch, each on its own port with its own ``threads`` and KV cache."""
    host: str = "127.0.0.1"
    """Interface a launched server listens on."""
    port: int | None = None
    """Port of a launched server (replica i: port + i); None = a free one each."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Server weight dtype; syncs cast to it. auto = vLLM's pick (0.32 downcasts float32 checkpoints to bf16)."""
    max_model_len: int | None = None
    """Context length (prompt + completion); None = the model's."""
    enforce_eager: bool = False
    """Skip torch.compile / CUDA graphs: faster start, slower decoding."""
    threads: int | None = None
    """CPU threads of a launched server (OMP_NUM_THREADS); None = vLLM's default."""
    nice: int = 0
    """CPU priority of a launched server (Unix ``nice``, 0-19): above 0 the trainer's update takes the cores first
    where the two share them (async rollouts on a small machine: the sampling has slack, the update has none)."""
    kv_cache_memory_bytes: int | None = None
    """KV cache of a launched server in bytes; None = vLLM's sizing."""
    gpus: str | list[str] | None = None
    """CUDA_VISIBLE_DEVICES of a launched server (e.g. "1" or "2,3"), or one such string per replica (["4", "5"]);
    None = inherited."""
    extra_args: list[str] = field(default_factory=list)
    """More ``vllm serve`` arguments for a launched server, passed through unchanged."""
    weight_transport: Literal["auto", "shm", "http"] = "auto"
    """How each weight bucket reaches each server: shm = a safetensors file in /dev/shm (same node only), http = its
    bytes in the request body (any node, +33% base64), auto = per hop: shm for a server on the pusher's node (every
    launched one), http for one on another host (``rollout/server/placement.py``)."""
    placement: Literal["global", "per_node"] = "global"
    """Launched servers: global = one pool of ``replicas`` that global rank 0 launches, shared by every rank; per_node
    = a pool of ``replicas`` on each node, launched by the node's local rank 0 and used by that node's ranks only."""
    startup_timeout_s: float = 300.0
    """Seconds a launched server may take to answer /health (a URL: seconds to answer at all, 1/10 of this)."""
    request_timeout_s: float = 600.0
    """Seconds one generation request may take."""
    sync_timeout_s: float = 120.0
    """Seconds each phase of a weight sync (start, one bucket, finish, probe) may take."""
    probe_tolerance: float | None = None
    """Largest |server - trainer| logprob on the probe sequence after a sync; None = 1e-3 for a float32 server,
    0.1 otherwise. Above it the engine is stale (a sync did not land) and the run stops."""
    cache_salt: bool = False
    """Keep the prefix cache across weight syncs, keyed by weight version: every request carries vLLM's
    ``cache_salt`` of the version the servers hold, so a prefix cached under older weights is never reused, and no
    global ``/reset_prefix_cache`` runs at a sync. False = reset the whole cache at every sync (docs/async.md)."""
    inflight_updates: bool = False
    """Under async rollouts (``max_off_policy_steps`` >= 1), a weight sync does not wait for the batches in flight:
    it pauses the servers (in-flight requests end where they are), pushes and checks the weights, resumes, and each
    cut request continues from its tokens so far under the new weights. Every token records the weight version that
    sampled it and its sampler logprob comes from those weights (rollout correction weighs each token by its own).
    False = every sync first waits until nothing is in flight (one weight version per batch; docs/async.md)."""
    restarts: int = 0
    """How many times a launched server that dies mid-run (in a draw, a weight sync, the version check or the probe)
    is started again on its port before the run stops. The engine then republishes the trainer's current weights
    (checked by the probe) and redoes the interrupted work: the draw with the same seeds, the sync from its first
    bucket. 0 = the run stops at the first death, naming it and the server's log. One trainer rank (async rollouts
    included); counted in the rollout/server_restarts metric."""

    def __post_init__(self) -> None:
        raise_problems("server config", self.problems())

    def problems(self) -> list[str]:
        """Every broken rule as a ``field=value: rule; fix`` line."""
        return [
            *self._url_problems(),
            *self._launch_problems(),
            *self._pool_problems(),
            *self._sync_problems(),
        ]

    def _url_list(self) -> list:
        """``url`` as a list, as given (empty when launching)."""
        if isinstance(self.url, list):
            return self.url
        return [] if self.url is None else [self.url]

    def _url_problems(self) -> list[str]:
        p = []
        urls = self._url_list()
        if isinstance(self.url, list) and not self.url:
            p.append(
                "url=[]: an empty list names no server; give at least one URL, or null to launch servers"
            )
        if any(
            not (isinstance(u, str) and u.startswith(("http://", "https://")))
            for u in urls
        ):
            p.append(
                f"url={self.url!r}: must start with http:// or https:// (or be null to launch a server)"
            )
        if len({u.rstrip("/") if isinstance(u, str) else u for u in urls}) < len(urls):
            p.append(
                f"url={self.url!r}: names a server twice; list each server once (two sessions on one server "
                "would clash at every sync)"
            )
        return p

    def _launch_problems(self) -> list[str]:
        """The settings of launched servers."""
        p = []
        if not is_int(self.replicas) or self.replicas < 1:
            p.append(f"replicas={self.replicas!r}: must be an integer >= 1")
        elif self.replicas > 1 and self.url is not None:
            p.append(
                f"replicas={self.replicas} with url set: replicas counts launched servers; list every running "
                "server in url instead, or set url: null to launch them"
            )
        if isinstance(self.gpus, list) and len(self.gpus) != self.replicas:
            p.append(
                f"gpus={self.gpus!r}: a list gives one CUDA_VISIBLE_DEVICES string per replica, so it needs "
                f"replicas={self.replicas} entries; give that many, or one string for all"
            )
        if self.url is None and not self.launch:
            p.append(
                "launch=False with url=None: nothing to connect to; set url or launch: true"
            )
        if self.port is not None and (
            not is_int(self.port) or not 0 < self.port < 65536
        ):
            p.append(f"port={self.port!r}: must be in 1..65535, or null (a free port)")
        if self.threads is not None and (not is_int(self.threads) or self.threads < 1):
            p.append(f"threads={self.threads!r}: must be an integer >= 1 or null")
        if not is_int(self.nice) or not 0 <= self.nice <= 19:
            p.append(
                f"nice={self.nice!r}: must be an integer in 0..19 (0 = the trainer's priority)"
            )
        if self.max_model_len is not None and (
            not is_int(self.max_model_len) or self.max_model_len < 1
        ):
            p.append(
                f"max_model_len={self.max_model_len!r}: must be >= 1 or null (the model's)"
            )
        return p

    def _pool_problems(self) -> list[str]:
        """How the servers are reached: the weight transport, the placement, the timeouts."""
        p = []
        if self.weight_transport not in ("auto", "shm", "http"):
            p.append(
                f"weight_transport={self.weight_transport!r}: must be 'auto', 'shm' or 'http'"
            )
        if self.placement not in ("global", "per_node"):
            p.append(f"placement={self.placement!r}: must be 'global' or 'per_node'")
        elif self.placement == "per_node" and self.url is not None:
            p.append(
                "placement=per_node with url set: per_node launches a pool on every node; list running servers "
                "in url with placement: global, or set url: null"
            )
        for name in ("startup_timeout_s", "request_timeout_s", "sync_timeout_s"):
            value = getattr(self, name)
            if not is_finite(value) or value <= 0:
                p.append(f"{name}={value!r}: must be a number of seconds > 0")
        return p

    def _sync_problems(self) -> list[str]:
        """What a sync may do: restart a dead server, run in flight, tolerate on the probe."""
        p = []
        if not is_int(self.restarts) or self.restarts < 0:
            p.append(f"restarts={self.restarts!r}: must be an integer >= 0")
        elif self.restarts and self.url is not None:
            p.append(
                f"restarts={self.restarts} with url set: only a server this run launched can be started again; "
                "restart the server at the URL yourself, or set url: null to launch it"
            )
        if self.inflight_updates and self.restarts:
            p.append(
                f"inflight_updates=True with restarts={self.restarts}: a restart republishes the weights "
                "outside the paused sync that in-flight updates need; set restarts: 0 or inflight_updates: false"
            )
        if self.probe_tolerance is not None and (
            not is_finite(self.probe_tolerance) or self.probe_tolerance <= 0
        ):
            p.append(
                f"probe_tolerance={self.probe_tolerance!r}: must be > 0 or null (by dtype)"
            )
        return p

    @property
    def urls(self) -> list[str]:
        """The servers to connect to (``url`` as a list; empty when launching), without a trailing slash."""
        return [u.rstrip("/") for u in self._url_list()]

    def replica(self, i: int) -> ServerConfig:
        """The launch settings of replica ``i``: its own port (``port + i``) and, with a list, its own ``gpus``."""
        gpus = self.gpus[i] if isinstance(self.gpus, list) else self.gpus
        port = None if self.port is None else self.port + i
        return replace(self, replicas=1, port=port, gpus=gpus)
