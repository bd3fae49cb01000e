"""Errors a user causes after the config loads are reported in a few lines, naming cause, knob or file, and fix.

Each case runs ``lightning-grpo fit`` in its own process, as a user would, and reads its stderr: the report starts
with ``lightning-grpo: error:`` and is 2-6 lines, no traceback is printed, and the full one is kept in the run's
``error.log`` (or shown with LIGHTNING_GRPO_DEBUG=1). The cases' processes fork from the session's fork server
(``helpers.run_forked``: the console script's entry point, its own exit code and stderr, torch imported once); the
debug case starts a fresh interpreter, so what importing the CLI prints is checked too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import QUICKSTART_ARGS, run_forked

from lightning_grpo.checkpoint.resume import CheckpointPathError, check_ckpt_file
from lightning_grpo.policy import PolicyConfig, PolicyNotFoundError, resolve_path

TESTS = Path(__file__).parent
SMALL = ["--trainer.max_steps=1", "--data.val_size=0", "--model.rl.batch_per_replica=16",
         "--model.rl.micro_batch_per_replica=16", "--trainer.enable_progress_bar=false"]


def _fit(tmp_path: Path, *extra: str, debug: bool = False, fresh: bool = False) -> tuple[int, str]:
    """``lightning-grpo fit`` of the shortened quickstart plus ``extra`` in ``tmp_path``: a fork server child, or with
    ``fresh`` a new interpreter; its exit code and stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path]), "LIGHTNING_GRPO_DEBUG": str(int(debug))}
    argv = ["fit", *QUICKSTART_ARGS, *SMALL, *extra]
    if not fresh:
        code, _, stderr = run_forked("lightning_grpo.__main__:main", argv, tmp_path, env)
        return code, stderr
    proc = subprocess.run([sys.executable, "-m", "lightning_grpo.cli", *argv],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    return proc.returncode, proc.stderr


def _report(stderr: str) -> list[str]:
    """The short report: from its first line to the end of stderr."""
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("lightning-grpo: error:")), None)
    assert start is not None, stderr[-3000:]
    return lines[start:]


def _files(tmp_path: Path) -> str:
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "config.json").write_text("{}")
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    with zipfile.ZipFile(tmp_path / "inside.ckpt", "w") as z:  # a zip archive, but not what torch.save writes
        z.writestr("archive/data.pkl", b"garbage")
    return str(tmp_path)


CASES = {
    "reward-raises": (["--model.rewards=[{name: reward_fns:fails_as_batch}]"],
                      ["'reward_fns:fails_as_batch' raised RuntimeError: reward server rejected the batch",
                       "reward_fns.py:", "model.rewards"]),
    "reward-strings": (["--model.rewards=[{name: reward_fns:returns_strings}]"],
                       ["'reward_fns:returns_strings' returned", "(str)", "real numbers"]),
    "reward-count": (["--model.rewards=[{name: reward_fns:one_short}]"], ["returned 15 values for 16 completions"]),
    "reward-nan": (["--model.rewards=[{name: reward_fns:nan_at_two}]", "--trainer.max_steps=2"],  # prompt 2: step 2
                   ["'reward_fns:nan_at_two' returned nan", "must be finite"]),
    "reward-1e39": (["--model.rewards=[{name: reward_fns:beyond_float32}]"], ["returned 1e+39", "must fit float32"]),
    "ckpt-missing": (["--ckpt_path={dir}/missing.ckpt"], ["--ckpt_path={dir}/missing.ckpt: no such file",
                                                          "--ckpt_path=last"]),
    "ckpt-not-zip": (["--ckpt_path={dir}/text.ckpt"], ["--ckpt_path={dir}/text.ckpt: not a PyTorch checkpoint",
                                                       "16 bytes"]),
    "ckpt-damaged": (["--ckpt_path={dir}/inside.ckpt"], ["--ckpt_path={dir}/inside.ckpt: cannot be read",
                                                         "damaged"]),
    "policy-not-a-model": (["--model.policy.path={dir}/notamodel"],
                           ["policy.path='{dir}/notamodel' is a folder but not a Hugging Face model",
                            "config.json with a model_type", "tokenizer file", "save_pretrained"]),
    "max-new-tokens": (["--model.rollout.max_new_tokens=1000"],  # main named a max_prompt_tokens=1 nobody set
                       ["rollout.max_new_tokens=1000 leaves 0 tokens of a 256-token context", "lower "
                        "rollout.max_new_tokens"]),
    "policy-nowhere": (["--model.policy.path={dir}/no/such/folder"],
                       ["policy.path='{dir}/no/such/folder' is neither a local folder nor a Hugging Face Hub id"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_user_error_after_setup_is_a_short_report(case, tmp_path):
    folder = _files(tmp_path)
    extra, says = CASES[case]
    code, stderr = _fit(tmp_path, *(a.replace("{dir}", folder) for a in extra))
    report = _report(stderr)
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert "args parameter is intended" not in stderr and "litlogger" not in stderr  # no noise from our wiring
    assert 2 <= len(report) <= 6, "\n".join(report)
    for words in says:
        assert words.replace("{dir}", folder) in "\n".join(report), "\n".join(report)
    if case.startswith("reward"):  # the run had a folder: the traceback is kept there, and the report says where
        log = next(tmp_path.glob("runs/quickstart/version_*/error.log"))
        assert f"full traceback: {log.relative_to(tmp_path)}" in report[-1]
        assert "Traceback (most recent call last)" in log.read_text()


@pytest.mark.slow
def test_debug_shows_the_traceback(tmp_path):
    code, stderr = _fit(tmp_path, "--model.rewards=[{name: reward_fns:fails_as_batch}]", debug=True, fresh=True)
    assert code == 1 and "Traceback (most recent call last)" in stderr and "RewardError" in stderr
    assert "args parameter is intended" not in stderr and "litlogger" not in stderr  # nor from importing the CLI


def test_the_checks_run_without_a_trainer(tmp_path):
    """The same refusals from Python: before any model is built or torch.load runs."""
    with pytest.raises(CheckpointPathError, match="no such file"):
        check_ckpt_file(tmp_path / "missing.ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PolicyNotFoundError, match=r"holds nothing"):
        resolve_path(PolicyConfig(path=str(tmp_path / "empty")))
