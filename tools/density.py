"""How densely the package is written: characters per non-blank line, ``a, b = x, y`` packings and lambdas per 1k.

    python tools/density.py [PATH ...] [--top N]

PATH defaults to ``lightning_grpo/``. Figures per file and for the whole; ``--top`` lists the densest files.
The anchors (STYLE.md): litgpt 45, torchtune 44, verl 48, TRL 55 characters per non-blank line; packings
0-0.4 and lambdas 0.6-1.0 per 1k lines. Counts come from the AST (strings and comments are not code):

* a packing is an assignment whose target and value are both tuple displays of the same length
  (``self.a, self.b = x, y``); unpacking a call's result (``a, b = f()``) is not one;
* a lambda is any ``lambda`` expression.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Density:
    """The counts of some source: add two to get their sum."""

    lines: int = 0
    """Non-blank lines."""
    chars: int = 0
    """Characters on them (indentation included, line ends not)."""
    packings: int = 0
    lambdas: int = 0

    def __add__(self, other: Density) -> Density:
        lines = self.lines + other.lines
        chars = self.chars + other.chars
        packings = self.packings + other.packings
        lambdas = self.lambdas + other.lambdas
        return Density(lines, chars, packings, lambdas)

    @property
    def per_line(self) -> float:
        return self.chars / self.lines if self.lines else 0.0

    def per_1k(self, count: int) -> float:
        return 1000 * count / self.lines if self.lines else 0.0

    def row(self, name: str) -> str:
        packings = self.per_1k(self.packings)
        lambdas = self.per_1k(self.lambdas)
        return f"{name:44s} {self.lines:6d} {self.per_line:6.1f} {packings:8.1f} {lambdas:8.1f}"


def is_packing(node: ast.AST) -> bool:
    """``a, b = x, y``: a tuple display assigned to a tuple target of the same length."""
    if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Tuple):
        return False
    width = len(node.value.elts)
    return any(isinstance(t, ast.Tuple) and len(t.elts) == width for t in node.targets)


def measure(source: str) -> Density:
    """The density of one file's text."""
    kept = [line for line in source.splitlines() if line.strip()]
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    packings = sum(is_packing(n) for n in nodes)
    lambdas = sum(isinstance(n, ast.Lambda) for n in nodes)
    return Density(len(kept), sum(len(line) for line in kept), packings, lambdas)


def files_of(paths: list[Path]) -> list[Path]:
    found = []
    for path in paths:
        found.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[ROOT / "lightning_grpo"])
    parser.add_argument("--top", type=int, default=10, help="list this many densest files (0: none)")
    args = parser.parse_args(argv)
    per_file = {p: measure(p.read_text()) for p in files_of(args.paths)}
    total = sum(per_file.values(), Density())
    print(f"{'':44s} {'lines':>6s} {'chars':>6s} {'pack/1k':>8s} {'lmbd/1k':>8s}")
    densest = sorted(per_file.items(), key=lambda item: -item[1].per_line)
    for path, density in densest[: args.top]:
        print(density.row(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)))
    print(total.row(f"all ({len(per_file)} files)"))
    print(f"packings {total.packings}, lambdas {total.lambdas}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
