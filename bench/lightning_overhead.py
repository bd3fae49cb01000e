"""Lightning overhead: a loop step under ``Trainer.fit`` vs a bare PyTorch loop doing the same math.

    .venv/bin/python -m bench.lightning_overhead            # 3 rounds x 4 loop steps per variant
    .venv/bin/python -m bench.lightning_overhead --quick    # 2 rounds x 3 steps

Three ways to run the same loop steps on one policy, alternating within each round so machine load hits
all alike (one process, one thread):

- ``trainer``: ``Trainer.fit(GRPOModule)``, the product path (hooks, logging, the prompt DataModule);
- ``module``: a plain ``for`` loop calling the same module's ``collect`` + ``update`` (no Trainer);
- ``bare``: a hand-written PyTorch loop: the same rewards/advantages/packing, then one forward with the same
  memory-bounded logprobs, the clipped surrogate and token mean written inline, backward, clip, AdamW step.

The rollout engine serves the same pre-drawn completions every step, so the update dominates and any per-step
framework cost shows up rather than hiding behind generation. Step time is the interval between two
consecutive step ends (median; the first step of each run is warm-up), in process CPU seconds (the work
done; on a shared machine wall time swings with the neighbours) and in wall seconds. ``overhead`` =
trainer / bare - 1 in CPU time: what Lightning plus our loop machinery add to the same math;
``trainer / module - 1`` is Lightning's share alone.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import torch

from bench.common import clocks, load_average, save, table

SPEC = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256,
        "vocab_size": 8192, "max_position_embeddings": 256}
GROUP, PROMPTS, NEW_TOKENS = 8, 4, 64


class FixedRollouts:
    """A rollout engine that returns the same completions every call (protocol of rollout/base.py)."""

    holds_weights = False  # recorded completions: nothing to publish

    def __init__(self, rollouts) -> None:
        self.rollouts = rollouts

    def generate(self, prompts, group_size, sampling):
        return self.rollouts

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags=None) -> None: ...

    def load_weights(self, named_tensors) -> None: ...

    def reset_prefix_cache(self) -> None: ...


def build():
    from lightning_grpo.config import GRPOConfig, OptimConfig, RolloutConfig
    from lightning_grpo.data.prompts import PromptDataModule, PromptRecord
    from lightning_grpo.data.rewards import RewardSpec
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.rollout.hf import HFEngine
    from lightning_grpo.tiny.spec import TinyPolicySpec

    torch.manual_seed(0)
    module = GRPOModule(policy=PolicyConfig(path="tiny:bench-overhead", tiny=TinyPolicySpec(**SPEC)),
                        rl=GRPOConfig(batch_per_replica=GROUP * PROMPTS, group_size=GROUP, max_grad_norm=1.0),
                        optim=OptimConfig(lr=1e-5), rollout=RolloutConfig(max_new_tokens=NEW_TOKENS),
                        rewards=[RewardSpec("bench.speed_vs_trl:ours_reward")])
    module.configure_model()
    data = PromptDataModule("builtin:arith", prompts_per_step=PROMPTS, val_size=0)
    data.setup()
    records = [PromptRecord(i, r.text, r.answer) for i, r in enumerate(data._stream.step(0, PROMPTS))]
    prompts = [r.to_prompt(module.tokenizer) for r in records]
    drawn = HFEngine(module.policy, module.tokenizer).generate(prompts, GROUP, module.sampling())
    module.engine = FixedRollouts(drawn)
    return module, records, data


def _intervals(ends: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(wall, CPU) seconds between consecutive step ends."""
    return [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(ends)]


def run_trainer(module, data, steps: int, report_cpu: list[float]) -> list[tuple[float, float]]:
    """``Trainer.fit`` for ``steps`` loop steps; appends the CPU seconds of each step's metric report to ``report_cpu``
    (``GRPOModule.report``: the roll-up and its ``self.log`` calls, the largest per-step cost Lightning adds)."""
    from lightning.pytorch import Callback, Trainer

    ends: list[tuple[float, float]] = []
    report = module.report

    def timed_report(*args, **kwargs):
        c0 = time.process_time()
        report(*args, **kwargs)
        report_cpu.append(time.process_time() - c0)

    module.report = timed_report

    class Ends(Callback):
        def on_train_batch_end(self, *args) -> None:
            ends.append(clocks())

    Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[Ends()]).fit(module, datamodule=data)
    del module.report  # back to the class method
    return _intervals(ends)


def run_module(module, records, optimizer, steps: int) -> list[tuple[float, float]]:
    module.updater.attach(optimizer)
    ends = []
    for _ in range(steps):
        batch, _ = module.collect(records)
        module.updater.update(batch)
        ends.append(clocks())
    return _intervals(ends)


def run_bare(module, records, optimizer, steps: int) -> list[tuple[float, float]]:
    """The same math by hand: rewards -> group advantages -> one forward/backward -> clip -> step."""
    from lightning_grpo.advantages import group_advantages
    from lightning_grpo.batch import pack_rollouts
    from lightning_grpo.logprobs import token_logprobs

    policy, eps, ends = module.policy, module.rl.epsilon, []
    policy.train()
    for _ in range(steps):
        rollouts = module.engine.generate([r.to_prompt(module.tokenizer) for r in records], GROUP, module.sampling())
        rewards, _ = module.compute_rewards(rollouts)
        adv, _ = group_advantages(rewards, GROUP, "group")
        b = pack_rollouts(rollouts, adv, rewards, module.tokenizer.pad_token_id)
        logp = token_logprobs(policy, b.input_ids, b.attention_mask, positions=b.completion_mask[:, 1:])  # [N, T-1]
        mask = b.completion_mask[:, 1:].float()
        ratio = torch.exp(logp - logp.detach())  # pi_old = the sampling policy (one step per batch)
        a = b.advantages[:, None]
        surrogate = torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
        loss = -(surrogate * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())  # the loop reads its loss every step, as the module's roll-up does
        ends.append(clocks())
    return _intervals(ends)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="loop steps per run; the first is warm-up")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.steps = 2, 3
    torch.set_num_threads(1)  # the machine is shared: one thread keeps wall time proportional to work done
    module, records, data = build()
    times: dict[str, list[tuple[float, float]]] = {"trainer": [], "module": [], "bare": []}
    load, report_cpu = [load_average()], []
    for _ in range(a.rounds):
        times["trainer"] += run_trainer(module, data, a.steps, report_cpu)
        opt = torch.optim.AdamW(module.policy.parameters(), lr=1e-5)
        times["module"] += run_module(module, records, opt, a.steps)
        times["bare"] += run_bare(module, records, opt, a.steps)
        load.append(load_average())
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    rows = [{"variant": k, "step_cpu_ms": 1e3 * cpu[k], "x_bare_cpu": cpu[k] / cpu["bare"], "step_ms": 1e3 * wall[k],
             "x_bare_wall": wall[k] / wall["bare"], "steps": len(v)} for k, v in times.items()]
    overhead, lightning_only = cpu["trainer"] / cpu["bare"] - 1, cpu["trainer"] / cpu["module"] - 1
    print(f"Lightning overhead, {PROMPTS}x{GROUP} completions x {NEW_TOKENS} tokens, policy {SPEC}, 1 thread, "
          f"load average {min(load):.1f}-{max(load):.1f}")
    print(table(rows, list(rows[0])))
    report_ms, n_metrics = 1e3 * statistics.median(report_cpu), len(module.last_metrics)
    print(f"\noverhead trainer/bare - 1 = {overhead:+.1%} CPU, {wall['trainer'] / wall['bare'] - 1:+.1%} wall "
          f"(Lightning alone, trainer/module - 1 = {lightning_only:+.1%} CPU; target <= 5%); the metric report "
          f"({n_metrics} metrics through self.log) takes {report_ms:.0f} CPU ms per step")
    path = save("lightning_overhead", {"policy": SPEC, "group": GROUP, "prompts": PROMPTS, "new_tokens": NEW_TOKENS,
                                       "rounds": a.rounds, "steps": a.steps, "rows": rows, "overhead": overhead,
                                       "overhead_wall": wall["trainer"] / wall["bare"] - 1,
                                       "lightning_only": lightning_only, "report_cpu_ms": report_ms,
                                       "logged_metrics": n_metrics, "load_average": load, "times": times,
                                       "command": "python -m bench.lightning_overhead" + (" --quick" if a.quick else "")})
    plot(times, path.with_suffix(".png"))
    print(f"wrote {path}", file=sys.stderr)


def plot(times: dict[str, list[tuple[float, float]]], path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.boxplot([[1e3 * c for _, c in v] for v in times.values()], tick_labels=list(times))
    ax.set_ylabel("CPU ms per loop step")
    ax.set_title("Same loop steps: Trainer.fit vs plain loops (1 thread)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
