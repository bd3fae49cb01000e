"""Async rollouts learn, and the rollout correction is part of why (issue 43 item 6), on configs/async-quickstart.yaml.

Per seed (0, 1, 2) three fits of the async quickstart (the quickstart task on a `vllm serve` child), each on one
server this module launches (every fit syncs its own weights first, as a run on a `server.url` does):

* ``sync``: ``max_off_policy_steps: 0``, the synchronous order;
* ``async``: ``max_off_policy_steps: 2`` with the config's ``rollout_correction: tis``: every batch after the first
  two drawn with weights two loop steps old, the gap weighed per token;
* ``uncorrected``: the same async run with the correction's weight dropped (the test-only ``uncorrected()`` below;
  users cannot select it: ``rollout_correction.mode: off`` with async is refused at load), so the stale batches are
  trained as if on-policy. Its correction figures are still measured, so it reports the gap it ignores.

And the async quickstart itself (``max_off_policy_steps: 1``) for its held-out validation over the seeds.
Overridden: the policy's seed (``policy.tiny.seed: 0``: the shipped warm start serves every seed) and the length,
40 of the config's 80 loop steps (the first 40 steps of an 80-step fit: the learning rate is constant and the
schedule fixes each batch's weights). The figures each fit reached, and the 80-step ones: docs/async.md.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from shipped_fits import RISE, SEEDS, shipped_fit

pytest.importorskip("vllm")

from lightning_grpo import correction  # noqa: E402
from lightning_grpo.objectives import grpo  # noqa: E402
from lightning_grpo.policy import PolicyConfig, resolve_path  # noqa: E402
from lightning_grpo.rollout.server_config import ServerConfig  # noqa: E402
from lightning_grpo.rollout.vllm_server import VLLMServerEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOOP_STEPS = 40
STALENESS = {"sync": 0, "async": 2, "uncorrected": 2, "shipped": 1}
"""``rollout.max_off_policy_steps`` of each kind of fit (``shipped``: configs/async-quickstart.yaml's own)."""
SERVER = ServerConfig(dtype="float32", max_model_len=256, enforce_eager=True, threads=1,
                      kv_cache_memory_bytes=256 << 20)
"""configs/async-quickstart.yaml's server section."""


@pytest.fixture(scope="module")
def server_url():
    policy = PolicyConfig(path="tiny:quickstart", dtype="float32", warm_start="arith_small", warm_start_steps=30)
    engine = VLLMServerEngine(resolve_path(policy), SERVER)
    yield engine.url
    engine.close()


@contextlib.contextmanager
def uncorrected():
    """The rollout correction's weight dropped (its figures still computed): stale batches trained as on-policy."""
    real = correction.correct

    def weightless(cfg, trainer, rollout, mask):
        return dataclasses.replace(real(cfg, trainer, rollout, mask), weight=None)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo, "correct", weightless)
        yield


def async_fit(kind: str, seed: int, url: str, tmp_path_factory):
    """The async quickstart of ``kind`` at ``seed`` on the server at ``url`` (once per session)."""
    overrides = (f"--model.rollout.server.url={url}", f"--model.rollout.max_off_policy_steps={STALENESS[kind]}",
                 f"--trainer.max_steps={LOOP_STEPS}", "--model.policy.tiny.seed=0")
    switch = uncorrected() if kind == "uncorrected" else contextlib.nullcontext()
    with switch:
        return shipped_fit("async-quickstart", seed, tmp_path_factory, *overrides, threads=1, tag=kind)


BAND = 20
"""The reward band of a fit: its mean reward/mean over the last this-many loop steps (1,280 sampled completions)."""
TOLERANCE = 0.03
"""How far below the synchronous seeds' lowest band an async fit may land and still be in it."""
MARGIN = 0.02
"""How much lower, on average over the seeds, the uncorrected fits' band must be than the corrected fits'."""


def band(fit) -> float:
    rewards = fit.values("reward/mean")
    assert len(rewards) == LOOP_STEPS
    return sum(rewards[-BAND:]) / BAND


@pytest.fixture(scope="module")
def bands(server_url, tmp_path_factory):
    """kind -> [the reward band of seeds 0, 1, 2]; prints the table of what each fit reached."""
    out = {}
    for kind in ("sync", "async", "uncorrected"):
        fits = [async_fit(kind, seed, server_url, tmp_path_factory) for seed in SEEDS]
        out[kind] = [band(f) for f in fits]
        for seed, fit in zip(SEEDS, fits):
            gap = fit.values("correction/logprob_gap_mean")
            print(f"{kind:>11} seed {seed}: reward band {band(fit):.3f}, val/reward {fit.values('val/reward')}, "
                  f"|log pi_old - log pi_rollout| {sum(gap) / len(gap):.4f}, {fit.seconds:.0f} s "
                  f"({fit.cpu_seconds:.0f} s CPU)")
    return out


def test_every_async_batch_after_the_first_two_is_two_loop_steps_stale(bands, server_url, tmp_path_factory):
    for kind in ("async", "uncorrected"):
        for seed in SEEDS:
            fit = async_fit(kind, seed, server_url, tmp_path_factory)
            stale = fit.values("rollout/staleness")
            assert stale[:2] == [0.0, 1.0] and set(stale[2:]) == {2.0}, (kind, seed, stale)
            # The gap the correction weighs is there: sampler and trainer pi_old differ by ~0.05 nats a token
            # (synchronous: float32 rounding, ~1e-7).
            gap = fit.values("correction/logprob_gap_mean")
            assert sum(gap[2:]) / len(gap[2:]) > 0.01, (kind, seed, gap)
    for seed in SEEDS:
        gap = async_fit("sync", seed, server_url, tmp_path_factory).values("correction/logprob_gap_mean")
        assert max(gap) < 1e-4, gap


def test_async_with_correction_reaches_the_synchronous_band(bands):
    low = min(bands["sync"]) - TOLERANCE
    assert all(b >= low for b in bands["async"]), bands
    assert sum(bands["async"]) / len(SEEDS) >= sum(bands["sync"]) / len(SEEDS) - TOLERANCE, bands


def test_without_correction_the_same_async_run_does_worse(bands):
    """Measured margins in the note of docs/async.md; an inert switch (or a correction that does nothing) gives a
    margin around 0 and fails."""
    margins = [c - u for c, u in zip(bands["async"], bands["uncorrected"])]
    assert sum(margins) / len(SEEDS) >= MARGIN, (margins, bands)
    assert sum(m > 0 for m in margins) >= 2, (margins, bands)


@pytest.mark.xdist_group("async-held-out")  # its own fits: under pytest-xdist, beside the three kinds' (own server)
@pytest.mark.parametrize("seed", SEEDS)
def test_the_async_quickstart_held_out_validation_rises(seed, server_url, tmp_path_factory):
    """configs/async-quickstart.yaml (one loop step off), its size shortened to LOOP_STEPS: the greedy held-out
    reward at the end is above the starting policy's (loop step 0)."""
    fit = async_fit("shipped", seed, server_url, tmp_path_factory)
    val = fit.series("val/reward")
    print(f"async-quickstart seed {seed}: val/reward {val} ({fit.seconds:.0f} s, {fit.cpu_seconds:.0f} s CPU)")
    assert val[0][0] == 0 and val[-1][0] == LOOP_STEPS, val
    assert val[-1][1] > val[0][1] + RISE, val
