"""Fused, memory-bounded token logprobs: equal to the plain path in value and gradient, bounded in memory."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_grpo.fused_head import head_logprobs
from lightning_grpo.logprobs import _linear_head, token_logprobs

VOCAB = 101  # unlike any other width of the model, so a matmul of this width is the head


def build_model(vocab: int, tied: bool = True, layers: int = 2, seed: int = 0):
    """A random-init Qwen2 causal LM (hidden 64, head_dim 32)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=tied)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


def model_of(dtype: torch.dtype, tied: bool = True):
    model = build_model(VOCAB, tied).to(dtype)
    with torch.no_grad():  # an untrained head of tiny weights has near-uniform softmax: spread it out
        model.get_output_embeddings().weight.mul_(8.0)
    return model.train()


def batch(rows: int = 5, width: int = 23, seed: int = 0):
    """Right-padded rows with prompts of 3-6 tokens and completions of 0 to the rest: positions = completion mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (rows, width), generator=g)
    prompt = torch.randint(3, 7, (rows,), generator=g)
    length = prompt + torch.randint(0, width - 6, (rows,), generator=g)
    length[0] = width  # one full row
    length[1] = prompt[1]  # one empty completion
    pos = torch.arange(width)
    attn = pos < length[:, None]
    completion = attn & (pos >= prompt[:, None])
    return ids.masked_fill(~attn, 0), attn, completion[:, 1:]


def plain(model, ids, attn, positions, temperature):
    """The textbook path: full logits, log-softmax, gather; zeros off the scored positions."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # [B, T-1, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return lp * positions


def value_and_grads(fn, model, weights):
    model.zero_grad(set_to_none=True)
    lp = fn()
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("keep,temperature", [("all", 1.0), ("some", 0.7), ("none", 0.7)])
def test_value_and_gradient_equal_the_plain_path(dtype, tol, tied, keep, temperature):
    model = model_of(dtype, tied)
    ids, attn, positions = batch()
    row = VOCAB * (8 if dtype == torch.float64 else 4)
    chunk = 7 * row  # 7 tokens per chunk: several chunks, the last one ragged
    keep_bytes = {"all": 10**9, "some": 2 * chunk, "none": 0}[keep]
    weights = torch.randn(positions.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    want, want_g = value_and_grads(lambda: plain(model, ids, attn, positions, temperature), model, weights)
    got, got_g = value_and_grads(lambda: token_logprobs(model, ids, attn, positions=positions, temperature=temperature,
                                                        chunk_bytes=chunk, keep_bytes=keep_bytes), model, weights)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(got[~positions], torch.zeros_like(got[~positions]))  # prompt and padding read 0
    assert rel(got, want) <= tol
    head = "lm_head.weight" if not tied else "model.embed_tokens.weight"  # tied: one parameter, both uses summed
    assert (tied and "lm_head.weight" not in got_g) or not tied
    assert got_g[head].abs().max() > 0
    for name in want_g:
        assert rel(got_g[name], want_g[name]) <= tol, name


def test_no_grad_scoring_equals_the_differentiable_path():
    model = model_of(torch.float32)
    ids, attn, positions = batch()
    chunk = 5 * VOCAB * 4
    with torch.no_grad():
        scored = token_logprobs(model, ids, attn, positions=positions, chunk_bytes=chunk)
    assert torch.equal(scored, token_logprobs(model, ids, attn, positions=positions, chunk_bytes=chunk).detach())


def test_a_second_backward_with_retain_graph_recomputes_what_the_first_consumed():
    model = model_of(torch.float64)
    h = torch.randn(40, 64, dtype=torch.float64, requires_grad=True)
    w = model.get_output_embeddings().weight
    t = torch.randint(0, VOCAB, (40,))
    lp = head_logprobs(h, w, None, t, chunk_bytes=16 * VOCAB * 8, keep_bytes=10**9)
    (g1,) = torch.autograd.grad(lp.sum(), h, retain_graph=True)
    (g2,) = torch.autograd.grad(lp.sum(), h)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-14)


def test_bias_gradient_and_value():
    h = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(8, 13, dtype=torch.float64)
    t = torch.randint(0, 13, (11,))
    want = torch.log_softmax(head(h) / 1.3, -1).gather(1, t[:, None])[:, 0]
    got = head_logprobs(h, head.weight, head.bias, t, temperature=1.3, chunk_bytes=4 * 13 * 8, keep_bytes=8 * 13 * 8)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    w = torch.randn(11, dtype=torch.float64)
    want_g = torch.autograd.grad((want * w).sum(), (h, head.weight, head.bias))
    got_g = torch.autograd.grad((got * w).sum(), (h, head.weight, head.bias))
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op produced, and the rows of every matmul output as wide as the vocabulary."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.largest, self.vocab_rows = vocab, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                self.largest = max(self.largest, t.numel())
                matmul = func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                if matmul and t.dim() == 2 and t.shape[1] == self.vocab:
                    self.vocab_rows.append(t.shape[0])
        return out


@pytest.mark.parametrize("keep_bytes", [0, 10**9])
def test_no_tensor_spans_the_batch_and_the_vocabulary(keep_bytes):
    """Forward and backward never make a [B, T, V] (or [N, V]) tensor: at most one chunk of logits at a time."""
    vocab = 2048  # much wider than the hidden states, so the logits would be the largest tensors
    model = build_model(vocab, layers=1).train()
    ids = torch.randint(4, vocab, (6, 40))
    positions = torch.zeros(6, 39, dtype=torch.bool)
    positions[:, 9:] = True  # 30 scored tokens per row: 180 in all, 8 per chunk
    chunk = 8
    with _LargestOutput(vocab) as seen:
        lp = token_logprobs(model, ids, positions=positions, chunk_bytes=chunk * vocab * 4, keep_bytes=keep_bytes)
        lp.sum().backward()
    weight = vocab * 64  # the head's weight and its gradient are the one legitimately vocabulary-sized tensor
    assert seen.largest <= max(weight, chunk * vocab)
    assert seen.vocab_rows and max(seen.vocab_rows) <= chunk
    fwd_rows = 180 + (180 if keep_bytes == 0 else 0)  # recomputed in backward when nothing is kept
    assert sum(seen.vocab_rows) >= fwd_rows  # every scored token met the head; prompt positions never did
    assert sum(r for r in seen.vocab_rows) < 6 * 39 * 4


def test_prompt_positions_get_no_logits():
    model = model_of(torch.float32)
    ids, attn, positions = batch()
    with _LargestOutput(VOCAB) as seen, torch.no_grad():
        token_logprobs(model, ids, attn, positions=positions)
    assert sum(seen.vocab_rows) == int(positions.sum())


def test_autocast_bf16_runs_the_head_in_bf16_and_stays_close():
    model = model_of(torch.float32)
    ids, attn, positions = batch()
    weights = torch.randn(positions.shape, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_g = value_and_grads(lambda: plain(model, ids, attn, positions, 1.0), model, weights)
        got, got_g = value_and_grads(lambda: token_logprobs(model, ids, attn, positions=positions,
                                                            chunk_bytes=7 * VOCAB * 4, keep_bytes=14 * VOCAB * 4),
                                     model, weights)
    assert got.dtype == torch.float32
    assert rel(got, want) < 2e-2
    for name in want_g:
        assert got_g[name].dtype == torch.float32
        assert rel(got_g[name], want_g[name]) < 5e-2, name


def test_models_that_transform_their_logits_are_scored_through_their_forward():
    model = model_of(torch.float32)
    assert _linear_head(model) is model.get_output_embeddings()
    model.config.final_logit_softcapping = 30.0
    assert _linear_head(model) is None
    ids, attn, positions = batch()
    torch.testing.assert_close(token_logprobs(model, ids, attn, positions=positions),
                               plain(model, ids, attn, positions, 1.0), rtol=0, atol=1e-6)


def test_the_module_scores_completion_tokens_and_logits_keep_mb_changes_memory_only(tiny_policy_dir):
    from helpers import synthetic_batch

    from lightning_grpo.config import GRPOConfig
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.policy import PolicyConfig

    batch = synthetic_batch([3, 0, 5, 2], vocab=80)
    runs = []
    for keep_mb in (256.0, 0.0):
        module = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir)),
                            rl=GRPOConfig(batch_per_replica=4, group_size=2, logits_keep_mb=keep_mb))
        module.configure_model()
        lp = module.scorer.logprobs(module.policy, batch)
        assert torch.equal(lp[~batch.completion_mask[:, 1:]], torch.zeros(int((~batch.completion_mask[:, 1:]).sum())))
        lp.sum().backward()
        runs.append((lp.detach(), {n: p.grad for n, p in module.policy.named_parameters()}))
    (lp_a, g_a), (lp_b, g_b) = runs
    assert torch.equal(lp_a, lp_b)
    for name in g_a:
        assert rel(g_b[name], g_a[name]) <= 1e-6, name
