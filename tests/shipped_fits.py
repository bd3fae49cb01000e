"""One `lightning-grpo fit --config configs/<name>.yaml` per (config, seed, overrides) per test session, shared by every
test that asserts about it (the learning tests of tests/test_quickstart.py, tests/objectives/test_objective_configs.py,
tests/rollout/test_rollout_vllm_lora.py and tests/test_async_learning.py)."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_grpo.cli import main

CONFIGS = Path(__file__).parents[1] / "configs"


@dataclass(frozen=True)
class Fit:
    """A finished fit: its run folder, what it printed (the summary), its metrics.csv rows and its cost."""

    run: Path
    out: str
    rows: list[dict]
    seconds: float
    """Wall time of the fit (start-up, validations and the summary included)."""
    cpu_seconds: float
    """CPU time of this process over the fit (a busy machine moves it less than the wall time)."""

    def series(self, metric: str) -> list[tuple[int, float]]:
        """``(step, value)`` of every row that logged ``metric``."""
        return [(int(float(r["step"])), float(r[metric])) for r in self.rows if r.get(metric)]

    def values(self, metric: str) -> list[float]:
        return [v for _, v in self.series(metric)]


_FITS: dict[tuple, Fit] = {}


def shipped_fit(name: str, seed: int, tmp_path_factory, *overrides: str, threads: int | None = None,
                tag: str = "") -> Fit:
    """The fit of ``configs/<name>.yaml`` at ``--seed_everything=seed`` with ``overrides``, run once per session.

    ``threads``: torch threads of the trainer during the fit (a `vllm serve` config runs its server on the other core).
    ``tag``: tells apart fits whose arguments are equal but whose process differs (a test-only patch in force).
    """
    key = (name, seed, overrides, threads, tag)
    if key not in _FITS:
        folder = tmp_path_factory.mktemp(f"{name}-seed{seed}")
        before = (os.getcwd(), torch.get_num_threads())
        out = io.StringIO()
        os.chdir(folder)
        if threads is not None:
            torch.set_num_threads(threads)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            with contextlib.redirect_stdout(out):
                main(["fit", "--config", str(CONFIGS / f"{name}.yaml"), f"--seed_everything={seed}",
                      "--trainer.enable_progress_bar=false", *overrides])
        finally:
            os.chdir(before[0])
            torch.set_num_threads(before[1])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        [run] = sorted((folder / "runs").glob("*/version_*"))
        rows = list(csv.DictReader((run / "metrics.csv").open()))
        _FITS[key] = Fit(run, out.getvalue(), rows, wall, cpu)
        print(f"\n{name} {tag} seed {seed}: {wall:.1f} s wall, {cpu:.1f} s CPU")
    return _FITS[key]


SEEDS = (0, 1, 2)
PINNED = "--model.policy.tiny.seed=0"
"""The shipped warm start serves every seed (another seed would build and warm-start its own policy first)."""
LEARNERS = {
    "quickstart": ((PINNED,), "val/reward"),
    "vlm-quickstart": ((PINNED,), "val/reward"),
    "lora-quickstart": ((PINNED,), "val/reward"),
    "opd-arith": ((PINNED, "--model.opd.teacher.tiny.seed=0"), "val/reward"),
    # tiny:dpo is not warm-started (nothing ships): its init follows the seed. The sanity check over every held-out
    # pair measures the starting policy (loop step 0), as the other quickstarts' configs ask. 30 of its 60 steps:
    # held-out accuracy is 0.80-0.92 by then at seeds 0-2 (60 steps: 0.84-0.94), at half the cost.
    "dpo-arith": (("--trainer.num_sanity_val_steps=-1", "--trainer.max_steps=30"), "val/accuracy"),
}
"""Config -> (what this machine's run overrides, the held-out metric). async-quickstart: tests/test_async_learning.py.
Every other size is the shipped one: each fit takes about a minute on 2 busy cores (lora-quickstart 1.5-2.5:
its shortened run, 20 loop steps, rises in reward by less than its test's bar)."""
RISE = 0.05
"""How far above the starting policy's held-out figure every seed must end: more than 3 of 64 held-out prompts
(vlm-quickstart: 1.6 of its 32 images)."""


MAY_STALL = {"vlm-quickstart": 1}
"""Config -> how many of SEEDS may end at (not below) the starting policy's held-out figure. vlm-quickstart: on CI's
CPU seed 2 reached 0.500 at loop step 10 and fell back to its start, 0.188, for the rest of the run (this machine:
0.500 at the end); docs/vlm.md's seeds 6 and 7 stayed flat on an Intel Xeon. Its 4-colour task on a frozen tiny
tower is a weak signal that another CPU's rounding can lose; every other config rises at every seed."""


def shares_fit(name: str) -> pytest.MarkDecorator:
    """Tests that assert about the fits of ``configs/<name>.yaml`` run on one pytest-xdist worker: one fit each."""
    return pytest.mark.xdist_group(f"fit-{name}")


def learned(name: str, seed: int, tmp_path_factory):
    """The learning fit of ``configs/<name>.yaml`` at ``seed`` (one per session, shared by every test about it)."""
    return shipped_fit(name, seed, tmp_path_factory, *LEARNERS[name][0])
