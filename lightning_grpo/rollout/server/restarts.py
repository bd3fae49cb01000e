"""Restarts of launched ``vllm serve`` children that died mid-run (``rollout.server.restarts``).

A death is met in whatever phase the run is in: a draw (``generate``), a weight sync (``start_weight_update``, a bucket
of ``update_weights``, ``finish_weight_update``, ``reset_prefix_cache``, the version check, the probe) or an adapter
load. The engine (``VLLMServerEngine``) turns each into one recovery, always on the thread that owns the trainer's
weights and with nothing else using the servers:

1. ``ServerRestarts.relaunch``: every dead launched child is started again on its port (its clients know that URL
   only), counted against the budget; none left, or nothing this run can relaunch: the run stops with a short
   message (the death, its phase, the server's log, the knob).
2. the trainer's current weights are republished to every server (a whole sync from its first bucket, then the
   version check and the probe), so no server samples with the policy folder's weights;
3. the interrupted work is done again: a draw with the same seeds (the same tokens), a sync from its first bucket.

Who does it: with synchronous rollouts, the thread that met the death (the training thread). Under async rollouts
the worker thread draws; it never restarts (``VLLMServerEngine.hold_restarts``): the draw's error waits in its
batch, and the training thread recovers when it takes that batch (``AsyncRollouts.take``: the worker idle first),
or earlier when the next sync meets the dead server. Several trainer ranks are refused at load (``run_check.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from lightning_grpo.rollout.server.client import ServerClient
from lightning_grpo.rollout.server.process import ServerDied

log = logging.getLogger(__name__)

KNOB = "rollout.server.restarts"


class ServerRestarts:
    """The restart budget of one engine: ``relaunch`` the dead children, count them, time each recovery.

    Args:
        budget: ``ServerConfig.restarts``: how many children may be started again over the run.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.done = 0
        """Children started again so far (the ``rollout/server_restarts`` metric)."""
        self.seconds: list[tuple[float, float]] = []
        """(launch, republish) wall seconds of each recovery."""
        self._launched_at: float | None = None

    @property
    def left(self) -> int:
        return self.budget - self.done

    def relaunch(
        self,
        clients: Sequence[ServerClient],
        err: ServerDied,
        can_republish: bool = True,
        ranks: int = 1,
    ) -> None:
        """Start every dead launched child among ``clients`` again, or raise the run's stop message.

        Args:
            clients: the engine's servers.
            err: the death met.
            can_republish: whether the engine can push the trainer's weights to a restarted server.
            ranks: trainer ranks sharing the servers (several: refused).
        """
        dead = [
            c
            for c in clients
            if c.process is not None and not c.process.alive(wait_s=2.0)
        ]
        if not dead:
            # not a death this run can repair (a restart since would have been seen by the caller)
            raise err
        self.require(err, can_republish, ranks, len(dead))
        self._launched_at = time.perf_counter()
        for client in dead:
            self.done += 1
            log.warning(
                "vllm serve at %s exited with code %s during %s; starting it again (%s: %d of %d used). "
                "Its log: %s",
                client.url,
                client.process.proc.returncode,
                err.phase,
                KNOB,
                self.done,
                self.budget,
                client.process.log_path,
            )
            client.process.restart()
            client.connect()
            client.post(
                "/init_weight_transfer_engine",
                {"init_info": {}},
                "init_weight_transfer_engine",
            )

    def require(
        self,
        err: ServerDied,
        can_republish: bool = True,
        ranks: int = 1,
        needed: int = 1,
    ) -> None:
        """Raise the run's stop message unless ``needed`` restarts can happen."""
        why_not = why_no_restart(self.budget, can_republish, ranks)
        if why_not is not None:
            # the report shows this message, not the death's first one
            raise stopped(err, why_not) from None
        if needed > self.left:
            raise stopped(err, self._spent()) from None

    def republished(self, republish: Callable[[], object]) -> None:
        """Run ``republish`` after ``relaunch``: the trainer's weights to every server, then time the recovery."""
        launched = time.perf_counter()
        launch_s = launched - self._launched_at
        republish()
        republish_s = time.perf_counter() - launched
        self.seconds.append((launch_s, republish_s))
        log.warning(
            "vllm serve started again in %.1fs and the trainer's weights republished in %.1fs",
            launch_s,
            republish_s,
        )

    def _spent(self) -> str:
        if self.budget == 0:
            return (
                f"{KNOB}=0: the run stops at a server's death; set {KNOB}: 1 (or more) to start it again with "
                "the trainer's weights"
            )
        return f"{KNOB}={self.budget}: all {self.budget} restart(s) are spent; raise it, or find why the server dies"


def why_no_restart(budget: int, can_republish: bool, ranks: int) -> str | None:
    """Why an engine with this budget cannot restart a server at all (None: it can, budget allowing)."""
    if budget and not can_republish:
        return "this engine was built without republish: a restarted server would hold the folder's weights"
    if budget and ranks > 1:
        return f"{KNOB} is not supported with several trainer ranks (run_check.py refuses it at load)"
    return None


def stopped(err: ServerDied, why: str) -> ServerDied:
    """``err`` as the run's stop message: the death (phase, exit code, log) and, on a second line, the knob."""
    return ServerDied(err.process, err.phase, fix=why)


def repaired(err: BaseException) -> bool:
    """Whether ``err`` is a death that a restart has repaired since (its server runs again)."""
    if not isinstance(err, ServerDied):
        return False
    return err.process.starts > err.starts and err.process.alive()
