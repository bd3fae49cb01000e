"""Cost of MoE routing replay as a share of the update: replay off vs ahead on one tiny Qwen3-MoE, side by side.

    .venv/bin/python -m bench.routing_replay            # 16 sequences x up to 96 completion tokens, n_mini 2 and 4
    .venv/bin/python -m bench.routing_replay --quick    # 8 x 48

What replay adds: the ahead pass stores each row's top-k indices (int16, [layers, tokens, k] over its own tokens),
and every training forward after mini-batch 0 lays its rows' records out as the chunk, recomputes the combine weights
of the replayed experts (a softmax gather) and counts flipped rows. Both modes run the same ahead pass (n_mini > 1),
so the difference is replay's own cost.
The two modes alternate on two modules built from the same folder, so machine load hits both alike; each figure is
the median over updates. ``overhead`` = (update with replay - update without) / update with replay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench.common import run_child, save, table

N_MINIS = [2, 4]


def child(n_mini: int, rows: int, completion: int, repeats: int) -> dict:
    import torch

    from lightning_grpo.batch import RolloutBatch
    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.timing import UPDATE
    from lightning_grpo.tiny.spec import TinyPolicySpec

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the machine is shared: one thread keeps wall time proportional to work done
    spec = TinyPolicySpec(arch="qwen3_moe", num_experts=8, experts_per_token=2, vocab_size=4096,
                          max_position_embeddings=completion + 64)  # hidden 128, 2 MoE layers
    modules = {}
    for mode in ("off", "ahead"):
        rl = GRPOConfig(batch_per_replica=rows, group_size=8, mini_batch_per_replica=rows // n_mini,
                        micro_batch_per_replica=rows // 4, routing_replay=mode)
        m = GRPOModule(policy=PolicyConfig(path="tiny:bench-moe", tiny=spec), rl=rl)
        m.configure_model()  # builds the policy and hooks its routers (outside a Trainer)
        m.policy.train()
        m.updater.attach(torch.optim.AdamW(m.policy.parameters(), lr=1e-5))
        modules[mode] = m

    def batch() -> RolloutBatch:
        prompt, width = 16, 16 + completion
        lengths = torch.randint(completion // 4, completion + 1, (rows,))
        pos = torch.arange(width)
        attn = pos < (prompt + lengths).unsqueeze(1)
        return RolloutBatch(input_ids=torch.randint(4, 4096, (rows, width)), attention_mask=attn,
                            completion_mask=attn & (pos >= prompt), advantages=torch.randn(rows),
                            rewards=torch.rand(rows), group_ids=torch.arange(rows) // 8, sample_ids=torch.arange(rows))

    for m in modules.values():
        m.updater.update(batch())  # warm-up and the one-shot probe
    seconds: dict[str, list[float]] = {"off": [], "ahead": []}
    route_bytes = 0
    for _ in range(repeats):
        b = batch()
        for mode, m in modules.items():
            with m.timer.phase(UPDATE):
                m.updater.update(b)
            seconds[mode].append(m.timer.columns()["time/update"])
        route_bytes = modules["ahead"].updater.ahead.records["routes"].nbytes()
    off, on = statistics.median(seconds["off"]), statistics.median(seconds["ahead"])
    return {"n_mini": n_mini, "update_off_s": off, "update_replay_s": on, "overhead": (on - off) / on,
            "route_bytes": route_bytes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", type=int)
    ap.add_argument("--rows", type=int)
    ap.add_argument("--completion", type=int)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    rows = a.rows or (8 if a.quick else 16)
    completion = a.completion or (48 if a.quick else 96)
    if a.child:
        print(json.dumps(child(a.child, rows, completion, a.repeats)))
        return
    results = [run_child("bench.routing_replay", "--child", str(n), "--rows", str(rows), "--completion",
                         str(completion), "--repeats", str(a.repeats)) for n in N_MINIS]
    print(f"routing replay, tiny Qwen3-MoE (8 experts, top-2), {rows} sequences x up to {completion} tokens")
    print(table(results, ["n_mini", "update_off_s", "update_replay_s", "overhead", "route_bytes"]))
    path = save("routing_replay", {"rows": rows, "completion": completion, "repeats": a.repeats, "results": results,
                                   "command": "python -m bench.routing_replay" + (" --quick" if a.quick else "")
                                   + (f" --repeats {a.repeats}" if a.repeats != 5 else "")})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
