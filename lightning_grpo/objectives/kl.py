"""Full-distribution reverse KL to a teacher at the completion positions, over the vocabulary in token chunks.

``KL(p_s || p_t) = sum_v p_s(v) (log p_s(v) - log p_t(v))`` at each scored position needs both models'
whole distributions there. Held at once they are ``[N, V]`` float32 per model (with a 150k vocabulary
and 4k completion tokens, 2.4 GB each, plus autograd's copies), so only the hidden states at the
completion positions (``[N, H]``) are kept and the two LM heads run over ``chunk_tokens`` of them at a
time. Under autograd each chunk is checkpointed: backward recomputes that chunk's logits (student and
teacher) instead of keeping them, so the peak is a few ``[chunk, V]`` buffers whatever ``N`` is.

This is its own function, apart from ``logprobs.py`` (the policy's token logprobs): the KL needs every
vocabulary entry, the token logprob only the sampled one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# (start, end) -> [end - start, V] float32 log-probabilities of the teacher at those scored positions, no grad.
TeacherLogprobs = Callable[[int, int], Tensor]

CHUNK_BYTES = 64 << 20
"""Float32 logits of one chunk of positions (about 100 tokens at a 150k vocabulary, 2048 at 8k)."""


def at_least_float32(t: Tensor) -> Tensor:
    """``t`` in float32, or wider if it already is (float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Positions per chunk so one ``[chunk, V]`` float32 buffer takes ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_size))


def completion_hidden(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, mask: Tensor
) -> Tensor:
    """Final hidden states ``[N, H]`` at the scored positions: ``mask`` is ``[B, T-1]`` (position t predicts t+1)."""
    if hasattr(model, "get_decoder") and model.get_decoder() is not None:
        hidden = model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask
        ).last_hidden_state
    # the last entry of hidden_states is after the final norm in Hugging Face causal LMs
    else:
        hidden = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=True,
        ).hidden_states[-1]
    return hidden[:, :-1][mask]  # [B, T-1, H] -> [N, H]


def _chunk(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    teacher: Tensor,
    temperature: float,
) -> Tensor:
    """``[4, c]``: KL(p_s || p_t), the student's and the teacher's log-probability of the target, and the student's
    entropy, per position (the entropy from the same softmax: free)."""
    # [c, V]: a half-precision logsumexp loses the KL
    logits = at_least_float32(head(hidden))
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)  # [c, V]
    p = logp.exp()
    kl = (p * (logp - teacher)).sum(-1)  # [c]
    entropy = -(p * logp).sum(-1).detach()  # [c]: logged, never trained
    picked = targets.unsqueeze(-1)
    return torch.stack(
        [
            kl,
            logp.gather(-1, picked).squeeze(-1),
            teacher.gather(-1, picked).squeeze(-1),
            entropy,
        ]
    )


def _chunk_with_teacher(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    teacher: TeacherLogprobs,
    start: int,
    end: int,
    temperature: float,
) -> Tensor:
    with torch.no_grad():
        # [c, V], recomputed in backward too: never kept across chunks
        t = teacher(start, end)
    return _chunk(
        head, hidden, targets, at_least_float32(t.to(hidden.device)), temperature
    )


def reverse_kl(
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    teacher: TeacherLogprobs,
    *,
    temperature: float = 1.0,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-position reverse KL to the teacher and the student's logprob of the sampled token.

    Args:
        hidden: ``[N, H]`` student hidden states at the scored positions (with grad).
        head: the student's LM head (``[N, H] -> [N, V]``).
        targets: ``[N]`` the token sampled at each position.
        teacher: ``teacher(start, end)`` -> ``[end - start, V]`` teacher log-probabilities (no grad).
        temperature: the student's logits are divided by it (the sampling temperature).
        chunk: positions per chunk; None = ``chunk_tokens`` of the head's vocabulary.

    Returns:
        ``(kl, logprob, teacher_logprob, entropy)``: ``[N]`` each, float32 or wider; the first two differentiable in
        ``hidden`` and the head, the teacher's logprob of the sampled token and the student's entropy constants.
    """
    n = hidden.shape[0]
    if n == 0:
        empty = (
            hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
            + 0 * hidden.sum()
        )
        return empty, empty, empty.detach(), empty.detach()
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    step = chunk or chunk_tokens(vocab)
    parts = []
    for start in range(0, n, step):
        end = min(start + step, n)
        args = (
            head,
            hidden[start:end],
            targets[start:end],
            teacher,
            start,
            end,
            temperature,
        )
        if torch.is_grad_enabled():
            # logits recomputed in backward
            parts.append(checkpoint(_chunk_with_teacher, *args, use_reentrant=False))
        else:
            parts.append(_chunk_with_teacher(*args))
    kl, logprob, teacher_logprob, entropy = torch.cat(parts, dim=1).unbind(0)
    return kl, logprob, teacher_logprob.detach(), entropy.detach()
