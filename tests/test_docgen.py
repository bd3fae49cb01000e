"""docs/configuration.md is generated from the code: up to date, complete, and the generator refuses gaps."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import QUICKSTART_ARGS

from lightning_grpo import docgen
from lightning_grpo.cli import flatten, main

DOC = Path(__file__).parents[1] / "docs" / "configuration.md"


def test_committed_reference_is_what_the_generator_prints():
    assert DOC.read_text() == docgen.generate(), (
        "docs/configuration.md is stale: run `python -m lightning_grpo.docgen > docs/configuration.md`"
    )


def test_every_key_of_the_resolved_quickstart_config_is_documented():
    """The keys `--print_config` prints (what a YAML or a sweep can set) all have a row in the reference."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["fit", *QUICKSTART_ARGS, "--print_config"])
    keys = [k for k in flatten(yaml.safe_load(out.getvalue())) if k.split(".")[0] in ("model", "data", "checkpoint")]
    text = DOC.read_text().replace("model.rewards[i].", "model.rewards.")
    missing = [k for k in keys if f"`{k}`" not in text and f"`{k}." not in text]
    assert keys and not missing


def test_a_knob_without_a_docstring_fails_the_generator(monkeypatch):
    @dataclass
    class Knobs:
        """Knobs."""

        documented: int = 1
        """Has a meaning."""
        bare: int = 2

    monkeypatch.setattr(docgen, "DATACLASS_SECTIONS", (("model.knobs", Knobs),))
    with pytest.raises(docgen.UndocumentedKnob, match=r"Knobs\.bare"):
        docgen.generate()
