"""The import graph of ``lightning_grpo/`` and ``bench/`` has no circles, and a real model never loads ``tiny/``.

How the graph is read (``ast`` only, nothing is imported):

- Every ``import`` / ``from ... import`` of our packages counts, at module level, inside functions and in classes
  alike: a function-local import does not make a circle go away, it only hides it until the call. The one
  exception is an ``if TYPE_CHECKING:`` block, which never runs; a second graph counts those too (a circle there is
  the same tangle of concepts, only hidden from the interpreter).
- ``import a.b.c`` depends on ``a.b.c``; ``from a.b import c`` on ``a.b.c`` when that is a module, else on ``a.b``
  (``c`` is then a name of its ``__init__``). Relative imports are resolved against the importing module's package.
- Package ``__init__`` edges: importing ``a.b.c`` first runs ``a/__init__.py`` and ``a/b/__init__.py``, so it also
  depends on those packages, except on the packages that contain the importing module itself: Python has started
  them before the module runs, and a package ``__init__`` importing its own submodules is the ordinary layout, not a
  circle. (So ``vision.py`` importing ``rollout.base`` depends on ``rollout/__init__.py`` too: that is why
  ``build_engine``, which imports the engines and the policy, lives in ``engines.py``, not there.)
- ``lightning_grpo/__init__.py`` re-exports lazily: its ``__getattr__`` imports the module named by a string in
  ``_EXPORTS`` (invisible to ``ast``), and its ``TYPE_CHECKING`` block never runs, so the top package itself has no
  edges. It contains every module of the package, so nothing inside could close a circle through it anyway;
  ``from lightning_grpo import Name`` is read as depending on the module ``_EXPORTS`` names for ``Name``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_grpo

ROOT = Path(lightning_grpo.__file__).resolve().parents[1]
PACKAGES = ("lightning_grpo", "bench")
Edge = tuple[str, str, int]
"""(importing module, imported module, line)."""


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module of our packages (a package is its ``__init__.py``)."""
    out = {}
    for package in PACKAGES:
        for file in sorted((root / package).rglob("*.py")):
            parts = file.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, type_checking: bool = False):
    """Every import statement under ``node`` that can run (``if TYPE_CHECKING:`` bodies skipped unless
    ``type_checking``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _type_checking(child) and not type_checking:
            for other in child.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _imports(child, type_checking)


def _exports(files: dict[str, Path]) -> dict[str, str]:
    """``lightning_grpo._EXPORTS``, read from the source: name -> the module that defines it."""
    for node in ast.parse(files["lightning_grpo"].read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("lightning_grpo/__init__.py has no _EXPORTS")


def import_graph(root: Path = ROOT, type_checking: bool = False) -> dict[str, list[Edge]]:
    """Module -> the edges to the modules of our packages it imports (see the module docstring for the rules);
    ``type_checking``: count the imports of ``if TYPE_CHECKING:`` blocks too, but the top package's (its lazy
    re-exports name every module)."""
    files = modules(root)
    exports = _exports(files)
    graph: dict[str, list[Edge]] = {}
    for name, file in files.items():
        is_package = file.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        started = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)} | {name}  # run before this one
        edges = graph.setdefault(name, [])
        hidden = type_checking and name != "lightning_grpo"
        for node in _imports(ast.parse(file.read_text(), str(file)), hidden):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files
                           else exports.get(alias.name, base) if base == "lightning_grpo" else base
                           for alias in node.names]
            for target in targets:
                if target.split(".")[0] not in PACKAGES:
                    continue
                parts = target.split(".")
                parents = [".".join(parts[:i]) for i in range(1, len(parts))]
                for dep in [*parents, target]:
                    if dep in files and dep not in started:
                        edges.append((name, dep, node.lineno))
    return graph


def cycles(graph: dict[str, list[Edge]]) -> list[list[Edge]]:
    """One circle (as its edges) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for _, w, _ in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, component) for component in components]


def _circle(graph: dict[str, list[Edge]], component: set[str]) -> list[Edge]:
    """A shortest circle through the component's first module (breadth-first search back to it)."""
    start = min(component)
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for edge in graph[v]:
                w = edge[1]
                if w == start:
                    path = [edge]
                    while path[0][0] != start:
                        path.insert(0, came[path[0][0]])
                    return path
                if w in component and w not in came:
                    came[w] = edge
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start}")


def _describe(circle: list[Edge], files: dict[str, Path]) -> str:
    steps = [f"{a} ({files[a].relative_to(ROOT)}:{line})" for a, _, line in circle]
    return " -> ".join([*steps, circle[0][0]])


def test_there_are_no_import_circles():
    graph = import_graph()
    found = cycles(graph)
    files = modules()
    assert not found, "import circles (move the shared piece into a lower module; a function-local import only hides " \
                      "one):\n  " + "\n  ".join(_describe(c, files) for c in found)


def test_there_are_no_import_circles_through_type_checking_imports():
    """An ``if TYPE_CHECKING:`` import closes no circle at run time, but a circle through one still ties two concepts
    into one (rollout_config.py once typed with config.py, which imports it)."""
    found = cycles(import_graph(type_checking=True))
    files = modules()
    assert not found, "import circles through TYPE_CHECKING imports:\n  " + "\n  ".join(
        _describe(c, files) for c in found)


def test_the_graph_sees_function_local_imports_and_package_inits():
    """Guards the reader: a test that found no edges would pass vacuously."""
    deps = {name: {b for _, b, _ in edges} for name, edges in import_graph().items()}
    assert "lightning_grpo.tiny.build" in deps["lightning_grpo.policy"]  # resolve_path's deferred tiny: dispatch
    assert "lightning_grpo.rollout" in deps["lightning_grpo.vision"]  # rollout.base runs rollout/__init__ first
    assert "lightning_grpo.module" in deps["bench.update_memory"]  # bench scripts import us inside main()
    assert "lightning_grpo.checkpoint.checkpoint_io" in deps["lightning_grpo.checkpoint"]  # the package's own __init__
    assert "lightning_grpo.checkpoint" not in deps["lightning_grpo.checkpoint.callback"]  # its own package: started


def test_no_module_of_the_package_imports_the_lazy_top_level_names():
    """``from lightning_grpo import GRPOModule`` inside the package would run ``__getattr__`` at import time, an
    edge the graph reads through ``_EXPORTS``; import from the defining module instead (submodules are fine)."""
    files, names = modules(), set(_exports(modules()))
    offenders = [f"{name}:{node.lineno}" for name, file in files.items() if name.startswith("lightning_grpo.")
                 for node in _imports(ast.parse(file.read_text()))
                 if isinstance(node, ast.ImportFrom) and node.module == "lightning_grpo" and not node.level
                 and any(alias.name in names for alias in node.names)]
    assert not offenders


PROBE = """
import json, sys
from lightning_grpo.policy import PolicyConfig, load_policy

model, tokenizer = load_policy(PolicyConfig(path=sys.argv[1]))
print(json.dumps([type(model).__name__, sorted(m for m in sys.modules if m.startswith("lightning_grpo"))]))
"""


@pytest.mark.heavy  # fresh interpreters: CI and `make test-integration`
def test_loading_a_model_folder_imports_nothing_of_the_tiny_factory(tiny_policy_dir):
    """A real model (a folder here; a Hub id resolves to one) never enters ``lightning_grpo/tiny/`` nor the built-in
    tasks and chat helpers its warm starts use. A fresh process, so the test session's own imports do not count."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", PROBE, str(tiny_policy_dir)], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    model_class, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert model_class == "Qwen2ForCausalLM" and "lightning_grpo.policy" in loaded
    unwanted = ("lightning_grpo.tiny", "lightning_grpo.data.tasks", "lightning_grpo.data.visual", "lightning_grpo.data.chat")
    assert [m for m in loaded if m.startswith(unwanted)] == []
