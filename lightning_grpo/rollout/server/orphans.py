"""No orphan server: every live launched server is stopped at exit and on SIGTERM, and a child dies with its parent.

``track`` registers a started server (``atexit`` and a SIGTERM handler chained to the previous one), ``untrack``
forgets a stopped one (the last one puts the previous handler back), ``die_with_parent`` is the child's pre-exec step.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Protocol


class Stoppable(Protocol):
    def stop(self) -> None: ...


_LIVE: set[Stoppable] = set()
_SIGTERM = {"installed": False, "previous": None}


def die_with_parent():
    """The child's pre-exec step: ask for SIGTERM when the parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, in the parent

    def ask_for_sigterm() -> None:
        prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG

    return ask_for_sigterm


def track(server: Stoppable) -> None:
    """Stop ``server`` at interpreter exit and on SIGTERM (chained to the previous handler)."""
    if not _LIVE:
        atexit.register(stop_all)
    _LIVE.add(server)
    if (
        not _SIGTERM["installed"]
        and threading.current_thread() is threading.main_thread()
    ):
        _SIGTERM["previous"] = signal.signal(signal.SIGTERM, _on_sigterm)
        _SIGTERM["installed"] = True


def untrack(server: Stoppable) -> None:
    """``server`` is stopping: no exit hook stops it again; the last one gives the SIGTERM handler back."""
    _LIVE.discard(server)
    if not _LIVE:
        _release_sigterm()


def stop_all() -> None:
    """Stop every server this process launched."""
    for server in list(_LIVE):
        server.stop()


def _release_sigterm() -> None:
    """The last server stopped: put the previous SIGTERM handler back, if ours is still the one installed (else
    something wrapped it, e.g. Lightning during a fit, and ours stays in its chain, inert while no server lives)."""
    if (
        _SIGTERM["installed"]
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is _on_sigterm
    ):
        signal.signal(signal.SIGTERM, _SIGTERM["previous"])
        _SIGTERM["installed"] = False


def _on_sigterm(signum, frame) -> None:
    previous = _SIGTERM["previous"]
    if not _LIVE and signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        # No server to stop, and called from a wrapper's chain (Lightning's during a fit): as if this handler were
        # not there; the wrapper acts on the signal itself (a graceful stop), so no default-action kill here.
        if callable(previous):
            previous(signum, frame)
        return
    stop_all()
    if callable(previous):
        previous(signum, frame)
    # SIG_DFL (or one set from C): die of SIGTERM as without this handler
    elif previous != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _SIGTERM["installed"] = False
        os.kill(os.getpid(), signal.SIGTERM)
