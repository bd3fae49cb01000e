"""The rollout/ tier's shared parts: a stub ``vllm serve`` on loopback for the server client and the weight sync.

``StubServer`` answers the routes ``VLLMServerEngine`` calls (health, models, weight info, vLLM 0.32's weight-update
session, completions with prompt logprobs) from a toy float64 language model (tests/toy.py) whose weights the sync
really replaces, so a probe after a sync measures whether the pushed weights landed. Switches make it misbehave the
ways a real server does: drop the pushed weights, report another weight version, answer one route too late, die.
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
        self.version = "0"
        self.drop_updates = False
        """Answer /update_weights without loading the weights (a sync that did not land)."""
        self.report_version: str | None = None
        """/weight_info reports this instead of the version the last sync finished with."""
        self.slow: dict[str, float] = {}
        """Route -> seconds to sleep before answering (a timeout)."""
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
        self.phases.append(path)
        time.sleep(self.slow.get(path, 0.0))
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
            self.model.load_state_dict(tensors, strict=False)
        return {}

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
            self.reply(*stub.answer(self.path, json.loads(self.rfile.read(size) or b"{}")))

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
