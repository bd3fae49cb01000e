"""vLLM's RL weight-update API on a pool of servers: the engine's ``load_weights`` and ``reset_prefix_cache``.

A sync is a session: ``/start_weight_update``, ``/update_weights`` per bucket (each by its hop's transport,
``placement.py``), ``/finish_weight_update`` with the next weight version; then every server is checked
(``check_current``: the version, and the probe against the trainer's logprobs). With in-flight updates the session
pauses the servers (cutting the requests in flight) and resumes them before the probe. A server that died in a
sync is started again at its end and the sync redone (``VLLMServerEngine._recover``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from lightning_grpo.rollout.server.client import ServerClient, each
from lightning_grpo.rollout.server.inflight import fails_gate
from lightning_grpo.rollout.server.placement import bucket_bodies
from lightning_grpo.rollout.server.probe import check_probe, check_version
from lightning_grpo.rollout.server.process import ServerDied


class ServerWeightUpdates:
    """The weight sync of ``VLLMServerEngine`` (its base): what a sync does on the servers, and the checks after it.

    It reads the engine's servers (``clients``, ``transports``), its ``ranks``, ``gate``, ``config``, ``version``
    and sleep state, and calls its ``_recover`` and ``_served``.
    """

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """One bucket (checkpoint names); the first bucket of a sync opens vLLM's weight-update session."""
        # in-flight: the cut requests raise a failed sync's error
        with fails_gate(self.gate):
            self._load_bucket(named_tensors)

    def _load_bucket(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self._sleep.require("weights", call="VLLMServerEngine.load_weights()")
        if not self._session:
            # every rank is done sampling before the weights change
            self.ranks.barrier()
            self._session = True
            self._bucket = 0
            # in-flight updates: cut the running requests instead of waiting for them
            if self.gate is not None:
                self.gate.close(self.config.sync_timeout_s)
                self._guarded(
                    self._post, "/pause?mode=abort&clear_cache=false", {}, "pause"
                )
            self._guarded(self._post, "/start_weight_update", {}, "start_weight_update")
        self._bucket += 1
        # every rank: FSDP2 gathers
        tensors = {name: t.detach().cpu().contiguous() for name, t in named_tensors}
        if self._interrupted is not None:
            # the sync is redone from its first bucket at its end (``reset_prefix_cache``)
            return
        phase = f"update_weights (bucket {self._bucket})"
        self._guarded(self._push_bucket, tensors, phase)

    def _guarded(self, call, *args) -> None:
        """``call(*args)`` in a sync on rank 0; a death is kept for the sync's end, which recovers (or, with no
        restart possible, raised now: the rest of the sync would be lost time)."""
        if not self.ranks.leads:
            return  # the same weights: the pool's lead pushes them
        try:
            call(*args)
        except ServerDied as err:
            # none possible: stop now
            self.restarts.require(err, self.republish is not None, self.ranks.size)
            self._interrupted = err

    def _push_bucket(self, tensors: dict[str, Tensor], phase: str) -> None:
        """One bucket to every server by its hop's transport (``placement.py``): the body (http) or a tmpfs file (shm)."""
        path = Path(f"{self._bucket_prefix}-{self._bucket}.safetensors")
        try:  # each server by its hop's transport (placement.py)
            bodies = bucket_bodies(tensors, set(self.transports.values()), path)

            def update(client: ServerClient) -> None:
                body = bodies[self.transports[client.url]]
                client.post("/update_weights", body, phase)

            each(self.clients, update)
        finally:
            path.unlink(missing_ok=True)

    def reset_prefix_cache(self) -> None:
        """End of a sync: finish the session under the next weight version, drop cached KV blocks (under
        ``cache_salt`` the next requests' salt does it), check the engine.
        A server that died in this sync (any phase) is started again and the sync redone from its first bucket."""
        # in-flight: the cut requests raise a failed sync's error
        with fails_gate(self.gate):
            try:
                self._finish_sync()
            except ServerDied as err:
                # the republish is the redone sync (the trainer's weights did not change meanwhile)
                self._recover(err)

    def _finish_sync(self) -> None:
        if self._interrupted is not None:
            raise self._interrupted
        if self._session:
            if self.ranks.leads:
                self._post(
                    "/finish_weight_update",
                    {"weight_version": str(self.version + 1)},
                    "finish_weight_update",
                )
            self._session = False
            self.version += 1
        # salted: the new version's salt misses the old blocks
        if self.ranks.leads and not self.config.cache_salt:
            self._post("/reset_prefix_cache", {}, "reset_prefix_cache")
        if self.gate is None:
            self.ranks.barrier()  # no rank samples before the new weights landed
            self.check_current()  # on every rank
            return
        # the probe is a request too: the servers sample again, the gate stays shut
        if self.ranks.leads:
            self._post("/resume", {}, "resume")
        # failing, it fails the gate: the cut requests never continue on stale weights
        self.check_current()
        self.gate.open(self.version)

    def check_current(self) -> float | None:
        """Raise ``StaleEngineError`` unless every server holds the trainer's weights; the probes' max |error|."""
        check_version(self.clients, self.version)
        if self.reference is None:
            return None
        # once: every server must match the same trainer logprobs
        trainer = self.reference(self.probe_ids)
        self.last_probe_error = check_probe(
            self.clients,
            self.probe_ids,
            trainer,
            self._served(),
            self.probe_tolerance,
            self.version,
        )
        return self.last_probe_error

    @property
    def probe_tolerance(self) -> float:
        tol = self.config.probe_tolerance
        return (
            tol if tol is not None else (1e-3 if self.dtype == torch.float32 else 0.1)
        )

    def probe_logprobs(
        self, ids: Sequence[int] | None = None, server: int = 0
    ) -> list[float]:
        """Server ``server``'s ``log p(ids[i] | ids[:i])`` for i >= 1 (prompt logprobs bypass the prefix cache)."""
        return self.clients[server].probe(
            self.probe_ids if ids is None else ids, self._served()
        )

    def _post(self, path: str, body: dict, phase: str) -> None:
        """One phase on every server, concurrently; returns once each has answered (a failure names its URL)."""
        each(self.clients, lambda c: c.post(path, body, phase))
