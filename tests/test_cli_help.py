"""``lightning-grpo`` answers help fast: the top-level ``--help`` without Lightning, no vLLM / wandb / matplotlib /
transformers model code imported by the CLI module, and ``fit --help`` lists the ``data.*`` keys."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_grpo import docgen
from lightning_grpo.__main__ import TOP_HELP
from lightning_grpo.cli import GRPOCLI, main
from lightning_grpo.cli_help import fresh_fit_help
from lightning_grpo.data.prompts import PromptDataModule

HEAVY = ("vllm", "wandb", "matplotlib", "transformers.models.", "peft", "datasets")
"""Imported only when a run needs them (an engine, a logger, a plot, a model): never to parse a config."""


def _modules_after(code: str) -> list[str]:
    """The modules ``code`` imports in a fresh interpreter, beyond those already there before it."""
    probe = f"import sys\nbefore = set(sys.modules)\n{code}\nprint('\\n'.join(sorted(set(sys.modules) - before)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
    return out.stdout.split()


def test_the_top_help_imports_no_lightning_and_no_torch():
    """`lightning-grpo --help` took ~5 s of CPU on main (Lightning pulls torch, torchmetrics, transformers)."""
    loaded = _modules_after("from lightning_grpo.__main__ import main\nmain(['--help'])")
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "lightning", "jsonargparse", "transformers")]


@pytest.mark.heavy  # fresh interpreters: CI and `make test-integration`
def test_the_cli_module_imports_nothing_heavy_beyond_lightning():
    """Lightning itself imports torchmetrics, which imports transformers' auto classes and matplotlib: that is the
    floor of `fit --help` and of a config error. Nothing of ours may add to it."""
    loaded = _modules_after("import lightning.pytorch\nbefore = set(sys.modules)\nimport lightning_grpo.cli")
    assert not [m for m in loaded if m.startswith(HEAVY) and m.split(".")[0] != "lightning"], loaded


def test_the_top_help_is_the_clis_own(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-grpo", "--help"])
    with pytest.raises(SystemExit):
        GRPOCLI(args=["--help"])
    assert capsys.readouterr().out == TOP_HELP


def test_fit_help_lists_every_data_key_with_its_description(capsys):
    """main listed `--data.help` only: the data keys were one more command away."""
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    docs = docgen.args_docs(PromptDataModule)
    assert {"source", "val_size", "on_bad_record"} <= set(docs)
    for name, doc in docs.items():
        assert f"--data.{name}" in out and " ".join(doc.split())[:30] in out, name


@pytest.mark.heavy  # a fresh interpreter and a fresh parser: CI and `make test-integration`
def test_fit_help_is_answered_without_lightning_from_the_clis_own_text(capsys):
    """`lightning-grpo fit --help` took ~10 s of CPU on a busy 2-core machine (Lightning's import alone ~8.5 s):
    __main__ prints fit_help.txt instead, which must be exactly what the CLI prints (tools/write_fit_help.py)."""
    import lightning_grpo.__main__ as entry

    recorded = entry.fit_help()
    assert recorded is not None, "fit_help.txt was recorded under other versions: run python tools/write_fit_help.py"
    assert fresh_fit_help() == recorded, "fit_help.txt is stale: run python tools/write_fit_help.py"
    assert {"--data.source", "--data.on_bad_record", "--checkpoint.every_n_loop_steps"} <= set(recorded.split())
    entry.main(["fit", "--help"])
    assert capsys.readouterr().out == recorded
    quiet = "import contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()):\n    main(['fit', '--help'])"
    loaded = _modules_after("from lightning_grpo.__main__ import main\n" + quiet)
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "lightning", "jsonargparse", "transformers")]


def test_fit_help_asks_the_parser_under_other_versions(monkeypatch):
    """Another Lightning's Trainer has other flags: the recorded text is printed only under the versions it names."""
    import lightning_grpo.__main__ as entry

    monkeypatch.setattr(entry.metadata, "version", lambda name: "0.0.1")
    assert entry.fit_help() is None
