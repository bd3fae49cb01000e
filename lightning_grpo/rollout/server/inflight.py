"""In-flight weight updates (``rollout.server.inflight_updates``): a sync that does not wait for the requests in
flight, and the weight version of every token.

A sync pauses the servers with vLLM's ``/pause?mode=abort``: each running request ends where it is and its reply
carries the tokens sampled so far (``finish_reason: abort``). The weights are pushed and checked, ``/resume`` lets
the servers sample again, and each cut request continues as a new request whose prompt is the old prompt plus its
tokens so far, under the new weights (vLLM re-reads that prefix with them: no key or value of the old weights is
reused). So the tokens before the cut were sampled by the old version and those after it by the new one, whole
context included, and each token's sampler logprob is the one of the weights that sampled it.

Why not ``mode=keep``: it keeps the requests inside the server, but nothing in a reply says which of its tokens came
before the pause (a reply comes whole; a streamed one arrives an unknown moment after its token was sampled), so the
per-token versions would be a guess by timing. And it keeps the old weights' keys and values of the tokens so far,
so the tokens after the resume would be sampled by neither version.

The one race left is a request sent just before a sync: one that reached the server after the pause would wait there
and run under the new weights, recorded as the old. ``Gate`` closes it: requests stream, a request counts as running
once its first chunk arrived, and a sync pauses only once every request sent is running (or answered).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable

from lightning_grpo.rollout.sampler import sample_seed
from lightning_grpo.rollout.server.client import ServerClient
from lightning_grpo.rollout.server.http_json import (
    ConnectionLost,
    ServerError,
    ServerTimeout,
)


class Gate:
    """Who may send a generation request now, and under which weight version.

    Args:
        version: the weight version the servers hold (``VLLMServerEngine.version``).
    """

    def __init__(self, version: int) -> None:
        self.version = version
        self._cond = threading.Condition()
        self._closed = False
        self._unconfirmed = 0
        self._error: BaseException | None = None

    def enter(self) -> int:
        """Wait while a sync runs; then count one request sent and not yet running. Returns the version it runs with."""
        with self._cond:
            while self._closed:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            self._unconfirmed += 1
            return self.version

    def confirm(self) -> None:
        """The request entered last by this thread is running on the server (its first chunk arrived), or ended."""
        with self._cond:
            self._unconfirmed -= 1
            self._cond.notify_all()

    def close(self, timeout: float) -> None:
        """No request is sent from now on, and every one sent is running: the pause that follows cuts them all."""
        with self._cond:
            self._closed = True
            if not self._cond.wait_for(self._all_running, timeout):
                raise ServerTimeout(
                    f"pause: {self._unconfirmed} generation request(s) were not running on the server "
                    f"after {timeout:g}s (rollout.server.sync_timeout_s)"
                )

    def _all_running(self) -> bool:
        """Every request sent is running on the server (or ended); called under ``_cond``."""
        return self._unconfirmed == 0

    def open(self, version: int) -> None:
        """The sync ended: requests go out again, under ``version``."""
        with self._cond:
            self.version = version
            self._closed = False
            self._cond.notify_all()

    def fail(self, err: BaseException) -> None:
        """The sync failed: every request waiting to go out raises ``err`` (the run stops with it)."""
        with self._cond:
            self._error = err
            self._closed = False
            self._cond.notify_all()


@contextlib.contextmanager
def fails_gate(gate: Gate | None):
    """A sync that fails fails ``gate`` too (None: in-flight updates off), so the requests it cut raise its error
    instead of waiting for a resume that never comes."""
    try:
        yield
    except BaseException as err:
        if gate is not None:
            gate.fail(err)
        raise


def complete_in_flight(
    client: ServerClient, body: dict, gate: Gate, salt: Callable[[int], dict]
) -> dict:
    """One row's completion, continued across every sync that cut it. Returns the reply ``generate`` reads (tokens,
    text, finish reason, sampler logprobs) plus ``versions``: the weight version that sampled each token.

    Segment 0 carries the row's own seed (without a cut: the tokens of the plain path); continuation ``i`` a seed
    drawn from it and ``i``, so a run repeats wherever its cuts fall."""
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    texts: list[str] = []
    segment = 0
    while True:
        version = gate.enter()
        seed = body["seed"] if segment == 0 else sample_seed(body["seed"], -1, segment)
        part = {
            **body,
            "prompt": list(body["prompt"]) + tokens,
            "max_tokens": body["max_tokens"] - len(tokens),
            "seed": seed,
            **salt(version),
        }
        try:
            ids, lps, text, finish = stream_completion(
                client.url,
                {"model": client.model_name, **part},
                gate.confirm,
                client.config.request_timeout_s,
            )
        except ServerError as err:
            raise client.with_log(err, "generate") from None
        tokens += ids
        logprobs += lps
        versions += [version] * len(ids)
        texts.append(text)
        if finish != "abort":
            break
        # cut after its last token: it is complete
        if len(tokens) >= body["max_tokens"]:
            finish = "length"
            break
        segment += 1
    choice = {
        "token_ids": tokens,
        "text": "".join(texts),
        "finish_reason": finish,
        "segments": segment + 1,
        "logprobs": {"token_logprobs": logprobs},
        "versions": versions,
    }
    return {"choices": [choice]}


def stream_completion(
    url: str, body: dict, on_first: Callable[[], None], timeout: float
) -> tuple[list[int], list[float], str, str]:
    """One streamed ``/v1/completions`` request: (token ids, sampler logprobs, text, finish reason). ``on_first`` runs
    once, when the first chunk arrives or the request fails."""
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    ids = []
    lps = []
    text = []
    finish = None
    confirmed = False
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            for line in reply:
                if not confirmed:
                    on_first()
                    confirmed = True
                chunk = _chunk(line)
                if chunk is None:
                    continue
                choice = chunk["choices"][0]
                ids += choice.get("token_ids") or []
                lps += (choice.get("logprobs") or {}).get("token_logprobs") or []
                text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        raise ServerError(
            f"generate: {url}/v1/completions answered HTTP {err.code}: {detail}"
        ) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
        if isinstance(getattr(err, "reason", err), TimeoutError):
            raise ServerTimeout(
                f"generate: {url}/v1/completions did not answer within {timeout:g}s"
            ) from None
        raise ConnectionLost(
            f"generate: the stream from {url}/v1/completions broke ({err})"
        ) from None
    finally:
        if not confirmed:
            on_first()
    # vLLM sends no chunk for a request cut before its first token
    if finish is None and not ids:
        finish = "abort"
    if finish is None:
        raise ServerError(
            f"generate: the stream from {url}/v1/completions ended without a finish reason"
        )
    return ids, lps, "".join(text), finish


def _chunk(line: bytes) -> dict | None:
    """One server-sent event's JSON (None: a blank line or the final ``[DONE]``); an error event raises."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return None
    chunk = json.loads(data)
    if "error" in chunk:
        raise ServerError(f"generate: the server reported {chunk['error']}")
    return chunk


def check_pausable(client: ServerClient) -> None:
    """Refuse, naming the knob, a server without vLLM's ``/pause`` and ``/resume`` routes (vLLM 0.32 serves them under
    ``VLLM_SERVER_DEV_MODE=1``)."""
    try:
        client.get("/is_paused", "is_paused")
    except ServerError as err:
        raise ServerError(
            f"rollout.server.inflight_updates=True: the server at {client.url} cannot pause generation "
            f"({err}); start it with VLLM_SERVER_DEV_MODE=1 on a vLLM that serves /pause and /resume "
            "(0.32 does), or set rollout.server.inflight_updates: false"
        ) from None
