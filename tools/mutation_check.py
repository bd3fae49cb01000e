"""Mutation check of the unit tier: inject known bugs one at a time and show that `pytest -m unit` fails for each.

Each mutation is a few exact text replacements in a temporary copy of the package (the tree is never touched); the
unit tier then runs against that copy. A bug no unit test fails for is a hole in the tier: the script exits 1.

    python tools/mutation_check.py                 # all mutations, a table on stdout
    python tools/mutation_check.py --only 3 9      # some of them
    python tools/mutation_check.py --out FILE.md   # the table written to FILE.md too

About a minute per mutation on 2 CPU cores (the unit tier, with -x off so every failing test is listed).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT_DIRS = ("update", "collect", "objectives", "rollout", "envs")
"""tests/conftest.py's unit folders."""


@dataclass(frozen=True)
class Mutation:
    layer: str
    bug: str
    path: str
    """File under lightning_grpo/."""
    edits: tuple[tuple[str, str], ...]
    """(old, new): each old text must occur exactly once in the file."""


MUTATIONS = (
    Mutation("update", "divisor per chunk (the mean of the chunks' token means)", "update/accumulate.py", (
        ("loss if self.grad_accum == 1 else loss * self._carry(denom.detach())",
         "loss if self.grad_accum == 1 else loss / self.grad_accum"),
        ("        if self.grad_accum > 1:\n            total =", "        if False:\n            total ="),
    )),
    Mutation("update", "poisoned-window countdown off by one", "update/accumulate.py", (
        ("self._discard = self.grad_accum - 1 - self._calls", "self._discard = self.grad_accum - self._calls"),
    )),
    Mutation("update", "a DP-mean divisor below 1 clamped to 1", "update/accumulate.py", (
        ("scale = torch.where(total > 0, ref / total, torch.ones_like(total))", "scale = ref / total.clamp(min=1)"),
    )),
    Mutation("update", "a DP filler chunk counts its tokens", "update/plan.py", (
        ('completion_mask=torch.zeros_like(cut["attention_mask"])', 'completion_mask=cut["attention_mask"].clone()'),
    )),
    Mutation("update", "mini-batch 0 left unrecorded at mu_iterations > 1", "update/plan.py", (
        ("return probe_passed and mu_iterations == 1 and not self.every_chunk",
         "return probe_passed and not self.every_chunk"),
    )),
    Mutation("update", "inner epochs' order not new per loop step", "update/updater.py", (
        ("seed=self.seed * 1_000_003 + self.loop_step", "seed=self.seed * 1_000_003"),
    )),
    Mutation("collect", "tool tokens in the loss mask and divisor (pack_rollouts)", "batch.py", (
        ("if r.model_mask is None\n            else torch.tensor(r.model_mask)",
         "if True\n            else torch.tensor(r.model_mask)"),
    )),
    Mutation("collect", "every rank samples with the same seed", "collect/prompts.py", (
        ("seed = (self.seed * 1_000_003 + loop_step) * max(self.world, 1) + self.rank",
         "seed = (self.seed * 1_000_003 + loop_step) * max(self.world, 1)"),
    )),
    Mutation("async", "staleness off by one", "collect/staleness.py", (
        ("stale = (trainer_version - first).double()", "stale = (trainer_version - first + 1).double()"),
    )),
    Mutation("async", "a weight sync does not wait for the draw in flight", "collect/async_rollouts.py", (
        ("            self.wait_idle()  # a batch is drawn with one weight version, never a mix\n", "            pass\n"),
    )),
    Mutation("async", "a batch in flight taken although its seed changed", "collect/async_rollouts.py", (
        ("flight.prompt_ids != [p.id for p in prompts] or flight.seed != sampling.seed",
         "flight.prompt_ids != [p.id for p in prompts]"),
    )),
    Mutation("server", "the weight version not checked after a sync", "rollout/server/probe.py", (
        ("if version and reported != str(version):", "if False:"),
    )),
    Mutation("server", "sync phases wait the generation timeout (600 s), not sync_timeout_s", "rollout/server/client.py", (
        ("request_json(self.url, path, body, self.config.sync_timeout_s, phase)",
         "request_json(self.url, path, body, self.config.request_timeout_s, phase)"),
    )),
    Mutation("server", "an in-flight sync does not pause the servers (tokens sampled mid-sync)",
             "rollout/server/weight_update.py", (
        ('self._post, "/pause?mode=abort&clear_cache=false", {}, "pause"',
         'lambda *a: None, "/pause?mode=abort&clear_cache=false", {}, "pause"'),
    )),
    Mutation("server", "a cut request continues from its prompt, not its tokens so far", "rollout/server/inflight.py", (
        ('"prompt": list(body["prompt"]) + tokens', '"prompt": list(body["prompt"])'),
    )),
    Mutation("objectives", "Dr. GRPO divides by tokens, not sequences x max length", "objectives/grpo.py", (
        ("seqs.detach() * self.max_completion_length", "tokens.detach()"),
    )),
    Mutation("objectives", "the clip bounds swapped (epsilon_high below)", "objectives/grpo.py", (
        ("torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)",
         "torch.clamp(ratio, 1 - self.epsilon_high, 1 + self.epsilon)"),
    )),
)


def mutated_tree(mutation: Mutation, into: Path) -> None:
    """A copy of the package, tests and pytest config under ``into``, with ``mutation`` applied."""
    shutil.copytree(ROOT / "lightning_grpo", into / "lightning_grpo", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests", into / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", into / "pyproject.toml")
    target = into / "lightning_grpo" / mutation.path
    text = target.read_text()
    for old, new in mutation.edits:
        if text.count(old) != 1:
            raise SystemExit(f"mutation {mutation.bug!r}: {old!r} occurs {text.count(old)} times in {mutation.path}; "
                             "the code changed: update MUTATIONS")
        text = text.replace(old, new)
    target.write_text(text)


def run_unit_tier(tree: Path, timeout: int) -> tuple[int, list[str], float]:
    """(exit code, failing test ids, seconds) of ``pytest -m unit`` in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "WANDB_MODE": "offline", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    check = "import lightning_grpo, sys; sys.exit(0 if lightning_grpo.__file__.startswith(sys.argv[1]) else 1)"
    subprocess.run([sys.executable, "-c", check, str(tree)], cwd=tree, env=env, check=True)  # the copy is imported
    # the unit tier's folders (tests/conftest.py UNIT_DIRS): the same selection as `-m unit tests`, collected faster
    folders = [f"tests/{d}" for d in UNIT_DIRS if (tree / "tests" / d).is_dir()]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "unit", "-rf", "--timeout=120",
           *folders]
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, ["(the unit tier ran past the script's timeout)"], time.perf_counter() - start
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out.stdout, flags=re.M)
    if out.returncode not in (0, 1):  # pytest itself failed (usage, collection): not a catch
        raise SystemExit(f"pytest exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.returncode, failed, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, nargs="*", help="mutation numbers (1-based) to run")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per unit-tier run")
    args = parser.parse_args(argv)
    chosen = [(i, m) for i, m in enumerate(MUTATIONS, 1) if not args.only or i in args.only]
    rows = ["| # | layer | injected bug | file | caught | unit tests that fail |", "|---|---|---|---|---|---|"]
    missed = 0
    for i, mutation in chosen:
        with tempfile.TemporaryDirectory(prefix="lgrpo-mutant-") as tmp:
            mutated_tree(mutation, Path(tmp))
            code, failed, seconds = run_unit_tier(Path(tmp), args.timeout)
        caught = code != 0 and bool(failed)
        missed += not caught
        names = ", ".join(f"`{f.split('::', 1)[0].removeprefix('tests/')}::{f.split('::', 1)[1]}`"
                          if "::" in f else f for f in failed[:4])
        more = f" (+{len(failed) - 4} more)" if len(failed) > 4 else ""
        row = (f"| {i} | {mutation.layer} | {mutation.bug} | {mutation.path} | {'yes' if caught else '**NO**'} "
               f"({len(failed)} failed, {seconds:.0f} s) | {names}{more} |")
        rows.append(row)
        print(row, flush=True)
    table = "\n".join(rows)
    print(f"\n{table}\n\n{len(chosen) - missed} of {len(chosen)} injected bugs caught by the unit tier alone")
    if args.out:
        args.out.write_text(table + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
