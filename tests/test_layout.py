"""The package stays readable: no file over 400 lines, no function over 60 (STYLE.md, issue 27)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "lightning_grpo"
MAX_FILE, MAX_FUNCTION = 400, 60


def test_no_file_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_FILE}
    assert not long, f"over {MAX_FILE} lines (split by concept): {long}"


def test_no_function_over_60_lines():
    long = {}
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION:
                    long[f"{p.relative_to(PACKAGE)}:{node.name}"] = n
    assert not long, f"over {MAX_FUNCTION} lines: {long}"


@pytest.mark.parametrize("package", ["update", "collect"])
def test_the_lightning_free_packages_import_no_lightning_module(package):
    """``update/`` and ``collect/`` are the Lightning-free core (tests/test_updater.py and
    tests/collect/test_collector.py also check what importing them loads)."""
    for p in (PACKAGE / package).rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in names), p
