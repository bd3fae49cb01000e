"""The servers a run samples from: launched as its children (one pool, or one per node's lead), or given by URL.

``connect`` returns a client per server; with several trainer ranks the pool's lead launches and the others
hear its URLs (``ranks.py``). A given URL is checked before use (``check_reachable``), so a typo or a
server started without the RL routes is refused naming the knob, not met at the first draw.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

from lightning_grpo.rollout.server.client import ServerClient
from lightning_grpo.rollout.server.http_json import ServerError, request_json
from lightning_grpo.rollout.server.placement import check_reachable_pool
from lightning_grpo.rollout.server.ports import free_ports
from lightning_grpo.rollout.server.process import ServerProcess
from lightning_grpo.rollout.server.ranks import Ranks
from lightning_grpo.rollout.server_config import ServerConfig


def connect(
    model_path: Path,
    cfg: ServerConfig,
    sampler_logprobs: bool,
    ranks: Ranks,
    adapter_args: Sequence[str] = (),
) -> list[ServerClient]:
    """A client per server at ``cfg.url``, or per launched replica (all spawned first, so they load side by side;
    several trainer ranks: rank 0 launches them and tells the others where they answer)."""
    if cfg.url is None and ranks.size > 1:
        check_reachable_pool(cfg.host, ranks)
        clients = []
        failure = None
        if ranks.leads:
            try:
                clients = connect(
                    model_path, cfg, sampler_logprobs, Ranks(), adapter_args
                )
            except Exception as err:  # noqa: BLE001 - the other ranks must hear of it, not wait forever
                failure = err
        urls = ranks.from_lead(
            f"error: {failure}" if failure is not None else [c.url for c in clients]
        )
        if failure is not None:
            raise failure
        if isinstance(urls, str):
            raise ServerError(
                f"the pool's lead rank could not launch vllm serve ({urls[7:]})"
            )
        return clients or [ServerClient(url, cfg) for url in urls]
    if cfg.url is not None:
        for url in cfg.urls:
            check_reachable(url, cfg)
        return [ServerClient(url, cfg) for url in cfg.urls]
    mode = "processed_logprobs" if sampler_logprobs else "raw_logprobs"
    replicas = [cfg.replica(i) for i in range(cfg.replicas)]
    # picked together: two replicas never race for one port
    if cfg.port is None and cfg.replicas > 1:
        replicas = [
            replace(r, port=port)
            for r, port in zip(replicas, free_ports(cfg.host, cfg.replicas))
        ]
    processes = [
        ServerProcess(str(model_path), r, mode, adapter_args) for r in replicas
    ]
    try:
        for process in processes:
            process.spawn()
        for process in processes:
            process.wait_ready()
    except BaseException:
        for process in processes:
            process.stop()
        raise
    return [ServerClient(p.url, cfg, p) for p in processes]


def check_answers(url: str, cfg: ServerConfig) -> None:
    """Refuse, quickly and naming the knob, a ``rollout.server.url`` where no server answers: ``GRPOModule.setup``
    asks before the policy loads (``run_check.check_parts``), the engine again when it connects."""
    try:
        request_json(url, "/health", timeout=_answer_timeout(cfg), phase="health")
    except ServerError as err:
        raise ServerError(
            f"rollout.server.url={url}: no vLLM server answers there ({err}); start one (docs/async.md) "
            "or set rollout.server.url: null to launch one as a child of this run"
        ) from None


def check_reachable(url: str, cfg: ServerConfig) -> None:
    """``check_answers``, and refuse a server that lacks the RL routes (started without dev mode)."""
    check_answers(url, cfg)
    try:
        request_json(
            url, "/weight_info", timeout=_answer_timeout(cfg), phase="weight_info"
        )
    except ServerError as err:
        raise ServerError(
            f"rollout.server.url={url}: the server has no weight-update routes ({err}); start it with "
            'VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config \'{"backend": "lightning_grpo_shm"}\' '
            "(docs/async.md)"
        ) from None


def _answer_timeout(cfg: ServerConfig) -> float:
    """A tenth of the start-up timeout, at least a second: a server that answers does so at once."""
    return max(1.0, cfg.startup_timeout_s / 10)
