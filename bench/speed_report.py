"""Combine the rounds of ``bench.speed_vs_trl``: per-run medians, per-round ratios with their spread, the matmul floor,
peak memory, and the settings check (TRL's live settings against ours, key by key)."""

from __future__ import annotations

import statistics

from bench.common import table

METRICS = ("step_cpu_s", "generate_cpu_s", "update_cpu_s", "sync_cpu_s", "step_s", "generate_s", "update_s", "sync_s",
           "tokens_per_step", "peak_rss_mb")


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def combine(results: list[dict], gemm: list[dict], reward: dict) -> dict:
    labels = list(dict.fromkeys(r["label"] for r in results))
    rows, by = [], {}
    for label in labels:
        ok = [r for r in results if r["label"] == label and "error" not in r]
        if not ok:
            rows.append(next(r for r in results if r["label"] == label))
            continue
        row = {"label": label, **ok[0]["run"], "rounds": len(ok)}
        for m in METRICS:
            vals = [r[m] for r in ok if r.get(m) is not None]
            row[m] = statistics.median(vals) if vals else None
            row[m + "_range"] = [min(vals), max(vals)] if vals else None
        rows.append(row)
        by[label] = {r["round"]: r for r in ok}
    return {"rows": rows, "ratios": _ratios(by), "floor": _floor(by, gemm), "memory": _memory(by),
            "settings_check": _settings_check(by), "reward_check": reward}


def _pairs(by: dict):
    """(name, TRL label, our label) of every comparison: each TRL run against each of our engines, same precision."""
    for trl in by:
        if not trl.startswith("trl/"):
            continue
        precision = trl.rsplit(" ", 1)[1]
        for ours in (f"ours/hf {precision}", f"ours/vllm {precision}"):
            if ours in by:
                yield f"{trl} / {ours}", trl, ours


def _ratios(by: dict) -> dict:
    out = {}
    for name, trl, ours in _pairs(by):
        common = sorted(set(by[trl]) & set(by[ours]))
        if not common:
            continue
        out[name] = {m: spread([by[trl][r][m] / by[ours][r][m] for r in common])
                     for m in ("step_cpu_s", "step_s", "generate_cpu_s", "update_cpu_s")}
    return out


def _floor(by: dict, gemm: list[dict]) -> dict:
    """Our update against ``6 x params x completion tokens`` at the GEMM rate measured in the same round."""
    out = {}
    for label, rounds in by.items():
        if not label.startswith("ours/"):
            continue
        precision = label.rsplit(" ", 1)[1]
        per_round = []
        for r, res in rounds.items():
            rate = next((g["gflops"] for g in gemm if g["round"] == r and g["precision"] == precision), None)
            if rate is None:
                continue
            flops = 6 * res["settings"]["params"] * res["tokens_per_step"]
            per_round.append({"round": r, "gflops": rate, "floor_s": flops / rate / 1e9,
                              "update_cpu_s": res["update_cpu_s"], "ratio": res["update_cpu_s"] / (flops / rate / 1e9)})
        if per_round:
            out[label] = {"ratio": spread([x["ratio"] for x in per_round]),
                          "gflops": spread([x["gflops"] for x in per_round]),
                          "floor_s": spread([x["floor_s"] for x in per_round]), "rounds": per_round}
    return out


def _memory(by: dict) -> dict:
    out = {}
    for name, trl, ours in _pairs(by):
        a = [r["peak_rss_mb"] for r in by[trl].values() if r.get("peak_rss_mb")]
        b = [r["peak_rss_mb"] for r in by[ours].values() if r.get("peak_rss_mb")]
        if a and b:
            out[name] = {"trl_mb": statistics.median(a), "ours_mb": statistics.median(b),
                         "ours_over_trl": statistics.median(b) / statistics.median(a)}
    return out


def _settings_check(by: dict) -> dict:
    """Key by key, TRL's live settings against ours; also whether each run reported the same settings every round."""
    from bench.speed_vs_trl import IMPLEMENTATION, SETTINGS

    out = {}
    for name, trl, ours in _pairs(by):
        s_trl, s_ours = (next(iter(by[x].values()))["settings"] for x in (trl, ours))
        stable = all(r["settings"] == s_trl for r in by[trl].values()) and all(
            r["settings"] == s_ours for r in by[ours].values())
        keys = [{"key": k, "trl": s_trl.get(k), "ours": s_ours.get(k), "equal": s_trl.get(k) == s_ours.get(k)}
                for k in SETTINGS]
        out[name] = {"matched": [k["key"] for k in keys if k["equal"]],
                     "differ": [k for k in keys if not k["equal"]], "keys": keys, "stable_across_rounds": stable,
                     "implementation": [{"key": k, "trl": s_trl.get(k), "ours": s_ours.get(k)} for k in IMPLEMENTATION]}
    return out


def print_summary(summary: dict, args, trl_vllm: dict | None) -> None:
    rows = [r for r in summary["rows"] if "error" not in r]
    print(f"loop step vs TRL GRPOTrainer, {args.rounds} interleaved rounds x {args.steps} loop steps, "
          f"{args.threads} thread(s); CPU seconds, medians over rounds")
    print(table(rows, ["label", "step_cpu_s", "generate_cpu_s", "update_cpu_s", "sync_cpu_s", "step_s",
                       "tokens_per_step", "peak_rss_mb"]))
    for r in summary["rows"]:
        if "error" in r:
            print(f"{r['label']}: FAILED: {r['error']}")
    if trl_vllm and "error" in trl_vllm:
        print(f"trl/vllm: FAILED (expected on CPU): {trl_vllm['error']}")
    print("\nTRL / ours per round (step CPU s): median [min, max]")
    for name, r in summary["ratios"].items():
        s = r["step_cpu_s"]
        print(f"  {name}: {s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]  (wall {r['step_s']['median']:.2f})")
    for label, f in summary["floor"].items():
        print(f"update / matmul floor, {label}: {f['ratio']['median']:.2f} [{f['ratio']['min']:.2f}, "
              f"{f['ratio']['max']:.2f}] at {f['gflops']['median']:.0f} GFLOP/s (floor {f['floor_s']['median']:.2f} s)")
    for name, m in summary["memory"].items():
        print(f"peak RSS per loop step, {name}: TRL {m['trl_mb']:.0f} MB, ours {m['ours_mb']:.0f} MB "
              f"({m['ours_over_trl']:.2f}x)")
    for name, c in summary["settings_check"].items():
        diff = ", ".join(f"{d['key']} (TRL {d['trl']} vs ours {d['ours']})" for d in c["differ"]) or "none"
        print(f"settings {name}: {len(c['matched'])}/{len(c['keys'])} matched; differ: {diff}")
    print(f"reward adapters agree on probe completions: {summary['reward_check']['equal']}")
