"""The warm-started tiny policies shipped in the package (``lightning_grpo/tiny/shipped.py``,
``tools/build_tiny_weights.py``): intact, used by the quickstarts without training, rebuilt to the same score."""

import fnmatch
import importlib.util
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_grpo.policy import load_policy, resolve_path
from lightning_grpo.tiny import build, shipped
from lightning_grpo.tiny.shipped import MANIFEST, SHIPPED, bad_files, read_manifest, shipped_names

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("build_tiny_weights", ROOT / "tools" / "build_tiny_weights.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()


@pytest.fixture
def no_training(monkeypatch, tmp_path):
    """An empty cache in which building (random init or warm start) raises."""
    monkeypatch.setenv("LIGHTNING_GRPO_CACHE", str(tmp_path / "cache"))

    def refuse(*args, **kwargs):
        raise AssertionError("built (trained) a tiny policy the package ships")

    monkeypatch.setattr(build, "build_folder", refuse)


def _record_builds(monkeypatch) -> list:
    """Builds make an empty folder and are listed in the returned list."""
    built = []

    def record(out, *args):
        built.append(out)
        out.mkdir(parents=True)

    monkeypatch.setattr(build, "build_folder", record)
    return built


def test_every_entry_is_shipped_with_its_manifest():
    assert shipped_names() == sorted(SCRIPT.ENTRIES)


@pytest.mark.parametrize("name", shipped_names())
def test_shipped_files_match_their_checksums_and_are_small(name):
    folder = SHIPPED / name
    manifest = read_manifest(folder)
    assert bad_files(folder, manifest) == []
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    assert on_disk == sorted(manifest["files"])  # nothing unlisted ships
    size = sum((folder / f).stat().st_size for f in manifest["files"])
    assert size < 8e6


@pytest.mark.parametrize("name", shipped_names())
def test_package_data_includes_the_shipped_files(name):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    globs = pyproject["tool"]["setuptools"]["package-data"]["lightning_grpo.tiny"]
    tiny = SHIPPED.parent
    for path in (SHIPPED / name).iterdir():
        relative = path.relative_to(tiny).as_posix()
        assert any(fnmatch.fnmatch(relative, g) for g in globs), relative


SHARED = [
    ("quickstart", "configs/lora-quickstart.yaml", "model.policy"),
    ("quickstart", "configs/async-quickstart.yaml", "model.policy"),
    ("quickstart", "configs/opd-arith.yaml", "model.policy"),  # tiny:opd-student, the same build
]
"""Configs whose policy is another entry's shipped build: (shipped name, config, section)."""
USERS = [(name, *where) for name, where in sorted(SCRIPT.ENTRIES.items())] + SHARED


@pytest.mark.parametrize(("name", "config", "section"), USERS)
def test_a_shipped_config_loads_its_policy_without_training(name, config, section, no_training, capsys):
    policy = SCRIPT.policy_of(config, section)
    folder = resolve_path(policy)
    assert "nothing to train" in capsys.readouterr().out
    assert bad_files(folder, read_manifest(SHIPPED / name)) == []
    model, tok = load_policy(policy)
    assert tok.eos_token_id is not None


def test_another_warm_start_is_built(monkeypatch, tmp_path):
    """The shipped folder serves its exact key only: one more warm-start step builds, as before."""
    monkeypatch.setenv("LIGHTNING_GRPO_CACHE", str(tmp_path))
    built = _record_builds(monkeypatch)
    policy = SCRIPT.policy_of(*SCRIPT.ENTRIES["quickstart"])
    resolve_path(replace(policy, warm_start_steps=policy.warm_start_steps + 1))
    resolve_path(replace(policy, tiny=replace(policy.tiny, seed=1)))
    assert len(built) == 2


def test_a_damaged_shipped_file_is_rebuilt_with_a_warning(monkeypatch, tmp_path, capsys):
    copy = tmp_path / "shipped"
    shutil.copytree(SHIPPED, copy)
    weights = copy / "quickstart" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
    monkeypatch.setattr(shipped, "SHIPPED", copy)
    monkeypatch.setenv("LIGHTNING_GRPO_CACHE", str(tmp_path / "cache"))
    built = _record_builds(monkeypatch)
    resolve_path(SCRIPT.policy_of(*SCRIPT.ENTRIES["quickstart"]))
    assert len(built) == 1
    assert "model.safetensors fail the sha256 check" in capsys.readouterr().out


def test_the_manifest_records_how_it_was_built():
    manifest = read_manifest(SHIPPED / "quickstart")
    assert manifest["script"] == "tools/build_tiny_weights.py"
    assert manifest["seed"] == manifest["key"]["spec"]["seed"] == 0
    assert {"torch", "transformers", "python"} <= set(manifest["built_with"])
    assert json.loads(json.dumps(manifest)) == manifest


def test_a_warm_start_that_runs_reports_progress_and_time_left(tiny_policy_dir, capsys):
    from lightning_grpo.policy import PolicyConfig
    from lightning_grpo.tiny.warm import warm_start

    model, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    warm_start(model, tok, "arith", steps=20, seed=0, batch_size=4)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warm start: step")]
    assert len(lines) == 10
    assert lines[-1].startswith("warm start: step 20/20")
    assert all("s left" in line for line in lines)


SCORE_TOLERANCE = 0.08
"""Greedy accuracy a rebuild may differ by (weights differ across CPUs at float level): 3 of arith_small's 36
pairs (256 draws)."""


@pytest.mark.slow
def test_a_rebuild_scores_as_the_shipped_policy(tmp_path):
    manifest = read_manifest(SHIPPED / "quickstart")
    rebuilt = SCRIPT.build_shipped("quickstart", tmp_path)
    assert rebuilt["key"] == manifest["key"]
    recorded = manifest["score"]["greedy_accuracy"]
    shipped_score = SCRIPT.score(SHIPPED / "quickstart", "arith_small")["greedy_accuracy"]
    assert abs(rebuilt["score"]["greedy_accuracy"] - recorded) <= SCORE_TOLERANCE
    assert abs(shipped_score - recorded) <= SCORE_TOLERANCE
