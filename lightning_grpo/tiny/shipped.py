"""The warm-started tiny policies shipped inside the package, so a quickstart trains nothing before its first step.

Each lives in ``shipped/<name>/`` (a Hugging Face folder of a few MB) beside a ``manifest.json`` written by
``tools/build_tiny_weights.py``: the key it was built for (name, every spec field, tokenizer version, warm start
and its steps), the versions and seed it was built with, and each file's sha256. ``tiny_folder`` copies a shipped
folder into the cache when the key it asks for is exactly the manifest's, but for the name (a name does not change
the weights); any other key builds as before.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from lightning_grpo.tiny.spec import TinyPolicySpec
from lightning_grpo.tiny.tokenizer import TOKENIZER_VERSION

SHIPPED = Path(__file__).parent / "shipped"
"""Where the shipped folders are (package data, see pyproject.toml)."""
MANIFEST = "manifest.json"


def build_key(
    name: str, spec: TinyPolicySpec, warm_start: str | None, warm_start_steps: int
) -> dict:
    """What decides a tiny build's weights: the same fields as the cache key (``tiny_cache_dir``)."""
    return {
        "name": name,
        "spec": dict(vars(spec)),
        "tokenizer_version": TOKENIZER_VERSION,
        "warm_start": warm_start,
        "warm_start_steps": warm_start_steps if warm_start else 0,
    }


def sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a shipped folder; None when it has none."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def shipped_names() -> list[str]:
    """The names of the shipped tiny policies."""
    if not SHIPPED.is_dir():
        return []
    return sorted(p.name for p in SHIPPED.iterdir() if (p / MANIFEST).is_file())


def bad_files(folder: Path, manifest: dict) -> list[str]:
    """The files of ``folder`` whose sha256 is not the manifest's (or that are missing)."""
    bad = []
    for file, digest in manifest["files"].items():
        path = folder / file
        if not path.is_file() or sha256(path) != digest:
            bad.append(file)
    return bad


def weights_key(key: dict) -> dict:
    """``key`` less the name, which does not change the weights: as JSON reads it back (a tuple is a list)."""
    weights = {field: value for field, value in key.items() if field != "name"}
    return json.loads(json.dumps(weights))


def shipped_folder(key: dict) -> Path | None:
    """The shipped folder built for ``key`` (``build_key``) up to its name, else None: ``tiny:opd-student`` of
    opd-arith.yaml is the ``quickstart`` build under another name, shipped once."""
    wanted = weights_key(key)
    names = shipped_names()
    if key["name"] in names:  # its own name first
        names.remove(key["name"])
        names.insert(0, key["name"])
    for name in names:
        manifest = read_manifest(SHIPPED / name)
        if weights_key(manifest["key"]) == wanted:
            return SHIPPED / name
    return None


def copy_shipped(key: dict, out: Path) -> bool:
    """Copy the shipped folder of ``key`` to ``out`` (checksums verified); False when none matches or it is
    damaged (then the caller builds it, as when nothing is shipped)."""
    folder = shipped_folder(key)
    if folder is None:
        return False
    manifest = read_manifest(folder)
    bad = bad_files(folder, manifest)
    if bad:
        print(
            f"shipped tiny policy {key['name']!r}: {', '.join(bad)} fail the sha256 check of "
            f"{folder / MANIFEST}; building it instead (reinstall the package to restore it)",
            flush=True,
        )
        return False
    shutil.copytree(folder, out, dirs_exist_ok=True)
    built = manifest["built_with"]
    print(
        f"tiny policy {key['name']!r}: the shipped warm start {folder.name!r} ({key['warm_start']}, "
        f"{key['warm_start_steps']} steps; built with torch {built['torch']}), nothing to train",
        flush=True,
    )
    return True
