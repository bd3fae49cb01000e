"""Seeds per (prompt, sample) and an exact inverse-CDF sampler for the transformers engine.

Seeds: completion ``j`` of prompt ``p`` draws from its own stream, seeded by a hash of
``(seed, p.id, j)``. Groups are then statistically independent (seeding completion ``j`` of
every prompt alike, ``seed + j``, makes prompt A's sample ``j`` and prompt B's sample ``j``
share their noise), and a completion's draws do not depend on which other rows share the
batch, so a run replays exactly from its seed.

Sampler: transformers draws with ``torch.multinomial``, which spends most of a decode step
making one exponential variate per vocabulary entry (~39 ms per step at 32 rows x 32k on one
CPU core). Inverse-CDF sampling needs one uniform per row: a float64 cumulative sum of the
row's probabilities and a binary search for ``u * total`` (in two levels: blocks, then tokens).
Token ``i`` is drawn exactly when ``u`` falls in an interval of width ``p_i``, so the draw follows
the same distribution as ``multinomial`` (tokens masked by top-k/top-p have width 0 and are never
drawn); it costs one vectorized pass over the row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor


def sample_seed(seed: int, prompt_id: int, index: int) -> int:
    """The 63-bit seed of completion ``index`` of prompt ``prompt_id``: distinct per pair, the same on every run."""
    digest = hashlib.blake2b(
        f"{seed}/{prompt_id}/{index}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") >> 1


def row_seeds(
    prompt_ids: Sequence[int], group_size: int, seed: int | None
) -> list[int]:
    """Seeds of the ``len(prompt_ids) * group_size`` rows, prompt 0's group first.

    ``seed=None`` (an unseeded draw) takes one number from torch's global generator, so a run seeded the
    usual way (``seed_everything``) still repeats.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    return [sample_seed(seed, pid, j) for pid in prompt_ids for j in range(group_size)]


class RowStreams:
    """One CPU generator per row: a row's uniforms never depend on the batch it shares, nor on the device."""

    def __init__(self, seeds: Sequence[int]) -> None:
        self._generators = [torch.Generator().manual_seed(s) for s in seeds]

    def __len__(self) -> int:
        return len(self._generators)

    def uniforms(self) -> Tensor:
        """The next float64 uniform in [0, 1) of every row: ``[N]``."""
        return torch.cat(
            [torch.rand(1, generator=g, dtype=torch.float64) for g in self._generators]
        )


BLOCK = 256
"""Tokens per block of the two-level search: a float64 sum per block, then a cumulative sum of one block."""
ROWS = 4
"""Rows whose block sums are formed at once (bounds the float64 temporary)."""


def inverse_cdf_sample(probs: Tensor, u: Tensor, block: int = BLOCK) -> Tensor:
    """Per row, the first token whose cumulative probability exceeds ``u * total``: ``[N]`` int64.

    Two levels, so no float64 cumulative sum runs over the whole vocabulary (a sequential scan that cost
    ~10 ms per decode step at 32 rows x 32k): block sums locate the block that holds ``u * total``, then a
    cumulative sum inside that block alone locates the token. Token ``i``'s interval still has width ``p_i``.

    Args:
        probs: ``[N, V]`` non-negative, unnormalized is fine (zeros are never drawn).
        u: ``[N]`` uniforms in [0, 1).
    """
    n, v = probs.shape
    pad = -v % block
    # padding: width 0
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(
        n, -1, block
    )
    # Float64 block sums a few rows at a time: a float64 copy of the whole [N, V] per decode step is a fresh
    # multi-MB allocation, which cost more than the sums themselves.
    cdf = torch.cat(
        [blocks[i : i + ROWS].sum(-1, dtype=torch.float64) for i in range(0, n, ROWS)]
    ).cumsum(-1)
    total = cdf[:, -1:]
    # as torch.multinomial refuses: else an index past V
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise RuntimeError(
            "sampling: the probability tensor contains inf, nan or no positive entry (the policy's "
            "logits are not finite: look for NaN/inf weights, or a temperature of 0 with top_p/top_k)"
        )
    # u < 1, but u * total can round up to total; one ulp below it still lands on the last non-zero block.
    target = torch.minimum(
        u.to(cdf.device)[:, None] * total,
        torch.nextafter(total, torch.zeros_like(total)),
    )
    # [N, 1]: first block whose end passes the target
    b = torch.searchsorted(cdf, target, right=True)
    before = torch.where(
        b > 0, cdf.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target)
    )
    inner = blocks.gather(1, b[:, :, None].expand(-1, -1, block))[:, 0]  # [N, block]
    within = torch.searchsorted(
        inner.cumsum(-1, dtype=torch.float64), target - before, right=True
    )[:, 0]
    # A block's sum and its cumulative sum can round apart by an ulp: a target past the block's last token
    # takes its last token that can be drawn (the block was chosen, so it has one).
    last = block - 1 - (inner > 0).flip(-1).int().argmax(-1)
    return b[:, 0] * block + torch.minimum(within, last)


class InverseCDFSampler:
    """The last logits processor of ``generate``: draws each row's token and forces generate's argmax onto it.

    ``generate`` runs greedy (``do_sample=False``); this processor turns the processed scores
    (temperature, top-k, top-p already applied) into probabilities, draws with
    :func:`inverse_cdf_sample` from each row's stream, and returns scores that are 0 at the
    drawn token and -inf elsewhere. ``streams=None`` keeps greedy decoding (temperature 0).

    With ``record=True`` it also keeps the drawn token's logprob under the processed
    distribution, ``log_softmax(scores)[drawn]``: exactly what was sampled from.
    """

    def __init__(self, streams: RowStreams | None, record: bool = False) -> None:
        self.streams = streams
        self.record = record
        self._steps: list[Tensor] = []  # T x [N]

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        scores = scores.float()
        if self.streams is None:
            drawn = scores.argmax(-1)
        else:
            drawn = inverse_cdf_sample(
                torch.softmax(scores, -1), self.streams.uniforms()
            )
        if self.record:
            self._steps.append(
                torch.log_softmax(scores, -1).gather(1, drawn[:, None])[:, 0]
            )
        return torch.full_like(scores, float("-inf")).scatter_(1, drawn[:, None], 0.0)

    def logprobs(self) -> Tensor:
        """``[N, T]`` logprob of each drawn token (T = decode steps run)."""
        return torch.stack(self._steps, dim=1)
