"""The rollout/ tier's shared parts: a stub ``vllm serve`` on loopback for the server client and the weight sync.

``StubServer`` answers the routes ``VLLMServerEngine`` calls (health, models, weight info, vLLM 0.32's weight-update
session, completions with prompt logprobs) from a toy float64 language model (tests/toy.py) whose weights the sync
really replaces, so a probe after a sync measures whether the pushed weights landed. Switches make it misbehave the
ways a real server does: drop the pushed weights, report another weight version, answer one route too late, die.

It streams completions (``stream: true``: a chunk per token, as vLLM does) and pauses as vLLM 0.32's ``/pause?mode=
abort`` does: a request running at the pause ends there with the tokens it has (``finish_reason: abort``), one that
arrives while paused waits for ``/resume``, and no token is sampled from ``/pause``'s answer until ``/resume``. Each
token is sampled from the whole context under the weights held at that moment (no key-value cache), as vLLM samples
a continuation request whose prefix it re-reads under the new weights.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import load, load_file
from toy import VOCAB, ToyLM


class StubServer:
    """A stub ``vllm serve`` on 127.0.0.1 (a free port); ``phases`` lists the routes called, in order."""

    def __init__(self, seed: int = 1) -> None:
        self.model = ToyLM(seed)
        self.phases: list[str] = []
        self.bodies: list[tuple[str, dict | None]] = []
        """(route, JSON body) of every request but the streamed ones, in order."""
        self.version = "0"
        self.drop_updates = False
        """Answer /update_weights without loading the weights (a sync that did not land)."""
        self.report_version: str | None = None
        """/weight_info reports this instead of the version the last sync finished with."""
        self.slow: dict[str, float] = {}
        """Route -> seconds to sleep before answering (a timeout)."""
        self.token_delay = 0.0
        """Seconds before each streamed token (a long generation a sync lands in)."""
        self.tokens_sampled = 0
        self.stall_after: int | None = None
        """A request that sampled this many tokens waits for the next pause (up to 10 s; the pause clears it): a sync
        lands mid-completion whatever the machine's speed."""
        self.paused = False
        self._epoch = 0
        """One more per pause: a request that started under an older one is cut at its next token."""
        self._pause = threading.Condition()
        self._step = threading.Lock()
        """One token or one weight load at a time: a token is sampled by one set of weights."""
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.alive = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def die(self) -> None:
        """Stop answering: every later request is refused."""
        if self.alive:
            self.alive = False
            self.http.shutdown()
            self.http.server_close()

    # -- the routes ------------------------------------------------------------------------------------------------
    def answer(self, path: str, body: dict | None) -> tuple[int, object]:
        path, _, query = path.partition("?")
        self.phases.append(path)
        self.bodies.append((path, body))
        time.sleep(self.slow.get(path, 0.0))
        if path in ("/pause", "/resume", "/is_paused"):
            return self.pause_route(path, query)
        if path == "/health":
            return 200, {}
        if path == "/v1/models":
            return 200, {"data": [{"id": "policy"}]}
        if path == "/weight_info":
            return 200, {"weight_version": self.report_version or self.version}
        if path == "/update_weights":
            return 200, self.load(body["update_info"])
        if path == "/finish_weight_update":
            self.version = body["weight_version"]
            return 200, {}
        if path in ("/init_weight_transfer_engine", "/start_weight_update", "/reset_prefix_cache"):
            return 200, {}
        if path == "/v1/completions":
            return 200, self.complete(body)
        return 404, {"detail": "Not Found"}

    def load(self, info: dict) -> dict:
        if "data" in info:
            tensors = load(base64.b64decode(info["data"]))
        else:
            tensors = load_file(info["path"])
        if not self.drop_updates:
            with self._step:
                self.model.load_state_dict(tensors, strict=False)
        return {}

    def pause_route(self, path: str, query: str) -> tuple[int, object]:
        if path == "/is_paused":
            return 200, {"is_paused": self.paused}
        if path == "/resume":
            with self._pause:
                self.paused = False
                self._pause.notify_all()
            return 200, {"status": "resumed"}
        if "mode=abort" not in query:
            return 400, {"error": f"the stub pauses in mode=abort only, not {query!r}"}
        with self._pause:
            self.paused = True
            self._epoch += 1
            self.stall_after = None  # one stall: the requests after this pause run through
            self._pause.notify_all()
        with self._step:  # the token being sampled ends first: none is sampled after this answer
            pass
        return 200, {"status": "paused"}

    def stream(self, body: dict, emit) -> None:
        """A streamed completion: one chunk per token; a pause cuts it (vLLM's ``mode=abort``)."""
        self.phases.append("/v1/completions")
        with self._pause:
            while self.paused:  # arrived while paused: waits for /resume, as vLLM queues it
                self._pause.wait()
            epoch = self._epoch
        ids = list(body["prompt"])
        gen = torch.Generator().manual_seed(body["seed"])
        for i in range(body["max_tokens"]):
            time.sleep(self.token_delay)
            if i == self.stall_after:
                with self._pause:
                    self._pause.wait_for(lambda: self._epoch != epoch, timeout=10.0)
            with self._step:
                if self._epoch != epoch:
                    emit({"choices": [{"text": "", "token_ids": [], "finish_reason": "abort"}]})
                    return
                with torch.no_grad():
                    logp = torch.log_softmax(self.model(torch.tensor([ids]))[0, -1], -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=gen))
                self.tokens_sampled += 1
            ids.append(token)
            finish = "length" if i == body["max_tokens"] - 1 else None
            emit({"choices": [{"text": f"{token} ", "token_ids": [token], "finish_reason": finish,
                               "logprobs": {"token_logprobs": [float(logp[token])]}}]})

    def complete(self, body: dict) -> dict:
        ids = list(body["prompt"])
        if body.get("prompt_logprobs") is not None:  # the probe: log p(ids[i] | ids[:i])
            logp = self.logprobs(ids)
            steps = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(ids[1:], logp)]
            return {"choices": [{"prompt_logprobs": steps, "token_ids": [], "text": "", "finish_reason": "length"}]}
        gen = torch.Generator().manual_seed(body["seed"])
        out, lps = [], []
        for _ in range(body["max_tokens"]):  # sampled at temperature 1 from the stub's weights
            with torch.no_grad():
                logp = torch.log_softmax(self.model(torch.tensor([ids + out]))[0, -1], -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=gen))
            out.append(token)
            lps.append(float(logp[token]))
        choice = {"token_ids": out, "text": " ".join(map(str, out)), "finish_reason": "length",
                  "logprobs": {"token_logprobs": lps}}
        return {"choices": [choice]}

    def logprobs(self, ids: list[int]) -> list[float]:
        with torch.no_grad():
            logp = torch.log_softmax(self.model(torch.tensor([ids]))[0, :-1], -1)
        return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def _handler(stub: StubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.reply(*stub.answer(self.path, None))

        def do_POST(self) -> None:
            size = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(size) or b"{}")
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
                stub.stream(body, self.event)
                self.wfile.write(b"data: [DONE]\n\n")
                return
            self.reply(*stub.answer(self.path, body))

        def event(self, chunk: dict) -> None:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        def reply(self, code: int, payload: object) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up (a timeout test): nothing to answer
                pass

        def log_message(self, *args) -> None:
            pass

    return Handler


@pytest.fixture
def stub_server():
    """A fresh stub server per test (a ToyLM of seed 1: other weights than the trainer's seed 0)."""
    stub = StubServer()
    yield stub
    stub.die()


@pytest.fixture
def policy_folder(tmp_path):
    """What the engine reads of the policy folder: its ``config.json`` (the probe's vocabulary)."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return tmp_path
