"""The package stays readable: no file over 400 lines, no function over 60 (STYLE.md, issue 27)."""

import ast
from pathlib import Path

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


def test_the_update_package_imports_no_lightning_module():
    """``update/`` is the Lightning-free core (tests/test_updater.py also checks what importing it loads)."""
    for p in (PACKAGE / "update").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in names), p


def code_names(tree: ast.AST) -> set[str]:
    """Every name the code itself uses: identifiers, attributes, parameters, keywords, definitions, imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg) or (isinstance(node, ast.keyword) and node.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.update(part for part in (node.name, node.asname) if part)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_update_package_knows_no_moe():
    """``update/`` drives per-chunk hooks (``records.ChunkHook``); MoE routing replay is one of them, in routing/."""
    named = {}
    for p in (PACKAGE / "update").rglob("*.py"):
        hits = sorted(n for n in code_names(ast.parse(p.read_text())) if "routing" in n.lower() or "moe" in n.lower())
        if hits:
            named[str(p.relative_to(PACKAGE))] = hits
    assert not named, f"update/ names MoE routing (make it a ChunkHook in routing/): {named}"


def test_the_moe_check_sees_parameters_attributes_and_imports():
    code = "from lightning_grpo.routing import X\ndef f(routing=None):\n    return self.moe_aux\n"
    assert {"lightning_grpo.routing", "routing", "moe_aux"} <= code_names(ast.parse(code))
