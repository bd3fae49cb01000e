"""``ServerClient``: one ``vllm serve`` behind ``VLLMServerEngine``: its URL, the child process when this run launched
it, and HTTP calls whose errors name the phase, the URL and (a launched child that died) its exit code and log.

The engine holds one client per server (``rollout.server.url`` as a list, or ``replicas``) and fans each call out
with ``each``: one thread per server, so a sync costs the slowest server, not their sum.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from lightning_grpo.rollout.server.http_json import (
    ConnectionLost,
    ServerError,
    ServerTimeout,
    request_json,
)
from lightning_grpo.rollout.server.process import ServerDied, ServerProcess
from lightning_grpo.rollout.server_config import ServerConfig

_T = TypeVar("_T")
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class ServerClient:
    """One server: ``post``/``get`` (timeout ``sync_timeout_s``), ``complete`` (``request_timeout_s``), ``probe``.

    Args:
        url: where it answers (``http://host:port``).
        config: the engine's ``ServerConfig`` (timeouts).
        process: the launched child, None for a server at a URL (then ``close`` leaves it running).
    """

    def __init__(
        self, url: str, config: ServerConfig, process: ServerProcess | None = None
    ) -> None:
        self.url = url
        self.config = config
        self.process = process
        self.model_name = ""
        """The name the server answers to (``/v1/models``); set by ``connect``."""
        self.requests = 0
        """Generation requests sent to this server (how ``generate`` spread the rows; counted by the engine)."""
        self.last_probe_error: float | None = None

    def connect(self) -> None:
        """Read the served model name (every request names it)."""
        self.model_name = self.get("/v1/models", "models")["data"][0]["id"]

    def weight_version(self) -> str:
        """What ``/weight_info`` reports (``str(version)`` after a sync; something else on a fresh server)."""
        return str(self.get("/weight_info", "weight_info")["weight_version"])

    def dtype(self) -> torch.dtype:
        """The weight dtype inside the server: the configured one, else read from ``/server_info`` (dev mode)."""
        if self.config.dtype != "auto":
            return _DTYPES[self.config.dtype]
        # the server's resolved config, as text
        text = json.dumps(self.get("/server_info", "server_info"))
        for name, dtype in _DTYPES.items():
            if (
                f"dtype=torch.{name}" in text
                or f'"dtype": "torch.{name}"' in text
                or f'"dtype": "{name}"' in text
            ):
                return dtype
        raise ServerError(
            f"could not read the model dtype from {self.url}/server_info; set rollout.server.dtype"
        )

    def complete(self, body: dict) -> dict:
        """One ``/v1/completions`` request (a generation: ``request_timeout_s``)."""
        try:
            return request_json(
                self.url,
                "/v1/completions",
                {"model": self.model_name, **body},
                self.config.request_timeout_s,
                "generate",
            )
        except ServerError as err:
            raise self.with_log(err, "generate") from None

    def probe(self, ids: Sequence[int], model: str | None = None) -> list[float]:
        """The server's ``log p(ids[i] | ids[:i])`` for i >= 1 (prompt logprobs: they bypass the prefix cache), from
        ``model`` (a loaded LoRA adapter's name; None = the served model)."""
        ids = list(ids)
        body = {
            "model": model or self.model_name,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
        }
        steps = self.post("/v1/completions", body, "probe")["choices"][0][
            "prompt_logprobs"
        ][1:]
        return [step[str(t)]["logprob"] for step, t in zip(steps, ids[1:])]

    def post(self, path: str, body: dict, phase: str) -> object:
        try:
            return request_json(self.url, path, body, self.config.sync_timeout_s, phase)
        except ServerError as err:
            raise self.with_log(err, phase) from None

    def get(self, path: str, phase: str) -> dict:
        try:
            return request_json(self.url, path, None, self.config.sync_timeout_s, phase)
        except ServerError as err:
            raise self.with_log(err, phase) from None

    def with_log(self, err: ServerError, phase: str) -> ServerError:
        """What a failed request means for a launched server: it exited (``ServerDied``: its exit code and log), or it
        runs and did not answer in time (the timeout's knob), or it runs and dropped the connection."""
        if self.process is None:
            return err
        # a request cut short may beat the exit by a moment; a server that answered (an HTTP status) or timed out is
        # not waited for (a vLLM without a route answers 404: 2 s lost at every start before)
        wait_s = 2.0 if isinstance(err, ConnectionLost) else 0.0
        if not self.process.alive(wait_s=wait_s):
            return ServerDied(self.process, phase)
        log = self.process.log_path
        if isinstance(err, ServerTimeout):
            knob = "request_timeout_s" if phase == "generate" else "sync_timeout_s"
            return ServerTimeout(
                f"{err} (rollout.server.{knob}); vllm serve is still running, hung or overloaded: "
                f"raise {knob}, or look at its log ({log})"
            )
        return type(err)(f"{err} (vllm serve still running; log: {log})")

    def close(self) -> None:
        """Stop a launched server (its whole process group); a server at a URL is left running."""
        if self.process is not None:
            self.process.stop()


def each(
    clients: Sequence[ServerClient], call: Callable[[ServerClient], _T]
) -> list[_T]:
    """``call(client)`` for every client, concurrently (one thread each); the results in client order.

    Every call runs to its end before the first failure is raised, so no server is left mid-phase unseen. A failure
    already names its server (``request_json`` errors carry the URL and the phase)."""
    if len(clients) == 1:  # the single-server path: no thread
        return [call(clients[0])]
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        futures = [pool.submit(call, c) for c in clients]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
    return [f.result() for f in futures]
