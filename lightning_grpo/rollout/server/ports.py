"""The ports a launched server listens on: free ones picked for it, a given one checked before the launch."""

from __future__ import annotations

import contextlib
import socket

from lightning_grpo.rollout.server.http_json import ServerError


def free_port(host: str) -> int:
    return free_ports(host, 1)[0]


def free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct free ports: all bound at once, so no two replicas are handed the same one."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on, naming the fix (vLLM's own error comes after a minute of loading)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as err:
            raise ServerError(
                f"rollout.server.port={port}: {host}:{port} is in use ({err.strerror}); pick another "
                "port, set rollout.server.port: null (a free one), or stop what listens there "
                f"(`ss -ltnp 'sport = :{port}'` shows it)"
            ) from None


def can_listen(host: str, port: int) -> bool:
    """Whether a listening socket could bind ``host:port`` now (SO_REUSEADDR: TIME_WAIT leftovers allowed)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
