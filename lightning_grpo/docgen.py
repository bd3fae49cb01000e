"""Generates ``docs/configuration.md`` from the config dataclasses and the classes the CLI builds.

    python -m lightning_grpo.docgen > docs/configuration.md

Every knob's meaning is its field docstring (dataclasses) or its ``Args:`` entry (classes), the
same text ``lightning-grpo fit --help`` shows; defaults and types come from the code. A knob with
no description makes the generator fail, so the reference cannot silently fall behind the code
(``tests/test_docgen.py`` checks that the committed file is what this prints).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import sys
import textwrap
from collections.abc import Iterator

from lightning_grpo.alarm import SignalAlarm
from lightning_grpo.checkpoint import GRPOCheckpoint
from lightning_grpo.cli import TRAINER_DEFAULTS
from lightning_grpo.completions import CompletionLog
from lightning_grpo.config import (
    CertificateConfig,
    GRPOConfig,
    OptimConfig,
    RolloutConfig,
    ServerConfig,
    VLLMConfig,
)
from lightning_grpo.correction import RolloutCorrection
from lightning_grpo.data.preference_module import PreferenceDataModule
from lightning_grpo.data.prompts import PromptDataModule
from lightning_grpo.data.rewards import RewardSpec
from lightning_grpo.dpo import DPOConfig, DPOModule
from lightning_grpo.envs.config import EnvConfig
from lightning_grpo.handoff import HandoffCallback
from lightning_grpo.lora import LoraConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.objectives.opd import OPDConfig
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.summary import RunSummary
from lightning_grpo.tiny.spec import TinyPolicySpec

DATACLASS_SECTIONS = (
    ("model.rl", GRPOConfig),
    ("model.optim", OptimConfig),
    ("model.rl.rollout_correction", RolloutCorrection),
    ("model.rollout", RolloutConfig),
    ("model.rollout.vllm", VLLMConfig),
    ("model.rollout.server", ServerConfig),
    ("model.rollout.certificate", CertificateConfig),
    ("model.policy", PolicyConfig),
    ("model.policy.tiny", TinyPolicySpec),
    ("model.policy.lora", LoraConfig),
    ("model.rewards[i]", RewardSpec),
    ("model.opd", OPDConfig),
    ("model.dpo", DPOConfig),
    ("model.env", EnvConfig),
)
"""(key prefix, dataclass): one table each, in this order."""
CLASS_SECTIONS = (
    ("model", GRPOModule, "the module; its other arguments are the sections above"),
    ("data", PromptDataModule, "the prompt stream and the held-out validation prompts"),
    (
        "model",
        DPOModule,
        "DPO (`model.class_path: lightning_grpo.DPOModule`): its sections are `model.policy`, "
        "`model.dpo` and `model.optim`",
    ),
    (
        "data",
        PreferenceDataModule,
        "preference pairs for DPO (`data.class_path: lightning_grpo.PreferenceDataModule`)",
    ),
    (
        "checkpoint",
        GRPOCheckpoint,
        "complete, atomic checkpoints per loop step (the CLI adds it)",
    ),
    (
        "completions",
        CompletionLog,
        "a few completions per loop step in `completions.jsonl`, W&B and the console",
    ),
    (
        "alarm",
        SignalAlarm,
        "a warning when the learning signal is gone (the CLI adds it)",
    ),
    (
        "trainer.callbacks",
        HandoffCallback,
        "the colocated hand-off; the CLI adds one unless the config lists it",
    ),
    (
        "trainer.callbacks",
        RunSummary,
        "the end-of-run report; the CLI adds one with these defaults",
    ),
)
"""(key prefix, class, what it is): one table of ``__init__`` arguments each, described by the ``Args:`` section."""
MODEL_CLASS_PATH = (
    "the module's class: GRPOModule or your subclass of it (`my_pkg.MyModule`, importable from the "
    "working folder); `--model.help my_pkg.MyModule` lists its arguments"
)
TRAINER_NOTES = {
    "accelerator": "`auto`: the GPU when there is one; the quickstart pins `cpu`",
    "devices": "data-parallel replicas (one policy replica each: `batch_per_replica` is per replica)",
    "logger": "one row per loop step, x-axis `step` = loop step; `lightning-grpo plot <log dir>` draws the CSV; "
    "`--trainer.logger=WandbLogger` for W&B (docs/wandb.md)",
    "max_steps": "in **optimizer steps** (Lightning's `global_step` under manual optimization) = loop steps x mu_iterations x n_mini",
    "log_every_n_steps": "in training batches = **loop steps**; keep 1 (one row of metrics per collected batch)",
    "val_check_interval": "an integer counts training batches = **loop steps**: validate every N loop steps",
    "limit_train_batches": "with `max_epochs: 1` and `max_steps: -1`, a run of exactly N loop steps whatever n_mini "
    "is (the sweep config uses this); a decaying LR schedule then spans N x mu_iterations x "
    "n_mini steps",
    "precision": "`bf16-mixed`: fp32 master weights, bf16 autocast (GPUs; the fast mode on CPUs with AVX512-BF16/AMX); "
    "`16-mixed` steps through the GradScaler; `bf16-true`/`16-true` train half-precision weights and "
    "warn (docs/precision.md)",
}
"""Lightning Trainer keys whose unit changes meaning under GRPO's manual optimization."""


class UndocumentedKnob(ValueError):
    """A config field or constructor argument has no description: document it where it is defined."""


def generate() -> str:
    """The whole of ``docs/configuration.md``."""
    out = [
        "<!-- Generated by `python -m lightning_grpo.docgen > docs/configuration.md` from the config dataclasses and",
        "     class docstrings; do not edit by hand (tests/test_docgen.py checks it is up to date). -->",
        "# Configuration reference",
        "",
        "Every knob is a YAML key and a CLI flag: `model.rl.micro_batch_per_replica: 8` in a config file is",
        "`--model.rl.micro_batch_per_replica=8` on the command line (the form a `wandb sweep` passes).",
        "`lightning-grpo fit --print_config` prints the resolved configuration; `lightning-grpo fit --help` shows",
        "the same descriptions. Derived counts are computed from the knobs and can never be set.",
        "`model.class_path` (default `lightning_grpo.GRPOModule`) and `data.class_path` (default",
        "`lightning_grpo.PromptDataModule`) pick the classes; a config for another (DPO: `lightning_grpo.DPOModule`",
        "with `lightning_grpo.PreferenceDataModule`) nests its keys under `init_args`, as configs/dpo-arith.yaml does.",
        "See also: [getting started](getting-started.md), [metrics](metrics.md), [OOM](oom.md).",
        "",
        "When rules run: each section refuses its own bad values when it is built, so a bad file or flag is reported",
        "while the CLI parses it. Rules that read several sections (`rl` with `rollout`, `policy.lora` with",
        "`rollout.server`, `model.objective` with `opd`) live in one place, `lightning_grpo/run_check.py`",
        "(`check_run`): `GRPOModule(...)` runs it when built, the CLI again once the Trainer exists (with its world",
        "size, before any rank is launched), and `setup` on every rank; all before the policy's weights are read.",
        "Every broken rule is listed at once (`invalid run config (N problems)`). Only rules that need the loaded",
        "model (MoE layers, whether a policy packs exactly, the chat template) wait for it.",
        "",
    ]
    problems: list[str] = []
    for prefix, cls in DATACLASS_SECTIONS:
        out += _dataclass_section(prefix, cls, problems)
    for prefix, cls, what in CLASS_SECTIONS:
        out += _class_section(prefix, cls, what, problems)
    out += _trainer_section()
    if problems:
        raise UndocumentedKnob(
            "knobs without a description:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return "\n".join(out).rstrip() + "\n"


# -- sections ----------------------------------------------------------------------------------------------------


def _dataclass_section(prefix: str, cls: type, problems: list[str]) -> list[str]:
    docs = field_docs(cls)
    lines = [
        f"## `{prefix}` ({cls.__name__})",
        "",
        _one_line(inspect.getdoc(cls) or ""),
        "",
    ]
    if prefix.endswith("[i]"):
        lines += [f"A list: `{prefix[:-3]}: [{{name: ..., weight: ...}}, ...]`.", ""]
    lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        if f.name not in docs:
            problems.append(
                f"{cls.__module__}.{cls.__name__}.{f.name}: add a docstring under the field"
            )
        default = (
            f.default_factory()
            if f.default_factory is not dataclasses.MISSING
            else f.default
        )
        lines.append(_row(f"{prefix}.{f.name}", f.type, default, docs.get(f.name, "")))
    derived = list(_derived(cls, problems))
    if derived:
        lines += [
            "",
            "Derived (read-only, from the knobs above):",
            "",
            "| name | meaning |",
            "| --- | --- |",
        ]
        lines += [f"| `{name}` | {_cell(doc)} |" for name, doc in derived]
    return lines + [""]


def _class_section(prefix: str, cls: type, what: str, problems: list[str]) -> list[str]:
    described = args_docs(cls)
    nested = {
        p.split(".")[-1].removesuffix("[i]")
        for p, _ in DATACLASS_SECTIONS
        if p.count(".") == 1
    }
    callback = prefix == "trainer.callbacks"
    title = (
        f"`{prefix}`: `{cls.__module__}.{cls.__name__}`"
        if callback
        else f"`{prefix}` ({cls.__name__})"
    )
    lines = [f"## {title}", "", f"{what[0].upper()}{what[1:]}.", ""]
    if callback:
        lines += [
            f"In YAML: `trainer.callbacks: [{{class_path: {cls.__module__}.{cls.__name__}, init_args: {{...}}}}]`.",
            "",
        ]
    lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    if prefix == "model":
        lines.append(
            _row(
                "model.class_path",
                "str",
                f"{cls.__module__}.{cls.__name__}",
                MODEL_CLASS_PATH,
            )
        )
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if (
            name == "self"
            or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
            or (prefix == "model" and name in nested)
        ):
            continue
        if name not in described:
            problems.append(
                f"{cls.__module__}.{cls.__name__}({name}=...): add it to the class docstring's Args:"
            )
        key = f"init_args.{name}" if callback else f"{prefix}.{name}"
        lines.append(
            _row(key, param.annotation, param.default, described.get(name, ""))
        )
    return lines + [""]


def _trainer_section() -> list[str]:
    lines = [
        "## `trainer` (Lightning `Trainer`)",
        "",
        "All of Lightning's Trainer arguments are accepted (see Lightning's documentation). The CLI's defaults,",
        "and the keys whose unit matters here:",
        "",
        "| key | CLI default | meaning here |",
        "| --- | --- | --- |",
    ]
    for key in sorted(set(TRAINER_DEFAULTS) | set(TRAINER_NOTES)):
        default = TRAINER_DEFAULTS.get(key, "(Lightning's)")
        if isinstance(default, dict) and "class_path" in default:
            default = f"{default['class_path'].rsplit('.', 1)[-1]}({_args(default.get('init_args', {}))})"
        lines.append(
            f"| `trainer.{key}` | `{_fmt(default)}` | {_cell(TRAINER_NOTES.get(key, ''))} |"
        )
    return lines + [""]


# -- reading descriptions from the code --------------------------------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings under a dataclass's fields (the string literal right after ``name: type = default``)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def args_docs(cls: type) -> dict[str, str]:
    """``name -> description`` from the ``Args:`` section of a Google-style class docstring."""
    lines = (inspect.getdoc(cls) or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    if start is None:
        return {}
    indent = len(lines[start]) - len(lines[start].lstrip())
    docs: dict[str, str] = {}
    current = None
    for line in lines[start + 1 :]:
        depth = len(line) - len(line.lstrip())
        if line.strip() and depth <= indent:
            break  # the next section (Raises:, Example::)
        entry = (
            re.match(r"(\w+)(?: \([^)]*\))?: (.*)", line.strip())
            if depth == indent + 4
            else None
        )
        if entry:
            current = entry.group(1)
            docs[current] = entry.group(2)
        elif current and line.strip():
            docs[current] += " " + line.strip()
    return docs


def _derived(cls: type, problems: list[str]) -> Iterator[tuple[str, str]]:
    for name, member in inspect.getmembers(cls):
        if name.startswith("_"):
            continue
        if isinstance(member, property) or (
            inspect.isfunction(member) and name not in ("validate", "problems")
        ):
            doc = inspect.getdoc(member)
            if not doc:
                problems.append(
                    f"{cls.__module__}.{cls.__name__}.{name}: add a docstring (derived value)"
                )
            label = (
                name if isinstance(member, property) else f"{name}{_signature(member)}"
            )
            yield label, doc or ""


# -- formatting --------------------------------------------------------------------------------------------------


def _row(key: str, annotation: object, default: object, meaning: str) -> str:
    kind = (
        annotation
        if isinstance(annotation, str)
        else getattr(annotation, "__name__", str(annotation))
    )
    shown = "(required)" if default is inspect.Parameter.empty else _fmt(default)
    return f"| `{key}` | `{_cell(kind)}` | `{_cell(shown)}` | {_cell(meaning)} |"


def _fmt(value: object) -> str:
    """A default as it would be written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return value if value else "''"
    return repr(value)


def _args(init_args: dict) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in init_args.items())


def _signature(fn) -> str:
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    return f"({', '.join(params)})"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped."""
    return _one_line(text).replace("|", "\\|")


def main() -> None:
    sys.stdout.write(generate())


if __name__ == "__main__":
    main()
