"""bench/speed_report.py: ratios are formed per round, settings are compared key by key, the floor uses the round's
GEMM rate (the speed bench's claims are computed, not written down)."""

from __future__ import annotations

import pytest

from bench.speed_report import SETTINGS, combine
from bench.speed_vs_trl import Run, reward_check

BASE = {k: f"v-{k}" for k in SETTINGS} | {"params": 1000, "gradient_checkpointing": False}


def result(run: Run, rnd: int, step: float, update: float, settings: dict | None = None, rss: float = 100.0) -> dict:
    return {"run": vars(run), "label": run.label, "round": rnd, "step_cpu_s": step, "generate_cpu_s": step - update,
            "update_cpu_s": update, "sync_cpu_s": 0.0, "step_s": step, "generate_s": step - update, "update_s": update,
            "sync_s": 0.0, "tokens_per_step": 10.0, "peak_rss_mb": rss, "settings": settings or dict(BASE)}


def test_ratios_pair_runs_within_a_round_and_report_the_spread():
    trl, ours = Run("trl", "hf", gc=False), Run("ours", "hf")
    results = [result(trl, 0, 20.0, 10.0), result(ours, 0, 10.0, 5.0),  # round 0: 2.0x
               result(trl, 1, 30.0, 10.0), result(ours, 1, 10.0, 5.0),  # round 1: 3.0x (a loaded round for TRL)
               result(trl, 2, 25.0, 10.0), result(ours, 2, 12.5, 5.0)]  # round 2: 2.0x
    summary = combine(results, [{"round": r, "precision": "fp32", "gflops": 1.0} for r in range(3)], reward_check())
    step = summary["ratios"]["trl/hf gc-off fp32 / ours/hf fp32"]["step_cpu_s"]
    assert step["values"] == [2.0, 3.0, 2.0] and step["median"] == 2.0 and (step["min"], step["max"]) == (2.0, 3.0)
    floor = summary["floor"]["ours/hf fp32"]
    assert floor["floor_s"]["median"] == pytest.approx(6 * 1000 * 10 / 1e9)  # 6 x params x tokens / (1 GFLOP/s)
    assert floor["ratio"]["median"] == pytest.approx(5.0 / 6e-5)
    assert summary["memory"]["trl/hf gc-off fp32 / ours/hf fp32"]["ours_over_trl"] == 1.0


def test_a_setting_that_differs_is_named_with_both_values():
    trl, ours = Run("trl", "hf", gc=True), Run("ours", "hf")
    results = [result(trl, 0, 20.0, 10.0, {**BASE, "gradient_checkpointing": True, "top_p": 0.9}),
               result(ours, 0, 10.0, 5.0, {**BASE, "top_p": 1.0})]
    check = combine(results, [], reward_check())["settings_check"]["trl/hf gc-on fp32 / ours/hf fp32"]
    assert {d["key"]: (d["trl"], d["ours"]) for d in check["differ"]} == {"gradient_checkpointing": (True, False),
                                                                          "top_p": (0.9, 1.0)}
    assert len(check["matched"]) == len(SETTINGS) - 2 and check["stable_across_rounds"]


def test_settings_that_change_between_rounds_are_flagged():
    trl, ours = Run("trl", "hf"), Run("ours", "hf")
    results = [result(trl, 0, 20.0, 10.0), result(ours, 0, 10.0, 5.0),
               result(trl, 1, 20.0, 10.0, {**BASE, "threads": 2}), result(ours, 1, 10.0, 5.0)]
    check = combine(results, [], reward_check())["settings_check"]["trl/hf gc-off fp32 / ours/hf fp32"]
    assert not check["stable_across_rounds"]


def test_the_two_reward_adapters_agree():
    assert reward_check()["equal"]
