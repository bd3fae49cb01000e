"""Cost of the OPD teacher: the teacher's scoring as a share of the update, for both KL forms and two teacher sizes,
with a GRPO update on the same batch as the baseline.

    .venv/bin/python -m bench.teacher_cost            # 16 sequences x up to 96 completion tokens, vocab 8192
    .venv/bin/python -m bench.teacher_cost --quick    # 8 x 48

Teacher time is every call into the teacher, timed where it happens: its forward over the batch (hidden
states, or token logprobs for the sampled form) and, for the full KL, its LM head over each chunk of
completion positions, which runs in the forward and again in backward's recompute (the checkpointed chunk
keeps no logits). ``share`` = teacher seconds / update seconds (the whole OPD update); ``vs_grpo`` = OPD
update / GRPO update on the same batch and student. One thread, medians over repeats, all in one process
so every figure is measured side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

from bench.common import pyplot, save, table

STUDENT = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}
TEACHERS = {
    "same": STUDENT,
    "4x": {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 512},
}


class _Timed:
    """Adds the wall time of every call of ``obj.name`` to ``self.seconds``."""

    def __init__(self, obj, names) -> None:
        self.seconds = 0.0
        for name in names:
            real = getattr(obj, name)

            def timed(*args, _real=real, **kwargs):
                start = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start

            setattr(obj, name, timed)


def build(kind: str, teacher_spec: dict | None, kl: str, rows: int, completion: int, vocab: int):
    import torch

    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.objectives.opd import OPDConfig
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.tiny.spec import TinyPolicySpec

    base = TinyPolicySpec(vocab_size=vocab, max_position_embeddings=completion + 64)
    student = PolicyConfig(path="tiny:bench-student", tiny=replace(base, **STUDENT))
    rl = GRPOConfig(batch_per_replica=rows, group_size=8, micro_batch_per_replica=rows // 2)
    if kind == "grpo":
        module = GRPOModule(policy=student, rl=rl)
    else:
        teacher = PolicyConfig(path="tiny:bench-teacher", tiny=replace(base, **teacher_spec, seed=1))
        module = GRPOModule(policy=student, rl=rl, objective="opd", opd=OPDConfig(teacher=teacher, kl=kl))
    module.configure_model()
    module.updater.attach(torch.optim.AdamW(module.policy.parameters(), lr=1e-5))
    return module


def batch(rows: int, completion: int, vocab: int, seed: int):
    import torch

    from lightning_grpo.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompt, width = 16, 16 + completion
    lengths = torch.randint(completion // 4, completion + 1, (rows,), generator=g)  # unequal, like real completions
    pos = torch.arange(width)
    attn = pos < (prompt + lengths).unsqueeze(1)
    return RolloutBatch(input_ids=torch.randint(4, vocab, (rows, width), generator=g), attention_mask=attn,
                        completion_mask=attn & (pos >= prompt), advantages=torch.randn(rows, generator=g),
                        rewards=torch.rand(rows, generator=g), group_ids=torch.arange(rows) // 8,
                        sample_ids=torch.arange(rows))


def measure(rows: int, completion: int, vocab: int, repeats: int) -> list[dict]:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the machine is shared: one thread keeps wall time proportional to work done
    arms = [("grpo", None, "-")] + [("opd", t, kl) for t in TEACHERS for kl in ("sampled", "full")]
    modules = {arm: build(arm[0], TEACHERS.get(arm[1]), arm[2], rows, completion, vocab) for arm in arms}
    timers = {arm: _Timed(m.objective.teacher, ("token_logprobs", "completion_hidden", "distribution"))
              for arm, m in modules.items() if arm[0] == "opd"}
    for m in modules.values():
        m.updater.update(batch(rows, completion, vocab, seed=0))  # warm-up
    runs: dict = {arm: [] for arm in arms}
    for r in range(repeats):  # the arms alternate, so machine load hits them alike
        for arm, module in modules.items():
            timer = timers.get(arm)
            before = timer.seconds if timer else 0.0
            start = time.perf_counter()
            module.updater.update(batch(rows, completion, vocab, seed=r + 1))
            runs[arm].append((time.perf_counter() - start, (timer.seconds - before) if timer else 0.0))
    grpo = statistics.median(u for u, _ in runs[arms[0]])
    out = []
    for (kind, teacher, kl), timings in runs.items():
        update = statistics.median(u for u, _ in timings)
        out.append({"objective": kind, "teacher": teacher or "-", "kl": kl, "update_s": update,
                    "teacher_s": statistics.median(t for _, t in timings),
                    "share": statistics.median(t / u for u, t in timings), "vs_grpo": update / grpo})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rows, completion = (8, 48) if a.quick else (16, 96)
    results = measure(rows, completion, a.vocab, a.repeats)
    print(f"OPD teacher cost, {rows} sequences x up to {completion} completion tokens, vocab {a.vocab}; student "
          f"hidden {STUDENT['hidden_size']} x {STUDENT['num_layers']} layers; teacher 'same' or '4x' (hidden 256 x 4)")
    print(table(results, ["objective", "teacher", "kl", "update_s", "teacher_s", "share", "vs_grpo"]))
    path = save("teacher_cost", {"rows": rows, "completion": completion, "vocab": a.vocab, "repeats": a.repeats,
                                 "student": STUDENT, "teachers": TEACHERS, "results": results,
                                 "command": "python -m bench.teacher_cost" + (" --quick" if a.quick else "")})
    plot(results, path.with_suffix(".png"), f"{rows} x {completion} tokens, vocab {a.vocab}")
    print(f"wrote {path}", file=sys.stderr)


def plot(results: list[dict], path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    opd = [r for r in results if r["objective"] == "opd"]
    labels = [f"{r['kl']}\nteacher {r['teacher']}" for r in opd]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    teacher = [r["teacher_s"] for r in opd]
    rest = [r["update_s"] - r["teacher_s"] for r in opd]
    ax.bar(labels, rest, label="student (forward, backward, step)")
    ax.bar(labels, teacher, bottom=rest, label="teacher scoring")
    grpo = next(r["update_s"] for r in results if r["objective"] == "grpo")
    ax.axhline(grpo, color="grey", ls=":", lw=1, label="GRPO update, same batch")
    for i, r in enumerate(opd):
        ax.text(i, r["update_s"], f"{r['share']:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds per update")
    ax.set_title(f"OPD: teacher share of the update\n{title}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
