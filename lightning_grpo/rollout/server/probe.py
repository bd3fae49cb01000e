"""The check after every weight sync: each server reports the weight version this run published, and its logprobs on
a fixed probe sequence match the trainer's within ``rollout.server.probe_tolerance``. A sync that did not land is an
error (``StaleEngineError``), never a quiet bias."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from lightning_grpo.rollout.server.client import ServerClient, each

PROBE_LENGTH = 24
"""Tokens in the probe sequence (logprobs of the last 23 are compared)."""


class StaleEngineError(RuntimeError):
    """The server does not hold the trainer's current weights (a sync did not land, or was skipped)."""


def probe_ids(model_path: Path) -> list[int]:
    """A fixed sequence spread over the vocabulary (the same every run)."""
    vocab = json.loads((model_path / "config.json").read_text())
    vocab = vocab.get("vocab_size") or vocab.get("text_config", {}).get("vocab_size")
    return [(7 * i + 3) % vocab for i in range(PROBE_LENGTH)]


def check_version(clients: Sequence[ServerClient], version: int) -> None:
    """Every server reports ``version`` (0: nothing published yet, anything goes)."""
    for client, reported in zip(clients, each(clients, ServerClient.weight_version)):
        if version and reported != str(version):
            raise StaleEngineError(
                f"the server at {client.url} reports weight version {reported!r} after this "
                f"run published version {version}: another client updated it, or it "
                "restarted"
            )


def check_probe(
    clients: Sequence[ServerClient],
    ids: Sequence[int],
    trainer: Sequence[float],
    served: str | None,
    tol: float,
    version: int,
) -> float:
    """Every server's probe logprobs within ``tol`` of the ``trainer``'s; the largest error (each client keeps its
    own in ``last_probe_error``)."""
    servers = each(clients, lambda c: c.probe(ids, served))
    for client, server in zip(clients, servers):
        client.last_probe_error = max(abs(a - b) for a, b in zip(server, trainer))
    for client in clients:
        if not client.last_probe_error <= tol:
            where = "" if len(clients) == 1 else f", server {client.url}"
            raise StaleEngineError(
                f"the server's logprobs on the probe sequence differ from the trainer's by "
                f"{client.last_probe_error:.3g} > rollout.server.probe_tolerance={tol:g} (weight version "
                f"{version}{where}): it does not hold the trainer's weights (a sync that did not land, a "
                "server of another model, or a dtype far from the trainer's: then raise probe_tolerance)"
            )
    return max(c.last_probe_error for c in clients)
