"""``lightning-grpo show``: a loop step's rows of completions.jsonl, episodes whole, read as a person reads them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_completions import episode_rows

from lightning_grpo.cli import main as cli_main
from lightning_grpo.completions import format_sample


def write_run(folder):
    """A run folder whose completions.jsonl holds an earlier line, step 3's two episode rows and one of step 4."""
    rows = episode_rows().samples(2, group_size=2)
    later = {**rows[0], "step": 4}
    folder.mkdir(parents=True)
    lines = [{"step": 0, "earlier": True}, *rows, later]
    (folder / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return rows


def test_show_prints_the_episodes_of_the_step_asked_for(tmp_path, capsys):
    rows = write_run(tmp_path / "runs" / "tools" / "version_0")
    cli_main(["show", str(tmp_path / "runs"), "--step", "3"])  # a folder of runs: the newest completions.jsonl
    out = capsys.readouterr().out
    head, body = out.split("\n\n", 1)
    assert head.endswith("completions.jsonl: loop step 3, 2 row(s)")
    assert body.strip() == "\n\n".join(format_sample(r) for r in rows)  # the console's own rendering
    assert "  call add(a=3, b=4) -> '7'" in body and "  | Tools:" in body
    cli_main(["show", str(tmp_path / "runs" / "tools" / "version_0")])  # default: the last step logged
    assert "loop step 4, 1 row(s)" in capsys.readouterr().out


def test_show_refuses_a_step_not_logged_and_a_folder_without_completions(tmp_path, capsys):
    write_run(tmp_path / "run")
    with pytest.raises(SystemExit):
        cli_main(["show", str(tmp_path / "run"), "--step", "9"])
    assert "--step 9: " in (err := capsys.readouterr().err) and "holds loop steps 3, 4; pick one" in err
    with pytest.raises(SystemExit):
        cli_main(["show", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert "no completions.jsonl at or under" in err and len(err.splitlines()) <= 2


def test_show_answers_without_importing_the_training_stack():
    code = "import sys, lightning_grpo.show; print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
