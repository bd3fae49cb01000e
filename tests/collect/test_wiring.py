"""``collect/wiring.py``: a Collector wired from explicit parts, no module (unit tier), and what it wires."""

from __future__ import annotations

import torch
from test_collector import CountingEngine, record, reward_by_id

from lightning_grpo.collect import CollectParts, RewardScorer, StepSampling, certifier_of, wire_collector
from lightning_grpo.collect.async_rollouts import AsyncRollouts
from lightning_grpo.config import GRPOConfig, RolloutConfig
from lightning_grpo.rollout.certificate_config import CertificateConfig
from lightning_grpo.tiny.tokenizer import make_char_tokenizer


def parts(engine, **kw) -> CollectParts:
    rl = GRPOConfig(batch_per_replica=4, group_size=2, micro_batch_per_replica=4)
    rollout = RolloutConfig(max_new_tokens=8)
    sampling = StepSampling(8, 1.0, 1.0, 0, (), False, seed=3)
    return CollectParts(engine, None, reward_by_id, RewardScorer(None), rl, rollout, sampling,
                        make_char_tokenizer(), **kw)


def test_a_wired_collector_collects_as_one_built_by_hand():
    """The parts reach the Collector: the engine draws, ``score`` rewards, ``rollout.max_new_tokens`` bounds it."""
    engine = CountingEngine()
    collector = wire_collector(parts(engine))
    batch, _ = collector.collect([record(0), record(2)], loop_step=0)
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]  # reward_by_id, groups in draw order
    assert [ids for ids, _, _ in engine.calls] == [[0, 2]]
    assert collector.schedule is None and collector.max_new_tokens == 8


def test_an_engine_that_draws_ahead_gets_a_schedule_with_the_checkpoint_in_flight():
    engine = AsyncRollouts(CountingEngine(), 1, weights_step=int)
    try:
        collector = wire_collector(parts(engine, in_flight={3: [7]}))
        assert collector.schedule is not None and collector.schedule.rollouts is engine
    finally:
        engine.close()


def test_no_certificate_section_builds_no_certifier():
    policy = torch.nn.Linear(1, 1)
    assert certifier_of(None, policy, make_char_tokenizer(), after_syncs=True) is None
    certifier = certifier_of(CertificateConfig(prompts=2), policy, make_char_tokenizer(), after_syncs=False)
    assert len(certifier.prompts) == 2 and certifier.after_syncs is False
