"""A server must run the policy's model: the same vocabulary, width and depth as the policy folder's ``config.json``.

Checked once, when the engine connects, so a ``rollout.server.url`` that serves another model is refused at setup
with both shapes side by side, not at the first sync (a shape error deep in vLLM's weight loader) or, worse, never
(a server of another model with the same shapes would only show in the probe after the first sync).

What the server runs comes from vLLM's dev-mode ``/collective_rpc`` route calling the worker's
``get_model_inspection`` (vLLM 0.32): a transformers-style view of the loaded model, repeated layers collapsed
(``(0-27): 28 x Qwen2DecoderLayer``), a few KB even for a large model. The first ``VocabParallelEmbedding`` gives the
vocabulary (``org_vocab_size``, before vLLM's padding) and the width (``embedding_dim``, tensor-parallel or not); the
first ``(layers): ModuleList`` gives the depth.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from lightning_grpo.rollout.server.client import ServerClient
from lightning_grpo.rollout.server.http_json import ServerError

_EMBEDDING = re.compile(
    r"VocabParallelEmbedding\(num_embeddings=\d+.*?embedding_dim=(\d+).*?org_vocab_size=(\d+)"
)
_ENTRY = re.compile(r"^( *)\((\d+)(?:-(\d+))?\): ")


def policy_shape(model_path: Path) -> dict[str, int | None]:
    """vocab_size, hidden_size, num_hidden_layers of the policy folder (a vision-language config: its text model)."""
    config = json.loads((model_path / "config.json").read_text())
    text = config.get("text_config") or {}
    return {
        k: config.get(k) or text.get(k)
        for k in ("vocab_size", "hidden_size", "num_hidden_layers")
    }


def served_shape(inspection: str) -> dict[str, int | None]:
    """The same three numbers read from a ``get_model_inspection`` view (None where the view does not show one)."""
    embedding = _EMBEDDING.search(inspection)
    return {
        "vocab_size": int(embedding.group(2)) if embedding else None,
        "hidden_size": int(embedding.group(1)) if embedding else None,
        "num_hidden_layers": _count_layers(inspection.splitlines()),
    }


def _count_layers(lines: list[str]) -> int | None:
    """Entries directly under the first ``(layers): ModuleList``: ``(0-27): 28 x`` counts 28, ``(3): ...`` one."""
    start = next(
        (i for i, line in enumerate(lines) if "(layers): ModuleList" in line), None
    )
    if start is None:
        return None
    indent = len(lines[start]) - len(lines[start].lstrip()) + 2
    count = 0
    for line in lines[start + 1 :]:
        depth = len(line) - len(line.lstrip())
        if depth < indent:
            break
        entry = _ENTRY.match(line)
        if entry and depth == indent:
            first = int(entry.group(2))
            last = int(entry.group(3) or entry.group(2))
            count += last - first + 1
    return count


def check_same_model(client: ServerClient, model_path: Path) -> None:
    """Refuse a server whose model differs from the policy folder's in vocabulary, width or depth."""
    try:
        reply = client.post(
            "/collective_rpc", {"method": "get_model_inspection"}, "model_inspection"
        )
    except ServerError as err:
        if "HTTP 404" in str(err):
            # a vLLM without the route: the probe after each sync is the remaining check
            return
        raise
    inspection = str((reply or {}).get("results", [""])[0])
    mine = policy_shape(model_path)
    theirs = served_shape(inspection)
    differ = [
        f"{k} {theirs[k]} (policy: {mine[k]})"
        for k in mine
        if mine[k] is not None and theirs[k] is not None and mine[k] != theirs[k]
    ]
    if differ:
        served = inspection.split("(", 1)[0] or "a model"
        raise ServerError(
            f"rollout.server.url: the server at {client.url} runs {served} with {', '.join(differ)}; "
            f"it serves another model than the policy folder {model_path}. Start it on that folder "
            "(or a copy of it), or drop it from rollout.server.url"
        )
