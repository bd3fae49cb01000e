"""``lightning-grpo show <run> --step N``: the completions of one loop step, as a person reads them.

Reads ``completions.jsonl`` (``completions.py`` appends a few rows per loop step) and prints the rows of a step:
a single-turn completion on two lines, an episode (``model.env``) whole: its prompt as the model saw it (the
tool schemas included), each turn's text, the tool calls with their arguments and results, and which tokens
trained. The console sample during a fit is printed by the same functions. Imports nothing heavy: it answers at
once, on a machine without the training stack too.

    lightning-grpo show runs/tools-calculator/version_0 --step 3
    lightning-grpo show runs/tools-calculator               # the newest run's last logged step
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

FILE = "completions.jsonl"
ROW_FIELDS = (
    "step",
    "prompt_id",
    "prompt",
    "completion",
    "reward",
    "rewards",
    "advantage",
    "finish_reason",
    "trained",
    "turns",
)
"""The keys of a completions row; any other list of numbers in a row is a per-token figure (OPD's KL)."""
DESCRIPTION = (
    "Print the completions (whole episodes with model.env) of one loop step of a run."
)


class ShowError(RuntimeError):
    """Nothing to show (no completions.jsonl, no such step); the message says why and what to give."""


def format_sample(sample: dict) -> str:
    """One row for a person: an episode turn by turn (``format_episode``), else two lines: the loop step, prompt
    and completion; the rewards and what the objective trained on (the advantage, or a per-token figure)."""
    if "turns" in sample:
        return format_episode(sample)
    return (
        f"[completion, loop step {sample['step']}] {sample['prompt']!r} -> {sample['completion']!r}"
        f" ({sample['finish_reason']})\n  {_outcome(sample)}"
    )


def format_episode(sample: dict) -> str:
    """A multi-turn episode: its prompt as the model saw it (tool schemas included), then each turn's text, tool
    calls with their arguments and results, and which tokens trained (the model's) and which were context."""
    lines = [
        f"[episode, loop step {sample['step']}, prompt {sample['prompt_id']}] {sample['finish_reason']}, "
        f"{len(sample['turns'])} turn(s); {_outcome(sample)}",
        "prompt, as the model saw it:",
    ]
    lines += [f"  | {line}" for line in sample["prompt"].splitlines()]
    trained = (
        "trained"
        if sample.get("trained", True)
        else "not trained: the row left the loss"
    )
    for k, turn in enumerate(sample["turns"], 1):
        lines.append(f"turn {k} ({turn['tokens']} tokens, {trained}): {turn['text']!r}")
        lines += [f"  {_call(c)}" for c in turn["calls"]]
        if turn["context_tokens"]:
            lines.append(
                f"  + {turn['context_tokens']} tokens of tool results (context, not trained)"
            )
    return "\n".join(lines)


def _call(call: dict) -> str:
    # a call the parser recognised but could not read: its error went back
    if call["arguments"] is None:
        return f"unreadable call -> {call['result']!r} (failed)"
    args = ", ".join(f"{k}={v!r}" for k, v in call["arguments"].items())
    if call["result"] is None:
        return f"call {call['name']}({args}): not run (the episode ended first)"
    failed = " (failed)" if call["failed"] else ""
    return f"call {call['name']}({args}) -> {call['result']!r}{failed}"


def _outcome(sample: dict) -> str:
    """The reward and its parts, then the advantage and any per-token figure the objective optimizes."""
    parts = ", ".join(f"{k} {v:.3f}" for k, v in sample["rewards"].items())
    out = f"reward {sample['reward']:.3f}{f' ({parts})' if parts else ''}"
    if sample.get("advantage") is not None:
        out += f", advantage {sample['advantage']:+.3f}"
    # a list of numbers beside the row's own fields: OPD's kl_to_teacher
    for name, values in sample.items():
        if name not in ROW_FIELDS and isinstance(values, list) and values:
            shown = " ".join(f"{v:.3f}" for v in values[:16]) + (
                " ..." if len(values) > 16 else ""
            )
            out += (
                f", {name} per token [{shown}] (mean {sum(values) / len(values):.3f})"
            )
    return out


def find_completions(path: str | Path) -> Path:
    """The ``completions.jsonl`` a path means: the file, the one in a run folder, or the newest one below it."""
    path = Path(path)
    if path.is_file():
        return path
    found = (
        sorted(path.rglob(FILE), key=lambda p: p.stat().st_mtime)
        if path.is_dir()
        else []
    )
    if not found:
        raise ShowError(
            f"no {FILE} at or under {str(path)!r}: give a run folder (e.g. runs/quickstart/version_0); "
            "a fit writes it unless trainer callbacks drop CompletionLog or samples_per_step is 0"
        )
    return found[-1]


def rows_of_step(path: Path, step: int | None) -> list[dict]:
    """The rows of loop step ``step`` (None: the last step logged); a resumed run's repeated step: its last rows."""
    rows = [
        json.loads(line)
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    steps = sorted(
        {
            r["step"]
            for r in rows
            if isinstance(r.get("step"), int) and "completion" in r
        }
    )
    if not steps:
        raise ShowError(f"{path}: no completion rows yet")
    want = steps[-1] if step is None else step
    if want not in steps:
        raise ShowError(
            f"--step {step}: {path} holds loop steps {_span(steps)}; pick one of them"
        )
    return [r for r in rows if r.get("step") == want and "completion" in r]


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 2 else ", ".join(map(str, steps))


def build_parser(
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    """The ``show`` arguments (``parser_class``: the CLI lists ``show`` among its subcommands, with a jsonargparse
    parser)."""
    parser = parser_class(prog="lightning-grpo show", description=DESCRIPTION)
    parser.add_argument(
        "run", help=f"a run folder (or its {FILE}, or a folder of runs: the newest)"
    )
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        help="the loop step (default: the last one logged)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """``lightning-grpo show RUN [--step N]``."""
    args = build_parser().parse_args(argv)
    try:
        path = find_completions(args.run)
        rows = rows_of_step(path, args.step)
    except ShowError as err:
        print(f"lightning-grpo show: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"{path}: loop step {rows[0]['step']}, {len(rows)} row(s)\n")
    print("\n\n".join(format_sample(r) for r in rows))


if __name__ == "__main__":
    main()
