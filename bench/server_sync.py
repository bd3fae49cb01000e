"""Weight sync into ``vllm serve`` (vLLM's RL API, lightning_grpo_shm backend) vs the in-process engine's reload.

    .venv/bin/python -m bench.server_sync                 # 8 layers, hidden 512 (~17M parameters, 66 MiB float32)
    .venv/bin/python -m bench.server_sync --quick         # 2 layers, hidden 256, 2 repeats

Three ways to move the same weights, interleaved within each repeat so machine load hits all alike (median shown):

- in-process: ``VLLMEngine.load_weights`` (``collective_rpc("reload_weights")``, tensors by reference);
- server/shm: ``VLLMServerEngine`` with each bucket written to /dev/shm as safetensors (same node);
- server/http: the same, bucket bytes base64 in the request body (any node).

A server sync includes its checks (``/weight_info`` and the logprob probe: one trainer forward and one server
request on 24 tokens); ``probe_ms`` is that part alone. Every sync is followed by the trainer-vs-engine logprob error.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch

from bench.common import save, table


def build(layers: int, hidden: int, folder: str):
    from lightning_grpo.policy import PolicyConfig, load_policy
    from lightning_grpo.rollout.server_config import ServerConfig
    from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine
    from lightning_grpo.rollout.vllm_server import VLLMServerEngine, sequence_logprobs
    from lightning_grpo.tiny.build import build_tiny_policy
    from lightning_grpo.tiny.spec import TinyPolicySpec

    spec = TinyPolicySpec(hidden_size=hidden, num_layers=layers, num_heads=hidden // 32, num_kv_heads=1,
                          intermediate_size=2 * hidden)
    path = build_tiny_policy(folder, spec)
    model, _ = load_policy(PolicyConfig(path=str(path)))
    reference = functools.partial(sequence_logprobs, model)
    server_cfg = ServerConfig(dtype="float32", enforce_eager=True, max_model_len=128, threads=1,
                              kv_cache_memory_bytes=16 << 20)
    start = time.perf_counter()
    server = VLLMServerEngine(path, server_cfg, reference=reference)
    server_s = time.perf_counter() - start
    http = VLLMServerEngine(path, ServerConfig(url=server.url, weight_transport="http", dtype="float32"),
                            reference=reference)
    start = time.perf_counter()
    inproc = VLLMEngine(path, VLLMConfig(dtype="float32", enforce_eager=True, max_model_len=128,
                                         kv_cache_memory_bytes=16 << 20))
    return model, {"in-process": inproc, "server/shm": server, "server/http": http}, server_s, time.perf_counter() - start


def inproc_error(model, engine, ids: list[int]) -> float:
    from vllm import SamplingParams

    from lightning_grpo.rollout.vllm_server import sequence_logprobs

    out = engine.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0]
    served = [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])]
    return max(abs(a - b) for a, b in zip(served, sequence_logprobs(model, ids)))


def measure(model, engines: dict, repeats: int) -> list[dict]:
    from lightning_grpo.rollout.weight_sync import push_weights

    times: dict[str, list[float]] = {m: [] for m in engines}
    probe: list[float] = []
    stats, errors = {}, {}
    for _ in range(repeats):
        for mode, engine in engines.items():
            with torch.no_grad():  # a fresh update each push, so every push moves new values
                for p in model.parameters():
                    p.mul_(1.001)
            stats[mode] = push_weights(model, engine)
            times[mode].append(stats[mode].seconds)
            if mode == "in-process":
                errors[mode] = inproc_error(model, engine, engines["server/shm"].probe_ids)
            else:
                errors[mode] = engine.last_probe_error
        start = time.perf_counter()
        engines["server/shm"].check_current()
        probe.append(time.perf_counter() - start)
    base = statistics.median(times["in-process"])
    rows = [{"mode": m, "MiB": stats[m].bytes / 2**20, "buckets": stats[m].n_buckets,
             "median_s": statistics.median(times[m]), "MiB_per_s": stats[m].bytes / 2**20 / statistics.median(times[m]),
             "x_in_process": statistics.median(times[m]) / base, "max_abs_logprob_err": errors[m]} for m in engines]
    return rows, 1e3 * statistics.median(probe)


def section(d: dict | None, md_table, load_range) -> str:
    """The docs/benchmarks.md section (rendered by bench/report.py)."""
    title = "## 3e. Weight sync into `vllm serve` (RL API, lightning_grpo_shm) vs the in-process reload"
    if not d:
        return f"{title}\n\nNot run."
    rows = {r["mode"]: r for r in d["rows"]}
    return "\n".join([
        title,
        "",
        (f"`python -m bench.server_sync --repeats {d['repeats']}`: a {d['layers']}-layer policy (hidden {d['hidden']}, "
         f"{d['parameters'] / 1e6:.1f}M parameters, float32) pushed with `push_weights` into an in-process vLLM engine "
         "and into a launched `vllm serve` (one thread) through vLLM's RL API, each bucket a safetensors file in "
         "/dev/shm (*shm*) or base64 in the request body (*http*, through a second client of the same server), modes "
         "alternating within each repeat, median reported. A server sync includes its checks (`/weight_info` and the "
         f"24-token logprob probe: {d['probe_ms']:.0f} ms of it). Server start {d['server_start_s']:.0f} s, "
         f"in-process engine build {d['in_process_build_s']:.0f} s.{load_range(d)}"),
        "",
        md_table(d["rows"], [("mode", "mode"), ("MiB", "MiB"), ("buckets", "buckets"), ("median_s", "median s"),
                             ("MiB_per_s", "MiB/s"), ("x_in_process", "x in-process"),
                             ("max_abs_logprob_err", "max abs logprob error")]),
        "",
        f"server/shm / in-process = **{rows['server/shm']['x_in_process']:.2f}x** "
        f"(without the probe: {(rows['server/shm']['median_s'] - d['probe_ms'] / 1e3) / rows['in-process']['median_s']:.2f}x); "
        f"server/http / in-process = **{rows['server/http']['x_in_process']:.1f}x**.",
    ])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 layers, hidden 256, 2 repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.repeats = 2, 256, 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process engine; the server child drops it
    with tempfile.TemporaryDirectory() as folder:
        model, engines, server_s, inproc_s = build(args.layers, args.hidden, folder)
        try:
            rows, probe_ms = measure(model, engines, args.repeats)
        finally:
            for engine in reversed(engines.values()):
                engine.close()
    n_params = sum(p.numel() for p in model.parameters())
    print(table(rows, list(rows[0])))
    print(f"\n{n_params / 1e6:.1f}M parameters; server sync / in-process = {rows[1]['x_in_process']:.2f}x (shm), "
          f"{rows[2]['x_in_process']:.2f}x (http); probe check {probe_ms:.0f} ms; "
          f"server start {server_s:.0f} s, in-process engine build {inproc_s:.0f} s")
    path = save("server_sync", {"layers": args.layers, "hidden": args.hidden, "parameters": n_params,
                                "repeats": args.repeats, "rows": rows, "probe_ms": probe_ms,
                                "server_start_s": server_s, "in_process_build_s": inproc_s})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
