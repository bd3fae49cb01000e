"""Build the warm-started tiny policies the package ships (``lightning_grpo/tiny/shipped/<name>/``).

    python tools/build_tiny_weights.py [NAME ...] [--out DIR]

NAME defaults to every entry of ``ENTRIES``; ``--out`` defaults to the package's ``shipped/`` folder. Each entry
is the tiny policy of a shipped config (its ``policy.path``, ``policy.tiny``, warm start and seed, read from the
YAML as the CLI reads them): built and warm-started by ``tiny_folder``'s own code (``build.build_folder``), then
written with a ``manifest.json`` holding the build key ``tiny_folder`` matches, the seed, the torch /
transformers / python versions and CPU threads it was built with, the seconds it took, its greedy accuracy on
its task (text warm starts) and each file's sha256. Weights differ across CPUs at float level: a rebuild
elsewhere scores the same (tests/tiny/test_shipped.py), it is not byte-identical.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

ENTRIES = {
    "quickstart": ("configs/quickstart.yaml", "model.policy"),
    "tools": ("configs/tools-quickstart.yaml", "model.policy"),
    "vlm-quickstart": ("configs/vlm-quickstart.yaml", "model.policy"),
    "opd-teacher": ("configs/opd-arith.yaml", "model.opd.teacher"),
}
"""Shipped name -> (config, the YAML section of its policy). The name is the one in ``policy.path``
(``tiny:<name>``); several configs may share a build (lora-, async-quickstart use ``quickstart``'s; so does
opd-arith.yaml's ``tiny:opd-student``, the same build under another name: ``shipped.shipped_folder``)."""
SCORE_ITEMS = 256
SCORE_SEED = 99
"""The draw ``score`` measures greedy accuracy on (the task's train split, as tests/tiny/test_tiny.py)."""


def section(config: dict, dotted: str) -> dict:
    """The sub-dict of ``config`` at ``dotted`` (``model.policy``)."""
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def policy_of(config_path: str, dotted: str):
    """The ``PolicyConfig`` of a config's section with the seed a run gives it (``policy.tiny.seed``, else
    ``model.seed``, else ``seed_everything``, else 0; as ``base.run_seed`` and ``policy.with_seed``)."""
    from lightning_grpo.policy import PolicyConfig, with_seed
    from lightning_grpo.tiny.spec import TinyPolicySpec

    config = yaml.safe_load((ROOT / config_path).read_text(encoding="utf-8"))
    raw = dict(section(config, dotted))
    tiny = raw.get("tiny")
    fields = {k: raw[k] for k in ("path", "warm_start", "warm_start_steps") if k in raw}
    policy = PolicyConfig(**fields, tiny=TinyPolicySpec(**tiny) if tiny else None)
    model = config.get("model", {})
    model = model.get("init_args", model)
    seed = model.get("seed")
    if seed is None:
        seed = config.get("seed_everything") or 0
    return with_seed(policy, seed)


def score(folder: Path, warm_start: str) -> dict | None:
    """Greedy accuracy of a text policy on its warm start's task; None for the tool and image warm starts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_grpo.data.tasks import get_task
    from lightning_grpo.tiny.tool_warm import TOOL_TASK
    from lightning_grpo.tiny.warm import greedy_accuracy

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if warm_start == TOOL_TASK or "vision_config" in config:
        return None
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    items = get_task(warm_start).items(SCORE_ITEMS, seed=SCORE_SEED)
    accuracy = greedy_accuracy(model, tok, items)
    return {"greedy_accuracy": accuracy, "items": SCORE_ITEMS, "seed": SCORE_SEED}


def build_shipped(name: str, out_root: Path) -> dict:
    """Build entry ``name`` into ``out_root/name`` (replacing it) and return its manifest."""
    import torch
    import transformers

    from lightning_grpo.tiny.build import build_folder
    from lightning_grpo.tiny.shipped import MANIFEST, build_key, sha256

    config_path, dotted = ENTRIES[name]
    policy = policy_of(config_path, dotted)
    if policy.path != f"tiny:{name}":
        raise ValueError(f"{config_path} {dotted}.path={policy.path!r}: entry {name!r} needs 'tiny:{name}'")
    key = build_key(name, policy.tiny, policy.warm_start, policy.warm_start_steps)
    tmp = out_root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    build_folder(tmp, policy.tiny, policy.warm_start, policy.warm_start_steps)
    seconds = time.perf_counter() - start
    files = sorted(p.name for p in tmp.iterdir() if p.is_file())
    manifest = {
        "key": key,
        "seed": policy.tiny.seed,
        "config": f"{config_path} ({dotted})",
        "script": "tools/build_tiny_weights.py",
        "built_with": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
        },
        "seconds": round(seconds, 1),
        "score": score(tmp, policy.warm_start) if policy.warm_start else None,
        "files": {file: sha256(tmp / file) for file in files},
    }
    text = json.dumps(manifest, indent=2) + "\n"
    (tmp / MANIFEST).write_text(text, encoding="utf-8")
    out = out_root / name
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return manifest


def main(argv: list[str] | None = None) -> None:
    from lightning_grpo.tiny.shipped import SHIPPED

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"entries to build (default: all of {sorted(ENTRIES)})")
    parser.add_argument("--out", type=Path, default=SHIPPED, help="folder to write NAME/ into")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(ENTRIES))
    if unknown:
        parser.error(f"unknown entries {unknown}; known: {sorted(ENTRIES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or sorted(ENTRIES):
        manifest = build_shipped(name, args.out)
        size = sum((args.out / name / f).stat().st_size for f in manifest["files"])
        print(f"{name}: {size / 1e6:.2f} MB, {manifest['seconds']} s, score {manifest['score']}", flush=True)


if __name__ == "__main__":
    main()
