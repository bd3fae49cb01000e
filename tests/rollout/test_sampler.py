"""The inverse-CDF sampler draws from the same distribution as torch.multinomial; seeds are per (prompt, sample)."""

from __future__ import annotations

import pytest
import torch

from lightning_grpo.rollout.base import SamplingConfig
from lightning_grpo.rollout.hf import _processors
from lightning_grpo.rollout.sampler import (
    InverseCDFSampler,
    RowStreams,
    inverse_cdf_sample,
    row_seeds,
    sample_seed,
)

pytestmark = pytest.mark.integration  # a fit with a transformers policy: not the unit tier

DRAWS = 20_000


def chi2_sf(stat: float, df: int) -> float:
    """P(chi2_df >= stat): the regularized upper incomplete gamma function."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``counts`` under ``probs`` (Pearson), over the tokens with non-zero probability."""
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def homogeneity(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value that two count vectors come from one distribution (2 x K contingency table)."""
    keep = (a + b) > 0
    a, b = a[keep].double(), b[keep].double()
    col, n_a, n_b = a + b, a.sum(), b.sum()
    e_a, e_b = col * n_a / (n_a + n_b), col * n_b / (n_a + n_b)
    stat = float(((a - e_a) ** 2 / e_a).sum() + ((b - e_b) ** 2 / e_b).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


def warp(sampling: SamplingConfig, scores: torch.Tensor) -> torch.Tensor:
    """The engine's warpers alone (temperature, top-k, top-p), without the draw."""
    from transformers import LogitsProcessorList

    warpers = LogitsProcessorList(_processors(sampling, InverseCDFSampler(None))[:-1])
    return warpers(torch.zeros(len(scores), 1, dtype=torch.long), scores.clone())


LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -0.8, -1.5, -2.0, -3.0])


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 8, 0.9)])
def test_same_distribution_as_multinomial(temperature, top_k, top_p):
    """20k draws of one 12-token distribution, warped as the engine warps it: ours fit the exact probabilities and
    match torch.multinomial's draws (chi-square), and tokens cut by top-k/top-p are never drawn."""
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    sampler = InverseCDFSampler(RowStreams([sample_seed(7, 0, j) for j in range(DRAWS)]))
    procs = _processors(sampling, sampler)
    scores = LOGITS.expand(DRAWS, -1).clone()
    forced = procs(torch.zeros(DRAWS, 1, dtype=torch.long), scores)  # [DRAWS, V]: 0 at the draw, -inf elsewhere
    ours = torch.bincount(forced.argmax(-1), minlength=len(LOGITS)).double()
    warped = warp(sampling, LOGITS[None])
    probs = torch.softmax(warped[0], -1).double()
    reference = torch.multinomial(probs.float(), DRAWS, replacement=True, generator=torch.Generator().manual_seed(3))
    theirs = torch.bincount(reference, minlength=len(LOGITS)).double()
    assert ours[probs == 0].sum() == 0 and theirs[probs == 0].sum() == 0
    assert (probs == 0).any() == (top_k > 0 or top_p < 1)
    assert goodness_of_fit(ours, probs) > 1e-3
    assert homogeneity(ours, theirs) > 1e-3


def test_the_chi_square_check_catches_a_biased_sampler():
    """The same check fails for a draw whose uniform is slightly skewed (u**1.05): the tests above have power."""
    probs = torch.softmax(LOGITS, -1).double()
    u = torch.rand(DRAWS, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    fair = torch.bincount(inverse_cdf_sample(probs.expand(DRAWS, -1), u), minlength=len(LOGITS)).double()
    skewed = torch.bincount(inverse_cdf_sample(probs.expand(DRAWS, -1), u**1.05), minlength=len(LOGITS)).double()
    assert goodness_of_fit(fair, probs) > 1e-3
    assert goodness_of_fit(skewed, probs) < 1e-3


def test_the_ends_of_the_unit_interval_land_on_tokens_that_can_be_drawn():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]])
    lowest, highest = torch.tensor([0.0]), torch.tensor([1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf_sample(probs, lowest).item() == 1
    assert inverse_cdf_sample(probs, highest).item() == 3
    unnormalized = torch.tensor([[0.0, 3.0, 1.0, 0.0]])  # only ratios matter
    assert inverse_cdf_sample(unnormalized, torch.tensor([0.74])).item() == 1
    assert inverse_cdf_sample(unnormalized, torch.tensor([0.76])).item() == 2


def test_recorded_logprobs_are_of_the_warped_distribution_at_the_drawn_token():
    sampling = SamplingConfig(temperature=0.8, top_k=6, top_p=0.95)
    sampler = InverseCDFSampler(RowStreams(range(64)), record=True)
    forced = _processors(sampling, sampler)(torch.zeros(64, 1, dtype=torch.long), LOGITS.expand(64, -1).clone())
    drawn = forced.argmax(-1)
    warped = warp(sampling, LOGITS.expand(64, -1))
    want = torch.log_softmax(warped, -1).gather(1, drawn[:, None])[:, 0]
    torch.testing.assert_close(sampler.logprobs()[:, 0], want, rtol=0, atol=0)


def test_seeds_are_distinct_per_prompt_and_sample_and_stable_across_runs():
    seeds = [sample_seed(5, p, j) for p in range(50) for j in range(16)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(5, 3, 1) != sample_seed(5, 1, 3) != sample_seed(6, 3, 1)
    assert sample_seed(0, 0, 0) == 4808561972376111626  # a fixed function of its inputs: runs replay
    assert row_seeds([4, 9], 2, 5) == [sample_seed(5, 4, 0), sample_seed(5, 4, 1), sample_seed(5, 9, 0),
                                       sample_seed(5, 9, 1)]
    torch.manual_seed(0)
    unseeded = row_seeds([4, 9], 2, None)
    torch.manual_seed(0)
    assert row_seeds([4, 9], 2, None) == unseeded  # unseeded draws follow torch's global seed


def test_a_rows_draws_do_not_depend_on_the_rows_beside_it():
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    alone = RowStreams([sample_seed(1, 7, 2)])
    beside = RowStreams([sample_seed(1, 3, 0), sample_seed(1, 7, 2), sample_seed(1, 9, 0)])
    for _ in range(20):  # step after step, row 1 draws as if it were alone
        assert inverse_cdf_sample(probs[1:2], alone.uniforms())[0] == inverse_cdf_sample(probs, beside.uniforms())[1]


@pytest.mark.parametrize("vocab,block", [(1000, 64), (1024, 256), (37, 8), (5, 256)])
def test_the_two_level_search_draws_what_one_flat_cumulative_sum_draws(vocab, block):
    """Blocks then tokens pick the token a single float64 cumulative sum over the whole row picks, for a vocabulary
    that is and is not a multiple of the block, masked (zero) tokens and blocks, and uniforms at the ends."""
    gen = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(64, vocab, generator=gen) * 3, -1)
    probs[probs < probs.quantile(0.6, dim=-1, keepdim=True)] = 0  # top-p-like masks: whole blocks go to zero
    probs[0] = 0
    probs[0, -1] = 1  # all mass on the last token
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    u[1], u[2] = 0.0, 1 - 2**-53
    cdf = probs.cumsum(-1, dtype=torch.float64)
    flat = torch.searchsorted(cdf, torch.minimum(u[:, None] * cdf[:, -1:], torch.nextafter(cdf[:, -1:],
                              torch.zeros(1, dtype=torch.float64))), right=True)[:, 0]
    drawn = inverse_cdf_sample(probs, u, block=block)
    assert torch.equal(drawn, flat)
    assert bool((probs.gather(1, drawn[:, None]) > 0).all())


def test_a_target_past_a_blocks_rounded_end_takes_its_last_drawable_token():
    """The block sum says the target is inside the block, the block's own cumulative sum ends an ulp short: the draw
    is the block's last non-zero token, never a zero-width one after it."""
    probs = torch.tensor([[0.1, 0.2, 0.0, 0.0, 0.3, 0.4, 0.0, 0.0]], dtype=torch.float64)
    u = torch.tensor([1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf_sample(probs, u, block=4).item() == 5
    assert inverse_cdf_sample(probs[:, :4], u, block=4).item() == 1
