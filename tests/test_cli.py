"""``lightning-grpo``: help, short config errors, the one optimizer source, a user's module, and the seed.

Also: ``--print_config`` round-trips, and every key of the resolved config is logged.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import warnings
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Trainer

from lightning_grpo import docgen
from lightning_grpo.cli import flatten, main
from lightning_grpo.cli_help import SECTIONS
from lightning_grpo.config import GRPOConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.timing import is_timing
from lightning_grpo.upstream import UPSTREAM_WARNINGS, quiet_upstream_warnings

"""Wall-clock metrics: the only columns two identical runs may differ in."""


def _rows(csv_path) -> list[dict[str, str]]:
    with open(csv_path, newline="") as f:
        return [{k: v for k, v in row.items() if not is_timing(k)} for row in csv.DictReader(f)]


@pytest.mark.slow
def test_print_config_round_trips(quickstart_run, tmp_path, monkeypatch, capsys):
    """Print the quickstart's resolved config, fit from the printed file: the same run, metric for metric."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["fit", *quickstart_run.argv, "--print_config"])
    assert stop.value.code == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    main(["fit", "--config", str(printed)])
    first, again = _rows(quickstart_run.log_dir / "metrics.csv"), _rows(tmp_path / "runs/quickstart/version_0/metrics.csv")
    assert [r["step"] for r in first if r["reward/mean"]] == ["1", "2"]
    assert again == first  # every logged value, training and validation rows, identical


@pytest.mark.slow
def test_every_config_key_is_logged_as_a_dotted_param(quickstart_run):
    """The CSV logger's hparams.yaml holds the CLI's keys, the names a W&B sweep's parameters use."""
    params = yaml.safe_load((quickstart_run.log_dir / "hparams.yaml").read_text())
    assert params["model.rl.batch_per_replica"] == 64 and params["trainer.max_steps"] == 2
    assert params["data.val_size"] == 16 and params["model.rewards"] == [
        {"name": "arith", "weight": 1.0, "timeout_s": 60.0, "per_sample": False}]


def test_flatten_makes_dotted_keys_and_keeps_lists():
    tree = {"model": {"rl": {"group_size": 8}, "rewards": [{"name": "arith"}]}, "trainer": {"callbacks": None}, "e": {}}
    assert flatten(tree) == {"model.rl.group_size": 8, "model.rewards": [{"name": "arith"}],
                             "trainer.callbacks": None, "e": {}}


# -- a CLI run prints no warning our code causes ------------------------------------------------------------------
NOT_OURS: dict[str, str] = {}
"""Warnings a quickstart run still prints, none caused by our code: message start -> where it comes from (none now:
the upstream ones are filtered at their module: upstream.UPSTREAM_WARNINGS)."""


def test_lightnings_own_warnings_on_every_fit_are_filtered(tmp_path):
    """Every fit and validate printed torch's LeafSpec FutureWarning from Lightning's CombinedLoader, and every
    mixed-precision fit (the GPU recipes) Lightning's model-summary note: both upstream's, both silenced."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    def caught(quiet: bool) -> list[str]:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            if quiet:
                quiet_upstream_warnings()
            Trainer(max_steps=1, precision="bf16-mixed", accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, limit_val_batches=0, default_root_dir=tmp_path).fit(BoringModel())
        return [str(w.message) for w in got if any(str(w.message).startswith(m) for m in UPSTREAM_WARNINGS)]

    assert len(caught(quiet=False)) == 2  # Lightning and torch still warn here
    assert caught(quiet=True) == []


@pytest.mark.parametrize("start", list(UPSTREAM_WARNINGS))
def test_each_upstream_warning_is_filtered_from_its_module_only(start):
    category, module, _ = UPSTREAM_WARNINGS[start]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        quiet_upstream_warnings()
        for source in (module, "lightning_grpo.module", f"{module}_other"):
            warnings.warn_explicit(f"{start} (from {source})", category, "x.py", 1, module=source)
    assert [str(w.message) for w in got] == [f"{start} (from lightning_grpo.module)", f"{start} (from {module}_other)"]


_RECORDING_RUN = """
import json, logging, sys, warnings
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(f"log {record.name}: {record.getMessage()}")
for name in ("", "lightning.pytorch", "lightning.fabric", "lightning_grpo"):
    logging.getLogger(name).addHandler(Keep(logging.WARNING))
out, args, sys.argv = sys.argv[1], sys.argv[2:], sys.argv[:1]
with warnings.catch_warnings(record=True) as caught:  # the default filters: what the run would print
    from lightning_grpo.cli import main
    main(args)
records += [f"{w.category.__name__}: {w.message}" for w in caught]
open(out, "w").write(json.dumps(records))
"""


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--data.val_size=0"]], ids=["validating", "no-held-out-prompts"])
def test_a_quickstart_run_prints_no_warning_our_code_causes(tmp_path, extra):
    """A fresh process (Lightning prints some warnings once per process); every warning it would print and every
    WARNING log record is collected. Without held-out prompts an empty val_dataloader made Lightning warn "Total
    length of `list` across ranks is zero" on every fit."""
    import json
    import os
    import subprocess
    import sys

    from helpers import QUICKSTART_ARGS

    out = tmp_path / "warnings.json"
    proc = subprocess.run([sys.executable, "-c", _RECORDING_RUN, str(out), "fit", *QUICKSTART_ARGS, *extra],
                          cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(out.read_text())
    ours = [w for w in printed if not any(w.split(": ", 1)[-1].startswith(m) for m in NOT_OURS)]
    assert ours == [], "\n".join(ours)
    assert (tmp_path / "runs" / "quickstart" / "version_0" / "metrics.csv").is_file()  # the run itself happened


# -- the CLI a user types ----------------------------------------------------------------------------------------
QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``lightning-grpo <argv>`` in-process: (exit code, stdout, stderr)."""
    code = 0
    try:
        main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def _words(text: str) -> str:
    return " ".join(text.split())  # argparse wraps help lines


def test_help_lists_fit_validate_plot_show_certify_but_not_test_or_predict(capsys):
    code, out, _ = _run(["--help"], capsys)
    assert code == 0 and "{fit,validate,plot,show,certify}" in out
    assert "Draw reward, loss, KL, clip fraction" in _words(out)
    assert "Print the completions (whole episodes with model.env) of one loop step" in _words(out)
    assert " test " not in out and "predict" not in out
    code, _, err = _run(["test"], capsys)
    assert code == 2 and "invalid choice: 'test'" in err and "usage:" not in err


@pytest.mark.parametrize("section", ["model.rl", "model.optim", "model.rollout", "model.policy", "model.policy.tiny"])
def test_section_help_shows_every_field_with_its_docstring(section, capsys):
    code, out, _ = _run(["fit", f"--{section}.help"], capsys)
    assert code == 0
    cls = SECTIONS[section]
    for name, doc in docgen.field_docs(cls).items():
        assert f"--{section}.{name}" in out
        assert _words(doc)[:40] in _words(out), f"{section}.{name}: description missing from --help"


def test_model_help_and_fit_help_show_descriptions(capsys):
    code, out, _ = _run(["fit", "--model.help"], capsys)
    assert code == 0
    assert _words(docgen.field_docs(GRPOConfig)["micro_batch_per_replica"]) in _words(out)
    assert "None = the seed ``seed_everything`` applied" in _words(out)  # model.seed, from the Args: section
    code, out, _ = _run(["fit", "--help"], capsys)
    assert code == 0 and "--model.help" in out and "--model.rl.help" in out and "--data.help" in out
    code, out, _ = _run(["fit", "--data.help"], capsys)  # the data module is picked by class_path too (DPO's)
    assert code == 0 and "held-out prompts to use" in _words(out)  # data.val_size, from PromptDataModule's Args:


def test_a_bad_rl_config_is_reported_in_a_few_lines(capsys, monkeypatch):
    code, out, err = _run(["fit", "--config", QUICKSTART, "--model.rl.mini_batch_per_replica=12"], capsys)
    assert code == 2
    assert err.splitlines()[0] == "lightning-grpo: error: invalid rl config (1 problem):"
    assert "mini_batch_per_replica=12 must divide batch_per_replica=64" in err
    assert len(err.splitlines()) <= 4 and "Traceback" not in err + out and "usage:" not in err
    monkeypatch.setenv("LIGHTNING_GRPO_DEBUG", "1")  # the whole exception (and its traceback) on request
    with pytest.raises(ValueError, match="must divide"):
        main(["fit", "--config", QUICKSTART, "--model.rl.mini_batch_per_replica=12"])


@pytest.mark.parametrize(("flag", "says"), [
    ("--model.rl.batch_per_replica=abc", 'Parser key "rl.batch_per_replica"'),
    ("--model.rl.batch_per_replca=4", "unrecognized arguments: --rl.batch_per_replca=4"),
    ("--trainer.max_stepz=3", "unrecognized arguments: --trainer.max_stepz=3"),
    ("--model.rollout.temperature=0", "temperature=0.0: must be > 0"),
    ("--model.class_path=no_such_pkg.Module", "No module named 'no_such_pkg'"),
])
def test_parse_and_load_errors_are_short_too(flag, says, capsys):
    code, _, err = _run(["fit", "--config", QUICKSTART, flag], capsys)
    assert code == 2 and says in err
    assert len(err.splitlines()) <= 6 and "Traceback" not in err and "usage:" not in err and "NoneType" not in err


@pytest.mark.parametrize("how", ["flag", "yaml"])
def test_the_retired_rl_grad_accum_is_refused_by_name_with_what_replaces_it(how, tmp_path, capsys):
    retired = tmp_path / "retired.yaml"
    retired.write_text("model:\n  rl:\n    grad_accum: 4\n")
    extra = ["--model.rl.grad_accum=4"] if how == "flag" else ["--config", str(retired)]
    code, out, err = _run(["fit", "--config", QUICKSTART, *extra], capsys)
    assert code == 2
    assert err.startswith("lightning-grpo: error: rl.grad_accum is retired for GRPO and was removed")
    assert "n_micro = mini_batch_per_replica / micro_batch_per_replica. Set micro_batch_per_replica" in err
    assert len(err.splitlines()) <= 3 and "Traceback" not in err + out and "usage:" not in err


@pytest.mark.parametrize("flag", ["--optimizer=Adam", "--optimizer.lr=0.1", "--optimizer=SGD", "--lr_scheduler=ConstantLR"])
def test_optimizer_flags_are_refused_with_a_pointer_to_model_optim(flag, capsys):
    code, _, err = _run(["fit", "--config", QUICKSTART, flag], capsys)
    assert code == 2 and "Not accepted: the optimizer is AdamW from model.optim" in err and "--model.optim.lr" in err


# -- runs: a user's subclass, and the seed -----------------------------------------------------------------------
class BonusModule(GRPOModule):
    """A user's GRPOModule subclass, picked with ``--model.class_path test_cli.BonusModule``.

    Args:
        bonus: added to every reward.
    """

    def __init__(self, bonus: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bonus = bonus

    def compute_rewards(self, rollouts):
        total, parts = super().compute_rewards(rollouts)
        return total + self.bonus, parts


def _short_run(policy_dir, name: str, *extra: str) -> list[str]:
    """2 loop steps (n_mini = 2, max_steps = 4) of 4 prompts x 4 on the session's tiny policy, digit-share reward."""
    return ["fit", "--config", QUICKSTART, f"--model.policy.path={policy_dir}", "--model.policy.warm_start=null",
            "--model.rl.batch_per_replica=16", "--model.rl.group_size=4", "--model.rl.mini_batch_per_replica=8",
            "--model.rl.micro_batch_per_replica=0", "--model.rewards=[{name: helpers:digit_share}]",
            "--trainer.max_steps=4", "--data.val_size=0", "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.name={name}", *extra]


@pytest.mark.heavy  # a CLI fit: CI and `make test-integration`
def test_model_class_path_selects_a_users_subclass(tiny_policy_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = _short_run(tiny_policy_dir, "bonus", "--model.class_path=test_cli.BonusModule", "--model.bonus=10")
    code, _, err = _run(argv, capsys)
    assert code == 0, err[-2000:]
    rows = [r for r in _rows(tmp_path / "runs/bonus/version_0/metrics.csv") if r["reward/mean"]]
    assert len(rows) == 2 and all(float(r["reward/mean"]) >= 10 for r in rows)
    params = yaml.safe_load((tmp_path / "runs/bonus/version_0/hparams.yaml").read_text())
    assert params["model.class_path"] == "test_cli.BonusModule" and params["model.bonus"] == 10.0


def test_a_module_in_the_working_folder_is_found(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_grpo.py").write_text(
        "from lightning_grpo import GRPOModule\n\n\nclass MyModule(GRPOModule):\n"
        "    \"\"\"Mine.\n\n    Args:\n        knob: my own knob.\n    \"\"\"\n\n"
        "    def __init__(self, knob: int = 3, **kwargs):\n        super().__init__(**kwargs)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    code, out, _ = _run(["fit", "--model.help", "my_grpo.MyModule"], capsys)
    assert code == 0 and "--model.knob KNOB my own knob." in _words(out) and "--model.rl.batch_per_replica" in out


@pytest.mark.heavy  # a CLI fit and validate: CI and `make test-integration`
def test_validate_scores_a_checkpoint_as_the_fit_did(tiny_policy_dir, tmp_path, monkeypatch, capsys):
    """`validate --ckpt_path` of the last checkpoint gives the val/reward the fit logged at that loop step, labelled
    with that loop step (it said step 0: the loop counter came back only when training resumed)."""
    monkeypatch.chdir(tmp_path)
    held_out = ["--data.val_size=8", "--trainer.val_check_interval=2", "--trainer.num_sanity_val_steps=0",
                "--model.rewards=[{name: helpers:char_codes}]"]  # greedy text of an untrained policy scores > 0
    fit = _short_run(tiny_policy_dir, "fit", *held_out)
    fit[fit.index("--trainer.enable_checkpointing=false")] = "--trainer.enable_checkpointing=true"
    code, _, err = _run(fit, capsys)
    assert code == 0, err[-2000:]
    fitted = [r["val/reward"] for r in _rows(tmp_path / "runs/fit/version_0/metrics.csv") if r["val/reward"]]
    ckpt = max((tmp_path / "runs/fit/version_0/checkpoints").glob("*.ckpt"))
    validate = ["validate", *_short_run(tiny_policy_dir, "val", *held_out)[1:], f"--ckpt_path={ckpt}"]
    validate[validate.index("--trainer.enable_checkpointing=false")] = "--trainer.enable_checkpointing=true"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = _run(validate, capsys)
    assert code == 0, err[-2000:]
    # every callback state of the fit's checkpoint finds its callback: no "Please add the following callbacks"
    assert not [str(w.message) for w in caught if "callbacks used to create the checkpoint" in str(w.message)]
    rows = _rows(tmp_path / "runs/val/version_0/metrics.csv")
    assert len(fitted) == 1 and float(fitted[0]) > 0 and [r["val/reward"] for r in rows] == fitted
    assert [r["step"] for r in rows] == ["2"]  # the checkpoint's loop step, as the fit's row


@pytest.fixture(scope="module")
def seeded_runs(tiny_policy_dir, tmp_path_factory):
    """Four short CLI runs: seed_everything 1, 1 again, 2, and 2 with --model.seed=1. name -> (rows, params, out)."""
    cwd, old, runs = tmp_path_factory.mktemp("seeds"), os.getcwd(), {}
    os.chdir(cwd)
    try:
        for name, extra in (("one", ["--seed_everything=1"]), ("again", ["--seed_everything=1"]),
                            ("two", ["--seed_everything=2"]), ("two_model1", ["--seed_everything=2", "--model.seed=1"])):
            with contextlib.redirect_stdout(io.StringIO()) as out:
                main(_short_run(tiny_policy_dir, name, *extra))
            log = cwd / "runs" / name / "version_0"
            runs[name] = (_rows(log / "metrics.csv"), yaml.safe_load((log / "hparams.yaml").read_text()), out.getvalue())
    finally:
        os.chdir(old)
        os.environ.pop("PL_GLOBAL_SEED", None)
    return runs


def _column(rows, key: str) -> list[float]:
    return [float(r[key]) for r in rows if r[key]]


@pytest.mark.heavy  # two CLI fits: CI and `make test-integration`
def test_another_seed_everything_changes_sampling_and_metrics(seeded_runs):
    one, two = seeded_runs["one"][0], seeded_runs["two"][0]
    assert len(_column(one, "reward/mean")) == 2
    assert _column(one, "reward/mean") != _column(two, "reward/mean")  # sampling
    assert _column(one, "grpo/loss") != _column(two, "grpo/loss")  # training


@pytest.mark.heavy  # two CLI fits (make test keeps tests/test_golden_metrics.py): CI and `make test-integration`
def test_the_same_seed_everything_is_bit_identical(seeded_runs):
    assert seeded_runs["one"][0] == seeded_runs["again"][0]  # every logged value, timings aside


@pytest.mark.heavy  # the module's seeded CLI fits (its other users are heavy too): CI and `make test-integration`
def test_model_seed_overrides_seed_everything_and_the_effective_seed_is_logged(seeded_runs):
    assert seeded_runs["two_model1"][0] == seeded_runs["one"][0]  # model.seed=1 wins over seed_everything=2
    params = {name: run[1] for name, run in seeded_runs.items()}
    assert (params["one"]["model.seed"], params["two"]["model.seed"], params["two_model1"]["model.seed"]) == (1, 2, 1)
    assert params["two_model1"]["seed_everything"] == 2
    assert "seed             2  (from seed_everything)" in seeded_runs["two"][2]
    assert "seed             1  (from model.seed)" in seeded_runs["two_model1"][2]


@pytest.mark.parametrize("form", ["equals", "space"])
def test_a_null_on_the_command_line_is_none_in_a_subclass_mode_section(form, monkeypatch):
    """`--model.policy.warm_start=null` reaches the module as None (jsonargparse alone hands the string 'None' to a
    `str | None` field under --model.class_path); a key set to a real string, and one the command line left alone,
    keep their values."""
    import lightning_grpo.cli as cli

    seen = {}

    def stop_before_the_module(self):  # the parsed config is what is checked: no model, no fit
        seen["policy"] = self.config.fit.model.init_args.policy
        raise SystemExit(0)

    monkeypatch.setattr(cli.GRPOCLI, "before_instantiate_classes", stop_before_the_module)
    null = ["--model.policy.warm_start=null"] if form == "equals" else ["--model.policy.warm_start", "null"]
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"), *null,
              "--model.policy.chat_template=None.jinja"])
    assert seen["policy"].warm_start is None
    assert seen["policy"].chat_template == "None.jinja" and seen["policy"].path == "tiny:quickstart"
