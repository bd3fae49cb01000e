"""Cost of the frozen-pi_old ahead pass as a share of the update, at n_mini in {2, 4, 8}, with and without the
mini-batch-0 skip.

    .venv/bin/python -m bench.ahead_pass            # 16 sequences x up to 96 completion tokens, vocab 8192
    .venv/bin/python -m bench.ahead_pass --quick    # 8 x 48, for a fast look

The reference design pays one extra no-grad forward over the whole batch (~1/3 of a step).
Once the determinism probe has passed we skip mini-batch 0 (trained before any update, so its
pi_old is its current logprobs detached), which removes 1/n_mini of that forward.

Each n_mini runs in a fresh process. Chunks hold the same rows at every n_mini (n_micro = mini / chunk),
so only the number of optimizer steps changes. One warm-up update (it runs the probe) is not timed;
then the skip and full-walk updates alternate on the same module, so machine load hits both alike, and
each figure is the median over updates. ``share`` = ahead seconds / update seconds (ahead pass + training walk). The rollout is left out, so
against a whole loop step (generation included) the share is smaller still.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench.common import pyplot, run_child, save, table

N_MINIS = [2, 4, 8]
REFERENCE_SHARE = 1 / 3


def child(n_mini: int, rows: int, completion: int, vocab: int, chunk_rows: int, repeats: int) -> dict:
    import torch

    from lightning_grpo.batch import RolloutBatch
    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.timing import AHEAD, UPDATE
    from lightning_grpo.tiny.spec import TinyPolicySpec

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the machine is shared: one thread keeps wall time proportional to work done
    spec = TinyPolicySpec(vocab_size=vocab, max_position_embeddings=completion + 64)  # hidden 128, 2 layers
    rl = GRPOConfig(batch_per_replica=rows, group_size=8, mini_batch_per_replica=rows // n_mini,
                    micro_batch_per_replica=chunk_rows)
    module = GRPOModule(policy=PolicyConfig(path="tiny:bench-ahead", tiny=spec), rl=rl)
    module.configure_model()  # the policy, in train mode as under a Trainer
    module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=1e-5))

    def batch() -> RolloutBatch:
        prompt, width = 16, 16 + completion
        lengths = torch.randint(completion // 4, completion + 1, (rows,))  # unequal, like real completions
        pos = torch.arange(width)
        attn = pos < (prompt + lengths).unsqueeze(1)
        return RolloutBatch(input_ids=torch.randint(4, vocab, (rows, width)), attention_mask=attn,
                            completion_mask=attn & (pos >= prompt), advantages=torch.randn(rows),
                            rewards=torch.rand(rows), group_ids=torch.arange(rows) // 8, sample_ids=torch.arange(rows))

    module.updater.update(batch())  # warm-up: allocator, kernels, and the one-shot probe
    timings: dict[bool, list[tuple[float, float]]] = {True: [], False: []}  # skip -> [(ahead s, update s)]
    for _ in range(repeats):
        for skip in (True, False):
            module.updater.ahead.skip_first_mini = skip
            timer = module.timer  # the module's step timer: the updater times its ahead pass there
            with timer.phase(UPDATE):
                module.updater.update(batch())
            timings[skip].append((timer.seconds(AHEAD), timer.seconds(UPDATE)))
            timer.columns()  # the next update starts from 0
    return {"rows": [_summary(n_mini, skip, t) for skip, t in timings.items()]}


def _summary(n_mini: int, skip: bool, timings: list[tuple[float, float]]) -> dict:
    """Median over updates: a neighbour's burst of load on a shared machine hits single updates, not the median."""
    shares = sorted(a / u for a, u in timings)
    ratios = sorted(a / (u - a) for a, u in timings)
    return {"n_mini": n_mini, "skip_mini0": skip, "ahead_s": statistics.median(a for a, _ in timings),
            "update_s": statistics.median(u for _, u in timings), "share": statistics.median(shares),
            "share_min": shares[0], "share_max": shares[-1], "ahead_over_train": statistics.median(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", type=int)
    ap.add_argument("--rows", type=int)
    ap.add_argument("--completion", type=int)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rows = a.rows or (8 if a.quick else 16)
    completion = a.completion or (48 if a.quick else 96)
    chunk_rows = rows // max(N_MINIS)  # the same chunk at every n_mini
    if a.child:
        print(json.dumps(child(a.child, rows, completion, a.vocab, chunk_rows, a.repeats)))
        return
    results = []
    for n in N_MINIS:
        results += run_child("bench.ahead_pass", "--child", str(n), "--rows", str(rows), "--completion",
                             str(completion), "--vocab", str(a.vocab), "--repeats", str(a.repeats))["rows"]
    print(f"ahead pass, {rows} sequences x up to {completion} completion tokens, vocab {a.vocab}, "
          f"{chunk_rows} rows per chunk; reference design ~{REFERENCE_SHARE:.2f} of a step")
    print(table(results, ["n_mini", "skip_mini0", "ahead_s", "update_s", "share", "share_min", "share_max",
                          "ahead_over_train"]))
    path = save("ahead_pass", {"rows": rows, "completion": completion, "vocab": a.vocab, "chunk_rows": chunk_rows,
                               "repeats": a.repeats, "reference_share": REFERENCE_SHARE, "results": results,
                               "command": "python -m bench.ahead_pass" + (" --quick" if a.quick else "")})
    plot(results, path.with_suffix(".png"), f"{rows} x {completion} tokens, vocab {a.vocab}")
    print(f"wrote {path}", file=sys.stderr)


def plot(results: list[dict], path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for skip, style, label in ((False, "s--", "full walk (reference design)"), (True, "o-", "mini-batch 0 skipped")):
        pts = [r for r in results if r["skip_mini0"] is skip]
        ax.plot([r["n_mini"] for r in pts], [r["share"] for r in pts], style, label=label)
    ax.axhline(REFERENCE_SHARE, color="grey", lw=0.8, ls=":", label="reference: ~1/3 of a step")
    ax.set_xscale("log", base=2)
    ax.set_xticks(N_MINIS, [str(n) for n in N_MINIS])
    ax.set_ylim(0, 0.5)
    ax.set_xlabel("n_mini (optimizer steps per collected batch)")
    ax.set_ylabel("ahead pass / update time")
    ax.set_title(f"Frozen pi_old: ahead-pass share of the update\n{title}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
