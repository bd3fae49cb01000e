"""Metrics identity: do two trees train the shipped configs to string-identical metrics.csv files?

Record (one fresh subprocess per config, cwd a scratch folder under DIR so ``runs/`` lands there)::

    cd <tree> && PYTHONPATH=<tree> WANDB_MODE=offline VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        /work/main/.venv/bin/python -m bench.metrics_identity --out DIR [--configs quickstart dpo-arith ...]

At d0260cd (the BEFORE figures; the second recording checks run-to-run determinism)::

    cd /work/wt-baseline && PYTHONPATH=/work/wt-baseline WANDB_MODE=offline VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        /work/main/.venv/bin/python -m bench.metrics_identity --out /work/metrics-before     # and --out .../metrics-before-2
    /work/main/.venv/bin/python -m bench.metrics_identity --compare /work/metrics-before /work/metrics-before-2

Compare (exit 1 if any config differs or is missing on one side)::

    python -m bench.metrics_identity --compare DIR_A DIR_B

Each config runs ``lightning_grpo.cli.main(["fit", "--config", cfg, *OVERRIDES[name]])`` with overrides that only
shorten it (``trainer.max_steps``, counted in optimizer steps = loop steps x mu_iterations x n_mini) and make at
least one mid-run validation happen (``trainer.val_check_interval``, in loop steps). Seed, precision, engine, model and
warm start stay as shipped. Its metrics.csv is copied to ``DIR/<name>.csv``; ``DIR/<name>.log`` holds the run's
output and ``DIR/manifest.json`` the argv, runtime, torch thread count and the ``lightning_grpo`` file imported. The
child refuses to run unless ``lightning_grpo`` is imported from the tree this script lives in (the venv may hold an
editable install of another checkout).

Every run builds and warm-starts its tiny models itself: ``LIGHTNING_GRPO_CACHE`` points at a fresh folder under the
run's scratch folder, so the second tree never loads the first tree's cached warm-started weights.

Dropped before comparing, deliberately: wall-clock timing, which differs run to run. Since issue 41's step timer
(``lightning_grpo/timing.py``) that is every ``time/*`` column (``time/wait_batch``, ``time/sync``, ``time/ahead``,
``time/update``, ``time/step``, ``time/ahead_share``; GRPO, OPD and DPO alike), matched by the ``time/`` prefix, the
first of TIMING_MARKERS. The other markers catch the names before it (at d0260cd exactly ``grpo/ahead_seconds`` and
``grpo/ahead_share``, renamed ``time/ahead`` and ``time/ahead_share``), so a tree from before compares with one from
after on every other column; a column present on one side only and not timing is a difference. Every other column is
compared as the CSV's string (rows in file order, columns by name); ``--compare`` prints the dropped columns per
config. Rows are numbered from 0, header excluded.

Run-to-run at d0260cd (CPU, 2 torch threads): two recordings compared IDENTICAL on all five configs.

Issue 41 (the rollout moved into ``collect/``, ``rollout/`` in layers, ``run_check``, ``update/``'s per-chunk hook),
recorded with ``OMP_NUM_THREADS=1`` at a69de49 (before, with this file's nine configs) and after the merge of all four
parts: IDENTICAL on all nine (quickstart, opd-arith, dpo-arith, lora-quickstart, vlm-quickstart, tools-quickstart,
vllm-cpu, vllm-server, async-quickstart).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The tree under test: configs are read from here and ``lightning_grpo`` must be imported from here."""

OVERRIDES: dict[str, list[str]] = {
    # n_mini = 1, mu = 1: 6 optimizer steps = 6 loop steps; validation at loop steps 3 and 6 (+ the shipped sanity pass)
    "quickstart": ["--trainer.max_steps=6", "--trainer.val_check_interval=3"],
    # OPD, n_mini = 1: 6 loop steps; teacher/student warm starts as shipped
    "opd-arith": ["--trainer.max_steps=6", "--trainer.val_check_interval=3"],
    # DPO: one optimizer step per training batch (4 train calls each, dpo.grad_accum): 6 batches, validation at 3, 6
    "dpo-arith": ["--trainer.max_steps=6", "--trainer.val_check_interval=3"],
    # LoRA + vLLM, n_mini = 4 (64 / 16): 24 optimizer steps = 6 loop steps; validation at loop steps 3 and 6
    "lora-quickstart": ["--trainer.max_steps=24", "--trainer.val_check_interval=3"],
    # VLM, n_mini = 1: 4 loop steps (128 rows each, the slowest config); validation at loop steps 2 and 4
    "vlm-quickstart": ["--trainer.max_steps=4", "--trainer.val_check_interval=2"],
    # multi-turn episodes with the calculator tools, n_mini = 1: 4 loop steps; validation at loop steps 2 and 4
    "tools-quickstart": ["--trainer.max_steps=4", "--trainer.val_check_interval=2"],
    # in-process vLLM engine and the colocated hand-off, n_mini = 1: 4 loop steps; validation at 2 and 4
    "vllm-cpu": ["--trainer.max_steps=4", "--trainer.val_check_interval=2"],
    # a launched `vllm serve` child, weights pushed over shared memory: 4 loop steps; validation at 2 and 4
    "vllm-server": ["--trainer.max_steps=4", "--trainer.val_check_interval=2"],
    # the same server drawing one loop step ahead (max_off_policy_steps 1): 4 loop steps; validation at 2 and 4
    "async-quickstart": ["--trainer.max_steps=4", "--trainer.val_check_interval=2"],
}
TIMING_MARKERS = ("time/", "seconds", "per_s", "_s/", "time", "share", "tokens_per", "throughput")
"""A column whose name contains one of these is wall-clock timing and is not compared (``time/``: the step timer's
columns, ``lightning_grpo.timing.is_timing``)."""
CACHE_ENV = "LIGHTNING_GRPO_CACHE"
"""Where tiny policies are built and cached (lightning_grpo.policy.tiny_cache_dir); set per run, see record()."""
ENV = {"WANDB_MODE": "offline", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

CHILD = """
import sys, lightning_grpo
from pathlib import Path
root = Path(sys.argv[1]).resolve()
where = Path(lightning_grpo.__file__).resolve()
print("IMPORTED", where, flush=True)
if root not in where.parents:
    sys.exit(f"lightning_grpo imported from {where}, not from the tree under test {root}: set PYTHONPATH={root}")
import torch
print("THREADS", torch.get_num_threads(), flush=True)
from lightning_grpo.cli import main
main(sys.argv[2:])
"""


def record(out: Path, names: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    failed = []
    for name in names:
        scratch = out / "scratch" / name
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        argv = ["fit", "--config", str(ROOT / "configs" / f"{name}.yaml"), *OVERRIDES[name]]
        # A fresh tiny-policy cache: every run builds and warm-starts its tiny models itself (a shared cache would
        # hand the second tree the first tree's warm-started weights and hide a change on that path).
        child_env = {**env, CACHE_ENV: str(scratch / "tiny-cache")}
        start = time.perf_counter()
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), *argv], cwd=scratch, env=child_env,
                                stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        seconds = time.perf_counter() - start
        lines = (out / f"{name}.log").read_text(errors="replace").splitlines()
        info = {k: ln.split(" ", 1)[1] for ln in lines for k in ("IMPORTED", "THREADS") if ln.startswith(k + " ")}
        csvs = sorted(scratch.glob("runs/**/metrics.csv"))
        # Every shipped config uses tiny: policies; none built here means the cache variable was not honoured.
        built = sorted(p.name for p in (scratch / "tiny-cache").glob("tiny-*")) if (scratch / "tiny-cache").is_dir() else []
        ok = rc == 0 and len(csvs) == 1 and bool(built)
        if ok:
            shutil.copyfile(csvs[0], out / f"{name}.csv")
        manifest[name] = {"argv": argv, "rc": rc, "seconds": round(seconds, 1), "imported": info.get("IMPORTED"),
                          "torch_threads": info.get("THREADS"), "metrics_csv": [str(p) for p in csvs], "tiny_built": built}
        manifest_path.write_text(json.dumps(manifest, indent=2))
        print(f"{name:16s} rc={rc} {seconds:7.1f}s {' '.join(OVERRIDES[name])}"
              + ("" if ok else f"  FAILED (rc {rc}, {len(csvs)} metrics.csv, {len(built)} tiny builds; see {out / (name + '.log')})"), flush=True)
        if not ok:
            failed.append(name)
    return 1 if failed else 0


def timing(column: str) -> bool:
    return any(marker in column for marker in TIMING_MARKERS)


def load(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def compare(a: Path, b: Path) -> int:
    names = sorted({p.stem for d in (a, b) for p in d.glob("*.csv")})
    manifests = [json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else {} for d in (a, b)]
    differs = False
    for name in names:
        if not (a / f"{name}.csv").exists() or not (b / f"{name}.csv").exists():
            print(f"{name}: only in {a if (a / f'{name}.csv').exists() else b}")
            differs = True
            continue
        (head_a, rows_a), (head_b, rows_b) = load(a / f"{name}.csv"), load(b / f"{name}.csv")
        dropped = sorted({c for c in head_a + head_b if timing(c)})
        only_a = [c for c in head_a if c not in head_b and not timing(c)]
        only_b = [c for c in head_b if c not in head_a and not timing(c)]
        common = [c for c in head_a if c in head_b and not timing(c)]
        ia, ib = {c: i for i, c in enumerate(head_a)}, {c: i for i, c in enumerate(head_b)}
        first = None
        for r in range(max(len(rows_a), len(rows_b))):
            if r >= len(rows_a) or r >= len(rows_b):
                first = (r, "<row>", "present" if r < len(rows_a) else "absent",
                         "present" if r < len(rows_b) else "absent")
                break
            for c in common:
                va, vb = rows_a[r][ia[c]], rows_b[r][ib[c]]
                if va != vb:
                    first = (r, c, va, vb)
                    break
            if first:
                break
        same = first is None and not only_a and not only_b
        differs |= not same
        threads = [m.get(name, {}).get("torch_threads") for m in manifests]
        print(f"{name}: rows {len(rows_a)} vs {len(rows_b)}, {len(common)} columns compared, "
              f"{'IDENTICAL' if same else 'DIFFERENT'}")
        print(f"  dropped (timing): {', '.join(dropped) or 'none'}")
        if only_a or only_b:
            print(f"  only in A: {', '.join(only_a) or 'none'}; only in B: {', '.join(only_b) or 'none'}")
        if first:
            print(f"  first difference: data row {first[0]} (0-based), column {first[1]}: {first[2]!r} vs {first[3]!r}")
        if None not in threads and threads[0] != threads[1]:
            print(f"  note: torch threads differ ({threads[0]} vs {threads[1]}): CPU kernels may round differently")
    if not names:
        print("no CSVs found")
        return 1
    return 1 if differs else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", type=Path, help="record: run the configs, write DIR/<config>.csv")
    mode.add_argument("--compare", nargs=2, type=Path, metavar=("DIR_A", "DIR_B"))
    parser.add_argument("--configs", nargs="+", choices=list(OVERRIDES), default=list(OVERRIDES))
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    return record(args.out.resolve(), args.configs)


if __name__ == "__main__":
    sys.exit(main())
