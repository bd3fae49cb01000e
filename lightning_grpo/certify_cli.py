"""``lightning-grpo certify --config RUN.yaml``: the consistency certificate of a model and engine pair, as a table.

Reads the run's ``model.policy`` and ``model.rollout`` sections (``rollout.certificate`` for the thresholds, its
defaults when absent), loads the policy as the trainer would, builds the engine the run would, and prints the
figures of ``certificate.py`` (docs/consistency.md). Exit status 0 when certified, 1 on a breach. Nothing trains.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

DESCRIPTION = "The consistency certificate of a run's policy and engine (engine vs trainer, whole vocabulary)."


def build_parser(parser_class=argparse.ArgumentParser):
    parser = parser_class(prog="lightning-grpo certify", description=DESCRIPTION)
    parser.add_argument(
        "--config", required=True, help="a run's YAML (the one `fit --config` takes)"
    )
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default=None,
        help="the engine to certify (default: the config's model.rollout.engine)",
    )
    return parser


def sections(path: str) -> tuple[dict, dict]:
    """The ``model.policy`` and ``model.rollout`` mappings of a run's YAML (``model.init_args`` or ``model``)."""
    import yaml

    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    model = config.get("model") or {}
    model = model.get("init_args", model)
    return model.get("policy") or {}, model.get("rollout") or {}


def main(argv: list[str] | None = None) -> int:
    # Deferred: the verb loads a policy and perhaps vLLM; `lightning-grpo --help` must not.
    from jsonargparse import ArgumentParser

    from lightning_grpo.certificate import breach, certify, probe_prompts
    from lightning_grpo.config import CertificateConfig, GRPOConfig, RolloutConfig
    from lightning_grpo.engines import EngineParts, build_engine
    from lightning_grpo.policy import PolicyConfig, load_policy
    from lightning_grpo.rollout.base import Closable

    args = build_parser().parse_args(argv)
    policy_section, rollout_section = sections(args.config)
    typed = ArgumentParser(exit_on_error=False)
    typed.add_argument("--policy", type=PolicyConfig, default=PolicyConfig())
    typed.add_argument("--rollout", type=RolloutConfig, default=RolloutConfig())
    parsed = typed.instantiate_classes(
        typed.parse_object({"policy": policy_section, "rollout": rollout_section})
    )
    rollout = parsed.rollout
    if args.engine is not None:
        rollout = replace(rollout, engine=args.engine)
    cert = rollout.certificate or CertificateConfig()
    # the vLLM engine is built to return every logprob
    rollout = replace(rollout, certificate=cert)
    policy, tokenizer = load_policy(parsed.policy)
    engine = build_engine(
        rollout,
        EngineParts(policy, tokenizer, parsed.policy, GRPOConfig()),
        will_sleep=False,
    )
    try:
        figures = certify(engine, policy, probe_prompts(tokenizer, cert.prompts), cert)
    finally:
        if isinstance(engine, Closable):
            engine.close()
    print(
        f"policy {parsed.policy.path} ({parsed.policy.dtype}), engine {rollout.engine}"
    )
    print(figures.table())
    broken = breach(figures, cert)
    print("\n".join(f"BREACH: {line}" for line in broken) if broken else "certified")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
