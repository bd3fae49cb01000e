"""The sampler's share of generation, per engine, before and after issue 22.

    .venv/bin/python -m bench.sampler              # both engines, 3 interleaved rounds
    .venv/bin/python -m bench.sampler --engines hf

The speed bench's workload: the ~30M Qwen2 policy (vocabulary 32768), 4 prompts x 8 completions x 64 new
tokens at temperature 1, one thread, float32. Each variant is timed in CPU seconds per ``generate`` call
(median over rounds, range), and the time spent inside the sampling step itself is measured by wrapping it:

* ``hf/multinomial``: transformers' own sampling (``do_sample=True``: softmax + ``torch.multinomial``, which
  draws one exponential per vocabulary entry); the engine of lightning-grpo before issue 22.
* ``hf/inverse-cdf``: our engine now (``rollout/sampler.py``: one uniform per row; float64 sums per block of 256
  tokens, then one block's cumulative sum, searched).
* ``hf/inverse-cdf-flat``: the same sampler with its first search (one float64 cumulative sum over the whole
  vocabulary per step), kept here as the baseline of the two-level search.
* ``vllm/<logprobs_mode>``: the in-process vLLM engine (CPU build); the sampler is vLLM's
  ``Sampler.forward`` (temperature/top-k/top-p, the draw: on CPU a fused Gumbel-max kernel with per-token
  SplitMix64 noise, and the log-softmax that ``processed_logprobs`` computes every step).

Every variant of an engine runs in one process, the variants alternating round by round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from bench.common import load_average, run_child, save, table

GROUP, PROMPTS, NEW_TOKENS = 8, 4, 64


@contextlib.contextmanager
def timed(owner, name: str, spent: list[float]):
    """Add the CPU seconds of every call of ``owner.name`` to ``spent[0]`` while inside."""
    inner = getattr(owner, name)

    def call(*args, **kwargs):
        c0 = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.process_time() - c0

    setattr(owner, name, call)
    try:
        yield
    finally:
        setattr(owner, name, inner)


def prompts_of(tok):
    from bench.speed_vs_trl import prompt_rows
    from lightning_grpo.rollout.base import Prompt

    return [Prompt(id=i, token_ids=tok(r["prompt"])["input_ids"], text=r["prompt"])
            for i, r in enumerate(prompt_rows(PROMPTS))]


def hf_child(rounds: int) -> dict:
    import torch
    from transformers import GenerationConfig

    from bench.speed_vs_trl import policy_dir
    from lightning_grpo.policy import PolicyConfig, load_policy
    from lightning_grpo.rollout import sampler as ours_sampler
    from lightning_grpo.rollout.base import SamplingConfig
    from lightning_grpo.rollout.hf import HFEngine

    torch.set_num_threads(1)
    model, tok = load_policy(PolicyConfig(path=str(policy_dir())))
    engine, prompts = HFEngine(model, tok), prompts_of(tok)
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0)

    def multinomial(spent):
        """transformers' sampling loop, as the engine called it before issue 22 (temperature 1, no top-k/top-p)."""
        ids, mask = engine._left_pad([p.token_ids for p in prompts for _ in range(GROUP)])
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                  pad_token_id=engine.pad_token_id, eos_token_id=engine.eos_token_ids)
        with engine._generation_mode(), timed(torch, "multinomial", spent), timed(torch.nn.functional, "softmax",
                                                                                  spent):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return int((out[:, ids.shape[1]:] != engine.pad_token_id).sum())

    def inverse_cdf(spent):
        with timed(ours_sampler.InverseCDFSampler, "__call__", spent):
            out = engine.generate(prompts, GROUP, sampling)
        return sum(len(r.token_ids) for r in out)

    def inverse_cdf_flat(spent):
        """The first inverse-CDF search: one float64 cumulative sum over the whole vocabulary per step."""
        two_level, ours_sampler.inverse_cdf_sample = ours_sampler.inverse_cdf_sample, flat_search
        try:
            return inverse_cdf(spent)
        finally:
            ours_sampler.inverse_cdf_sample = two_level

    return _rounds({"hf/multinomial": multinomial, "hf/inverse-cdf-flat": inverse_cdf_flat,
                    "hf/inverse-cdf": inverse_cdf}, rounds)


def flat_search(probs, u):
    """The sampler's search before the two-level one, kept verbatim as its baseline."""
    import torch

    cdf = probs.cumsum(-1, dtype=torch.float64)  # [N, V]
    total = cdf[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise RuntimeError("sampling: the probability tensor contains inf, nan or no positive entry")
    target = torch.minimum(u.to(cdf.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def vllm_child(rounds: int) -> dict:
    import torch

    from bench.speed_vs_trl import KV_CACHE_BYTES, POLICY, policy_dir
    from lightning_grpo.policy import PolicyConfig, load_policy
    from lightning_grpo.rollout.base import SamplingConfig
    from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine

    torch.set_num_threads(1)
    _, tok = load_policy(PolicyConfig(path=str(policy_dir())))
    prompts = prompts_of(tok)
    variants = {}
    for mode in ("processed_logprobs", "raw_logprobs"):
        cfg = VLLMConfig(dtype="float32", enforce_eager=True, max_model_len=POLICY["max_position_embeddings"],
                         kv_cache_memory_bytes=KV_CACHE_BYTES, logprobs_mode=mode)
        variants[f"vllm/{mode}"] = _vllm_variant(VLLMEngine(str(policy_dir()), cfg), prompts, SamplingConfig(
            max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0))
    return _rounds(variants, rounds)


def _vllm_variant(engine, prompts, sampling):
    from vllm.v1.sample.sampler import Sampler

    def run(spent):
        with timed(Sampler, "forward", spent):
            out = engine.generate(prompts, GROUP, sampling)
        return sum(len(r.token_ids) for r in out)

    return run


def _rounds(variants: dict, rounds: int) -> dict:
    times = {k: [] for k in variants}
    shares = {k: [] for k in variants}
    tokens = {}
    names = list(variants)
    for r in range(rounds + 1):  # round 0 warms every variant up
        for name in names if r % 2 else names[::-1]:
            spent = [0.0]
            c0 = time.process_time()
            tokens[name] = variants[name](spent)
            total = time.process_time() - c0
            if r:
                times[name].append(total)
                shares[name].append(spent[0])
    return {"times": times, "sampler": shares, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps((hf_child if a.child == "hf" else vllm_child)(a.rounds)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    load, rows = [load_average()], []
    for engine in a.engines.split(","):
        res = run_child("bench.sampler", "--child", engine, "--rounds", str(a.rounds), env=env)
        load.append(load_average())
        for name, t in res["times"].items():
            s = res["sampler"][name]
            rows.append({"variant": name, "generate_cpu_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                         "sampler_cpu_s": statistics.median(s), "share": statistics.median(x / y for x, y in zip(s, t)),
                         "ms_per_step": 1e3 * statistics.median(s) / NEW_TOKENS, "tokens": res["tokens"][name],
                         "times": t, "sampler_times": s})
    print(f"sampler share of generation: {PROMPTS} prompts x {GROUP} x {NEW_TOKENS} tokens, vocab 32768, 1 thread, "
          f"{a.rounds} rounds; load average {min(load):.1f}-{max(load):.1f}")
    print(table(rows, ["variant", "generate_cpu_s", "min_s", "max_s", "sampler_cpu_s", "share", "ms_per_step",
                       "tokens"]))
    path = save("sampler", {"rows": rows, "rounds": a.rounds, "load_average": load, "group": GROUP,
                            "prompts": PROMPTS, "new_tokens": NEW_TOKENS,
                            "command": " ".join(["python -m bench.sampler", *sys.argv[1:]])})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
