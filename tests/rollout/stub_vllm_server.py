"""A stand-in for ``vllm serve`` on loopback, run as a child process by tests/rollout/test_server_restarts.py.

It answers the routes ``VLLMServerEngine`` uses, holds a weight version and "weights" (the logprob its probe returns:
-2.0 as loaded from the folder, -1.0 once a sync finished), and journals every request to a file. A fault is armed
with ``--die-at ROUTE:N`` (SIGKILL itself on the N-th request to ROUTE, before answering) or ``--hang-at ROUTE``
(never answer it). With ``--once FILE`` the fault fires in the first child only: a restarted one runs clean (or,
with ``--exit-on-restart``, exits at start-up with code 3).

    python stub_vllm_server.py --port 8000 --journal /tmp/j [--die-at update_weights:2 --once /tmp/fired]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

STATE = {"version": "fresh", "lp": -2.0, "lp_pending": -2.0}
COUNTS: dict[str, int] = {}
LOCK = threading.Lock()


def route_of(path: str, body: dict | None) -> str:
    name = path.strip("/").split("/")[-1]
    if name == "completions":
        return "probe" if body and body.get("prompt_logprobs") is not None else "generate"
    return name


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.answer(None)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        self.answer(json.loads(self.rfile.read(length) or b"null"))

    def answer(self, body: dict | None) -> None:
        route = route_of(self.path, body)
        with LOCK:  # requests arrive concurrently: each gets its own number
            COUNTS[route] = n = COUNTS.get(route, 0) + 1
            with open(ARGS.journal, "a") as f:
                f.write(f"{os.getpid()} {route}\n")
        self.fault(route, n)
        reply = reply_to(route, body)
        if reply is None:
            self.send_response(404)
            self.end_headers()
            return
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def fault(self, route: str, n: int) -> None:
        armed = ARGS.once is None or not Path(ARGS.once).exists()
        if not armed:
            return
        if ARGS.hang_at == route:
            time.sleep(3600)
        target = ARGS.die_at if ARGS.die_at is None or ":" in ARGS.die_at else f"{ARGS.die_at}:1"
        if target == f"{route}:{n}":
            if ARGS.once is not None:
                Path(ARGS.once).touch()
            os.kill(os.getpid(), signal.SIGKILL)


def reply_to(route: str, body: dict | None) -> dict | None:
    if route in ("health", "init_weight_transfer_engine", "update_weights", "reset_prefix_cache"):
        return {}
    if route == "start_weight_update":
        STATE["lp_pending"] = STATE["lp"]
        return {}
    if route == "finish_weight_update":
        STATE["version"] = body["weight_version"]
        STATE["lp"] = -1.0  # the trainer's weights landed
        return {}
    if route == "weight_info":
        return {"weight_version": STATE["version"]}
    if route == "models":
        return {"data": [{"id": "policy"}]}
    if route == "probe":
        ids = body["prompt"]
        return {"choices": [{"prompt_logprobs": [None] + [{str(t): {"logprob": STATE["lp"]}} for t in ids[1:]]}]}
    if route == "generate":
        tokens = [(body["seed"] + i) % 50 for i in range(body["max_tokens"])]
        return {"choices": [{"token_ids": tokens, "text": "", "finish_reason": "length",
                             "logprobs": {"token_logprobs": [STATE["lp"]] * len(tokens)}}]}
    if route == "collective_rpc" and ARGS.wrong_model:  # another model's inspection: a vocabulary of 999
        return {"results": ["Qwen2ForCausalLM(\n  (embed_tokens): VocabParallelEmbedding(num_embeddings=999, "
                            "embedding_dim=8, org_vocab_size=999)"]}
    return None  # collective_rpc and the rest: 404, as a vLLM without the route


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--journal", required=True)
    parser.add_argument("--die-at", default=None)
    parser.add_argument("--hang-at", default=None)
    parser.add_argument("--once", default=None)
    parser.add_argument("--exit-on-restart", action="store_true")
    parser.add_argument("--wrong-model", action="store_true")
    ARGS = parser.parse_args()
    if ARGS.exit_on_restart and ARGS.once is not None and Path(ARGS.once).exists():
        print("stub: exiting at start-up", flush=True)
        raise SystemExit(3)
    ThreadingHTTPServer.allow_reuse_address = True
    ThreadingHTTPServer((ARGS.host, ARGS.port), Handler).serve_forever()
