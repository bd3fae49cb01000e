"""The in-process engine's LoRA slot keeps its publications in /dev/shm (RAM until reboot): the folder goes when the
slot is closed, when it is dropped, and at interpreter exit, after a failure too (an engine nobody closes: a CLI
fit's).

The fast tier's check of what a vllm_lora fit leaves in /dev/shm; tests/test_leftovers.py runs the whole fit (slow).
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_grpo.rollout.adapter_slot import AdapterSlot

SHM = Path("/dev/shm")


def _slot_with_a_publication() -> AdapterSlot:
    slot = AdapterSlot(rank=4)
    (slot.root / "adapter-1").mkdir()
    (slot.root / "adapter-1" / "adapter_model.safetensors").write_bytes(b"weights")
    return slot


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_the_slot_lives_in_dev_shm_and_close_removes_it():
    slot = _slot_with_a_publication()
    assert slot.root.parent == SHM and slot.root.name.startswith("lightning-grpo-lora-")
    slot.close()
    assert not slot.root.exists()


def test_a_dropped_slot_takes_its_folder():
    slot = _slot_with_a_publication()
    root = slot.root
    del slot
    gc.collect()
    assert not root.exists()


EXITING = """
import sys
from lightning_grpo.rollout.adapter_slot import AdapterSlot
slot = AdapterSlot(rank=4)
(slot.root / "adapter-1").mkdir()
print(slot.root, flush=True)
if sys.argv[1] == "fails":
    raise RuntimeError("a reward function raised")
"""


@pytest.mark.parametrize("how", ["ends", "fails"])
def test_a_slot_nobody_closes_is_gone_after_the_process_exits(how):
    proc = subprocess.run([sys.executable, "-c", EXITING, how], capture_output=True, text=True, timeout=300)
    assert proc.returncode == (0 if how == "ends" else 1), proc.stderr[-2000:]
    root = Path(proc.stdout.split()[0])
    assert root.name.startswith("lightning-grpo-lora-") and not root.exists()
