"""One JSON request to a server (``request_json``, through ``urllib``) and the errors a server call raises.

``ServerError`` names the phase; ``ServerTimeout`` and ``ConnectionLost`` say which of the two silences it was.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request


class ServerError(RuntimeError):
    """The server failed, refused or did not answer; the message names the phase (and a launched server's log)."""


class ServerTimeout(ServerError):
    """The server took the connection but did not answer within the phase's timeout (it may still be working)."""


class ConnectionLost(ServerError):
    """The connection was refused, reset or cut short: nothing listens there any more, or the server went away."""


def request_json(
    url: str,
    path: str,
    body: dict | None = None,
    timeout: float = 30.0,
    phase: str = "",
) -> object:
    """GET (``body`` None) or POST ``body`` as JSON; the decoded reply. Errors name the phase and the server's reply:
    ``ServerTimeout`` after ``timeout`` seconds of silence, ``ConnectionLost`` when the connection broke."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        raise ServerError(
            f"{phase or path}: {url}{path} answered HTTP {err.code}: {detail}"
        ) from None
    # refused, reset, cut short, timeout
    except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
        reason = getattr(err, "reason", err)
        # socket.timeout: the only error that means time ran out
        if isinstance(reason, TimeoutError):
            raise ServerTimeout(
                f"{phase or path}: {url}{path} did not answer within {timeout:g}s"
            ) from None
        raise ConnectionLost(
            f"{phase or path}: the connection to {url}{path} broke "
            f"({type(reason).__name__}: {reason})"
        ) from None
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:  # a few routes (LoRA load/unload) answer plain text
        return raw.decode(errors="replace")
