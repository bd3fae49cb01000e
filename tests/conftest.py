import contextlib
import io
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

# Each layer's folder is importable by its file names from any other (a test module names a helper of another layer's
# test, as "test_envs:AddOnly" in an env config does): basenames are unique across tests/, so nothing shadows.
for _folder in sorted(Path(__file__).parent.iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# Tests never touch the network or the user's cache: Hugging Face Hub and datasets caches live in a
# throwaway folder (set before huggingface_hub/datasets are imported: they read these at import).
_HF_HOME = tempfile.mkdtemp(prefix="lightning-grpo-hf-")
os.environ["HF_HOME"] = _HF_HOME
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


UNIT_DIRS = ("update", "collect", "objectives", "rollout", "envs")
"""Folders of tests/ that mirror a package layer: a test there is in the unit tier unless marked contract or slow."""
TIERS = ("unit", "contract", "integration", "end-to-end")
_TIER_SECONDS: dict[str, float] = {}
_TIER_TESTS: dict[str, int] = {}
SHARED_SESSION_FIXTURES = ("two_rank_cases",)
"""Session fixtures that cost a launch: under pytest-xdist every test using one runs on the same worker (one launch)."""
LONGEST_FIRST = ("test_async_learning.py", "test_quickstart.py", "test_rollout_vllm_server.py",
                 "test_server_restarts_vllm.py", "test_nodes.py", "test_bench_smoke.py")
"""The longest files of the slow tier (CI's --durations), handed out first under pytest-xdist: a long one started
last would leave the other worker idle at the end."""


def in_unit_folder(item) -> bool:
    """In a layer's folder and not marked for another tier: the unit tier."""
    if any(item.get_closest_marker(name) for name in ("slow", "contract", "integration")):
        return False
    folder = Path(str(item.path)).parent
    return folder.parent.name == "tests" and folder.name in UNIT_DIRS


def tier_of(keywords) -> str:
    """A test's tier from its marks (an item's or, under pytest-xdist, a report's keywords)."""
    if "slow" in keywords:
        return "end-to-end"
    if "contract" in keywords:
        return "contract"
    if "unit" in keywords:
        return "unit"
    return "integration"


def worker_group(item) -> str:
    """What must run on one pytest-xdist worker: tests sharing a fit (an ``xdist_group`` mark names it), a costly
    session fixture, or else the file (its module fixtures)."""
    marked = item.get_closest_marker("xdist_group")
    if marked:
        return marked.args[0]
    shared = [name for name in SHARED_SESSION_FIXTURES if name in item.fixturenames]
    return shared[0] if shared else Path(str(item.path)).name


def _start_rank(item) -> tuple[int, int]:
    """Longest first: the files of LONGEST_FIRST in its order, then the rest of the slow tier, then the others."""
    name = Path(str(item.path)).name
    if name in LONGEST_FIRST:
        return (0, LONGEST_FIRST.index(name))
    return (1 if item.get_closest_marker("slow") else 2, 0)


def pytest_itemcollected(item):
    """Under ``--dist loadgroup``, every test's worker group, as it is collected: before any hook reads the marks.
    The report carries it back, so the controller can check that no group was split (``_split_groups``)."""
    if not getattr(item.config.option, "loadgroup", False):
        return
    group = worker_group(item)
    if not item.get_closest_marker("xdist_group"):
        item.add_marker(pytest.mark.xdist_group(group))
    item.user_properties.append(("worker_group", group))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the unit tier by folder before ``-m unit`` selects (tryfirst: the mark plugin deselects after us); under
    ``--dist loadgroup`` hand out the long tests first (a stable sort: each file keeps its order)."""
    for item in items:
        if in_unit_folder(item):
            item.add_marker(pytest.mark.unit)
    if getattr(config.option, "loadgroup", False):  # what a worker of `--dist loadgroup` is told
        items.sort(key=_start_rank)


_WORKERS_OF_GROUP: dict[str, set[str]] = {}


def _split_groups() -> dict[str, list[str]]:
    """Worker groups that ran on more than one worker: their shared fit, server or launch ran once per worker. (It
    happened silently: pytest 9.2 keeps node ids where pytest-xdist 3.8's loadgroup no longer writes its suffix.)"""
    return {group: sorted(workers) for group, workers in _WORKERS_OF_GROUP.items() if len(workers) > 1}


def pytest_runtest_logreport(report):
    """Tier totals, read from the report's marks: under pytest-xdist the controller sees reports, not items; and which
    worker ran each worker group."""
    worker = getattr(getattr(report, "node", None), "gateway", None)
    for name, value in report.user_properties:
        if name == "worker_group" and worker is not None:
            _WORKERS_OF_GROUP.setdefault(value, set()).add(worker.id)
    tier = tier_of(report.keywords)
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration  # setup + call + teardown
    if report.when == "setup":
        _TIER_TESTS[tier] = _TIER_TESTS.get(tier, 0) + 1


def _is_worker(config) -> bool:
    """A pytest-xdist worker: the controller (or a plain run) checks what the whole run left behind."""
    return hasattr(config, "workerinput")


_SHM_AND_TEMP_AT_START: set[str] = set()
_LEFT: list[str] = []
LEFTOVERS_FAIL = "LIGHTNING_GRPO_LEFTOVERS_FAIL"
"""1: fail the run when it left entries in /dev/shm or the temporary folder; unset or 0: report them only (a
shared machine's other jobs may leave entries meanwhile; the slow tier's killed `vllm serve` children still keep
their logs)."""


def _fail_on_leftovers() -> bool:
    return os.environ.get(LEFTOVERS_FAIL, "0") not in ("", "0", "false", "False")


def pytest_sessionstart(session):
    if _is_worker(session.config):
        return
    from leftovers import entries

    _SHM_AND_TEMP_AT_START.update(entries())


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when it left /dev/shm entries or temporary folders that no live process holds (tests/leftovers.py):
    fixtures are torn down by now, so whatever is left stays after the run."""
    from leftovers import leftovers

    shutil.rmtree(_HF_HOME, ignore_errors=True)
    if session.config.option.collectonly or _is_worker(session.config):
        return
    pytest_tmp = session.config._tmp_path_factory._basetemp  # pytest keeps its last 3 runs' folders on purpose
    keep = {str(pytest_tmp), str(pytest_tmp.parent)} if pytest_tmp is not None else set()
    _LEFT.extend(leftovers(_SHM_AND_TEMP_AT_START, keep))
    if _split_groups():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if _LEFT and _fail_on_leftovers() and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Per-tier totals (CI prints them with --durations), what the run left behind, then what `make test` left out
    here, and how to run it."""
    if _LEFT:
        terminalreporter.write_sep("!", "the run left these in /dev/shm or the temporary folder, held by no process",
                                   red=True)
        for entry in _LEFT:
            terminalreporter.write_line(f"  {entry}")
        verdict = "the run fails on them" if _fail_on_leftovers() else "reported only"
        terminalreporter.write_line(f"(created during this session; {verdict}: {LEFTOVERS_FAIL}=1 fails, =0 reports)")
    for group, workers in _split_groups().items():
        terminalreporter.write_line(f"worker group {group} ran on {', '.join(workers)}: what its tests share ran once per "
                                    "worker (pytest and pytest-xdist versions? see pyproject.toml's pin)", red=True)
    if _TIER_SECONDS:
        terminalreporter.write_sep("-", "seconds per test tier (setup + call + teardown)")
        for tier in TIERS:
            if tier in _TIER_SECONDS:
                terminalreporter.write_line(f"{tier:>12}: {_TIER_SECONDS[tier]:8.1f} s  ({_TIER_TESTS.get(tier, 0)} tests)")
    deselected = terminalreporter.stats.get("deselected", [])
    left = {name: sum(1 for item in deselected if item.get_closest_marker(name)) for name in ("heavy", "slow")}
    if left["heavy"] or left["slow"]:
        counts = f"{left['heavy']} heavy integration, {left['slow']} slow end-to-end tests"
    else:  # under pytest-xdist the workers deselect: no count here
        labels = {"heavy": "the heavy integration", "slow": "the slow end-to-end"}
        left_out = [label for name, label in labels.items() if f"not {name}" in config.option.markexpr]
        if not left_out:
            return
        counts = " and ".join(left_out) + " tests"
    terminalreporter.write_line(f"not run here (CI runs them): {counts}; `make test-integration` adds the heavy ones, "
                                "`make test-all` runs every test")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["LIGHTNING_GRPO_CACHE"] = str(tmp_path_factory.mktemp("grpo-cache"))


@pytest.fixture(autouse=True)
def _global_seed_restored():
    """Lightning's seed_everything leaves its seed in os.environ and GRPOModule(seed=None) reads it: per test.

    Removed after the test too: a module-scoped fixture of the next test (say, two worker processes that inherit
    the environment) is set up before this fixture runs again, and would see the seed a previous test left."""
    os.environ.pop("PL_GLOBAL_SEED", None)
    yield
    os.environ.pop("PL_GLOBAL_SEED", None)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """A fit cut short in-process by ``Preempted`` (test_faults) ends before Lightning puts its SIGTERM/SIGUSR1
    handlers back (a real run exits there): restore them, so a later test starts from the handlers it expects."""
    import signal

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for signum, handler in saved.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _determinism_restored():
    """A fit enables deterministic algorithms process-wide (torch has no scoped form): put the switches back after
    every test, so a later in-process reference does not compute under another test's mode (it changed the rounding
    of a 1e-6 two-rank comparison)."""
    from helpers import global_determinism_restored

    with global_determinism_restored():
        yield


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """A small Qwen2 policy folder (hidden 64, head_dim 32) with the char tokenizer."""
    from helpers import SMALL

    from lightning_grpo.tiny.build import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("tiny-policy"), SMALL)


@pytest.fixture(scope="session")
def tiny_chat_policy_dir(tmp_path_factory):
    """The small Qwen2 policy with a chat template on its char tokenizer (``role: content`` lines)."""
    from helpers import SMALL_CHAT

    from lightning_grpo.tiny.build import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("tiny-chat-policy"), SMALL_CHAT)


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory):
    """An OPD teacher: the student's tokenizer and shape, other weights (seed 1)."""
    from dataclasses import replace

    from helpers import SMALL

    from lightning_grpo.tiny.build import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("tiny-teacher"), replace(SMALL, seed=1))


@pytest.fixture(scope="session")
def two_rank_cases(tmp_path_factory, tiny_policy_dir, tiny_teacher_dir):
    """Every fast-tier 2-rank case of tests/dist_worker.py, run once on 2 gloo ranks: one launch (two processes
    importing torch, Lightning and transformers) serves test_distributed, test_objectives_distributed and
    test_dynamic_sampling. Returns ``load(case, rank=0)``: what that rank saved."""
    import test_distributed
    import test_objectives_distributed
    import torch

    # the fit last: a Trainer sets process-wide switches the update cases before it must not see
    cases = [*test_distributed.CASES, *test_objectives_distributed.CASES, "ddp-dynamic-fit"]
    out = tmp_path_factory.mktemp("two-ranks")
    test_distributed.launch_two_ranks(out, tiny_policy_dir, cases, timeout=900, teacher=tiny_teacher_dir)
    return lambda case, rank=0: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)


@dataclass(frozen=True)
class QuickstartRun:
    argv: list[str]
    """What followed ``lightning-grpo fit``."""
    log_dir: Path
    stdout: str


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory) -> QuickstartRun:
    """A real quickstart fit through ``lightning-grpo fit`` (in-process), run once per session."""
    from helpers import QUICKSTART_ARGS

    from lightning_grpo.cli import main

    cwd, old = tmp_path_factory.mktemp("quickstart"), os.getcwd()
    os.chdir(cwd)  # the config logs to the relative runs/
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            main(["fit", *QUICKSTART_ARGS])
    finally:
        os.chdir(old)
    return QuickstartRun(QUICKSTART_ARGS, cwd / "runs" / "quickstart" / "version_0", out.getvalue())


@pytest.fixture(scope="session")
def moe_policy_dir(tmp_path_factory):
    """A routing-sensitive tiny Qwen3-MoE (8 experts, top-2, head_dim 32; see helpers.MOE)."""
    from helpers import build_moe_policy

    return build_moe_policy(tmp_path_factory.mktemp("moe-policy"))


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """A tiny Qwen2.5-VL folder (text hidden 64, head_dim 32; vision tower of 2 blocks, width 32) with the char
    tokenizer plus vision tokens, a multimodal chat template and a Qwen2-VL image processor (saved locally)."""
    from helpers import SMALL_VLM

    from lightning_grpo.tiny.build import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("tiny-vlm"), SMALL_VLM)
