"""Policy loading keyed on the seed it used: a ``tiny:`` build (and its warm start) follows the module's seed."""

from __future__ import annotations

from dataclasses import replace

import torch
from helpers import SMALL

from lightning_grpo.module import GRPOModule
from lightning_grpo.policy import PolicyConfig, resolve_path, with_seed


def _module(seed: int | None, tiny=SMALL) -> GRPOModule:
    module = GRPOModule(policy=PolicyConfig(path="tiny:seeded", tiny=tiny), seed=seed)
    module.configure_model()  # builds the policy (what a Trainer does on each rank)
    return module


def test_a_tiny_policy_is_built_and_cached_per_module_seed():
    three, four, three_again = _module(3), _module(4), _module(3)
    assert (three.policy_cfg.tiny.seed, four.policy_cfg.tiny.seed) == (3, 4)
    folders = [resolve_path(m.policy_cfg) for m in (three, four, three_again)]
    assert folders[0] == folders[2] != folders[1]  # the engine (vLLM) loads the folder the module trained from
    weights = [dict(m.policy.named_parameters()) for m in (three, four, three_again)]
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # another init
    assert all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])


def test_an_explicit_tiny_seed_wins_and_folders_are_unchanged_outside_a_module():
    assert _module(3, tiny=replace(SMALL, seed=9)).policy_cfg.tiny.seed == 9
    unseeded = PolicyConfig(path="tiny:seeded", tiny=SMALL)
    assert resolve_path(unseeded) == resolve_path(with_seed(unseeded, 0))  # None outside a module = 0, as before
    folder_cfg = PolicyConfig(path="/some/folder")
    assert with_seed(folder_cfg, 5) is folder_cfg  # a real checkpoint has no init seed


def test_the_warm_start_is_cached_under_the_seed_it_used():
    cfg = PolicyConfig(path="tiny:warm", tiny=SMALL, warm_start="arith_small", warm_start_steps=2)
    five, six = resolve_path(with_seed(cfg, 5)), resolve_path(with_seed(cfg, 6))
    assert five != six and five.name.endswith("-5-warm-arith_small-2") and six.name.endswith("-6-warm-arith_small-2")
