"""Which publisher keeps a fit's engine current (``trainer_side.engine_publisher``, ``publisher.engine_sleeps``): the
Trainer's own, else a hand-off attached for an engine with weights of its own, else none (unit tier, no fit)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from test_capabilities import BareEngine

from lightning_grpo.handoff import HandoffCallback
from lightning_grpo.publisher import NoPublisher, engine_sleeps
from lightning_grpo.trainer_side import engine_publisher


class Recorded(BareEngine):
    holds_weights = False  # replayed rollouts: nothing to publish


def trainer(*callbacks) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=list(callbacks))


def test_the_trainers_publisher_is_used_as_it_is():
    own = HandoffCallback(colocated_offload=False)
    t = trainer(own)
    assert engine_publisher(t, BareEngine(), torch.nn.Linear(1, 1)) is own
    assert engine_sleeps(t.callbacks) is own.sleeps_engine


def test_an_engine_with_weights_of_its_own_gets_a_hand_off_before_the_checkpoints():
    t = trainer(ModelCheckpoint(dirpath=None))
    publisher = engine_publisher(t, BareEngine(), torch.nn.Linear(1, 1))
    assert isinstance(publisher, HandoffCallback) and not publisher.sleeps_engine
    kinds = [type(cb) for cb in t.callbacks]
    assert kinds.index(HandoffCallback) < kinds.index(ModelCheckpoint)
    assert engine_sleeps([]) is False  # no publisher: the engine is built without sleep mode


def test_an_engine_without_weights_needs_no_publisher():
    t = trainer()
    assert isinstance(engine_publisher(t, Recorded(), torch.nn.Linear(1, 1)), NoPublisher)
    assert not any(isinstance(cb, HandoffCallback) for cb in t.callbacks)


def test_two_publishers_are_refused():
    with pytest.raises(ValueError, match="2 weight publishers"):
        engine_sleeps([HandoffCallback(colocated_offload=False), HandoffCallback(colocated_offload=False)])
