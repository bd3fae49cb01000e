"""The package stays readable: no file over 400 lines, no function over 60 (STYLE.md, issue 27)."""

import ast
import importlib.util
import subprocess
import sys
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
    """``update/`` and ``collect/`` are the Lightning-free core (tests/update/test_updater.py and
    tests/collect/test_collector.py also check what importing them loads)."""
    for p in (PACKAGE / package).rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in names), p


def _imported(path: Path) -> list[str]:
    """Every module ``path`` imports, at any depth (``if TYPE_CHECKING:`` blocks and function bodies included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.extend([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
    return names


ROLLOUT_MAY_NOT_IMPORT = ("lightning_grpo.config", "lightning_grpo.policy", "lightning_grpo.vision",
                          "lightning_grpo.data")
# rollout_config.py's two cross-section checks (rl x rollout) still name GRPOConfig under TYPE_CHECKING; they move to
# config.py in issue 41 (another item), and this entry goes with them.
ROLLOUT_PENDING = {"rollout_config.py"}


def test_the_rollout_package_imports_nothing_above_it():
    """``rollout/`` (the engine protocol, the engines, the server plumbing) imports nothing of config.py, policy.py,
    vision.py or data/: the builder above it (``engines.py``) hands each engine its parts."""
    bad = {}
    for p in (PACKAGE / "rollout").rglob("*.py"):
        if str(p.relative_to(PACKAGE / "rollout")) in ROLLOUT_PENDING:
            continue
        found = [n for n in _imported(p) if n in ROLLOUT_MAY_NOT_IMPORT or n.startswith(
            tuple(f"{m}." for m in ROLLOUT_MAY_NOT_IMPORT))]
        if found:
            bad[str(p.relative_to(PACKAGE))] = sorted(set(found))
    assert not bad, f"rollout/ imports above itself: {bad}"


def _probes_engine(node: ast.AST) -> bool:
    """``getattr(engine, ...)`` / ``hasattr(self._engine, ...)``: the first argument's last name names an engine."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")):
        return False
    first = node.args[0] if node.args else None
    name = first.id if isinstance(first, ast.Name) else first.attr if isinstance(first, ast.Attribute) else ""
    return "engine" in name.lower()


def test_no_call_site_probes_an_engine_for_attributes():
    """What an engine can do beyond the protocol is a typed capability (``rollout/base.py``, checked with
    ``isinstance``), never ``getattr(engine, ...)`` / ``hasattr(engine, ...)``."""
    roots = [PACKAGE, PACKAGE.parent / "tests", PACKAGE.parent / "bench", PACKAGE.parent / "examples"]
    found = []
    for p in (f for root in roots for f in root.rglob("*.py")):
        found.extend(f"{p.relative_to(PACKAGE.parent)}:{node.lineno}" for node in ast.walk(ast.parse(p.read_text()))
                     if _probes_engine(node))
    assert not found, f"attribute probing on an engine (declare a capability instead): {found}"


LIGHTNING_FILES = {"module.py", "collect_hooks.py", "update_hooks.py", "base.py", "dpo.py"}
"""The Lightning modules themselves: the only files whose functions may take one."""
MODULE_TYPES = {"LightningModule", "UpdateModule", "GRPOModule", "DPOModule"}


def _lightning_hooks() -> set[str]:
    """Methods Lightning itself calls with ``pl_module`` (a Callback's hooks, a progress bar's ``get_metrics``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar

    return {name for cls in (ModelCheckpoint, RichProgressBar, TQDMProgressBar) for name in dir(cls)
            if not name.startswith("_")}


def _takes_a_module(arg: ast.arg) -> bool:
    """Named ``module`` without saying it is something else (``module: nn.Module`` is a torch module), or annotated
    with a LightningModule class (``type[LightningModule]`` is a class, not a module)."""
    annotation = arg.annotation
    if annotation is None:
        return arg.arg == "module"
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a string annotation
        annotation = ast.parse(annotation.value, mode="eval").body
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "type":
        return False
    named = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(annotation)
             if isinstance(n, ast.Name | ast.Attribute)}
    return bool(named & MODULE_TYPES)


def _offences(tree: ast.Module, where: str, hooks: set[str]) -> list[str]:
    """Module-level functions and methods of ``tree`` that take a LightningModule; the ``pl_module`` argument of a
    Lightning hook (``on_train_start(trainer, pl_module)``: Lightning's API) is exempt, a helper's is not."""
    functions = [(None, f) for f in tree.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
    for cls in (c for c in tree.body if isinstance(c, ast.ClassDef)):
        functions += [(cls.name, f) for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
    found = []
    for owner, f in functions:
        for a in [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs]:
            if _takes_a_module(a) and not (a.arg == "pl_module" and owner is not None and f.name in hooks):
                found.append(f"{where}:{f.lineno} {owner + '.' if owner else ''}{f.name}({a.arg})")
    return found


def test_no_function_outside_lightning_files_takes_a_lightning_module():
    """ARCHITECTURE.md: parts get what they read explicitly, never the module (a trainer is fine)."""
    hooks, found = _lightning_hooks(), []
    for p in PACKAGE.rglob("*.py"):
        name = p.relative_to(PACKAGE).as_posix()
        if name not in LIGHTNING_FILES:
            found += _offences(ast.parse(p.read_text()), name, hooks)
    assert not found, f"take the LightningModule (give them the parts they read instead): {found}"


def test_the_module_scan_sees_what_it_forbids():
    """The scan above catches each form it forbids (a guard against a scan that finds nothing)."""
    code = ("def a(module): ...\n"
            "def b(m: GRPOModule): ...\n"
            "def c(m: 'UpdateModule | None'): ...\n"
            "def fine(module: nn.Module, cls: type[LightningModule], model): ...\n"
            "class Cb(Callback):\n"
            "    def on_train_start(self, trainer, pl_module: LightningModule): ...\n"
            "    def _helper(self, pl_module: pl.LightningModule): ...\n"
            "    def setup(self, trainer, module): ...\n")
    found = _offences(ast.parse(code), "x.py", {"on_train_start", "setup"})
    assert found == ["x.py:1 a(module)", "x.py:2 b(m)", "x.py:3 c(m)", "x.py:7 Cb._helper(pl_module)",
                     "x.py:8 Cb.setup(module)"]


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


TESTS = Path(__file__).parent
SUBPACKAGES = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


def test_test_file_names_are_unique_across_tests():
    """Every test folder is on sys.path (tests/conftest.py): two files of one name would shadow each other."""
    seen: dict[str, list[str]] = {}
    for p in TESTS.rglob("*.py"):
        if p.name != "conftest.py" and "__pycache__" not in p.parts:
            seen.setdefault(p.name, []).append(str(p.relative_to(TESTS)))
    twins = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twins, f"test files share a name (rename one): {twins}"


def test_test_folders_mirror_the_package():
    """A folder of tests/ names a subpackage of lightning_grpo (or holds data or GPU scripts)."""
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders <= SUBPACKAGES, f"test folders with no subpackage of that name: {sorted(folders - SUBPACKAGES)}"


def test_the_package_is_ruff_formatted_at_88_columns():
    """The anchors' density (issue 41): ``ruff format`` at lightning_grpo/.ruff.toml's width, checked, not hoped."""
    out = subprocess.run([sys.executable, "-m", "ruff", "format", "--check", str(PACKAGE)],
                         capture_output=True, text=True)
    assert out.returncode == 0, f"run `ruff format lightning_grpo`:\n{out.stdout[-2000:]}{out.stderr[-2000:]}"


def test_every_mutation_of_the_mutation_check_still_applies():
    """tools/mutation_check.py edits exact text: code that moved or was reformatted must take its patterns along."""
    spec = importlib.util.spec_from_file_location("mutation_check", TESTS.parent / "tools" / "mutation_check.py")
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # its dataclasses look their module up there
    spec.loader.exec_module(tool)
    stale = [f"{m.path}: {old[:60]!r} x{(PACKAGE / m.path).read_text().count(old)}"
             for m in tool.MUTATIONS for old, _ in m.edits
             if not (PACKAGE / m.path).exists() or (PACKAGE / m.path).read_text().count(old) != 1]
    assert not stale, f"update tools/mutation_check.py MUTATIONS: {stale}"
