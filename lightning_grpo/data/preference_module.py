"""PreferenceDataModule: preference pairs for ``DPOModule``, one list (this rank's share) per optimizer step.

Same shape as ``PromptDataModule``: an infinite stream with deterministic ids (a pair's id is its stream
position), our own sharding over data-parallel ranks (no ``DistributedSampler``), and a ``state_dict`` that
resumes the stream where it stopped. Reading and tokenizing pairs is ``preferences.py``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_grpo.data.preferences import PreferencePair, load_pairs
from lightning_grpo.data.steps import Steps, step_loader


class PreferenceDataModule(LightningDataModule):
    """Preference pairs for ``DPOModule``: one list (this rank's share) per optimizer step, deterministic order.

    The stream of pairs is the source in a per-epoch shuffled order (seeded ``seed + epoch``); step ``s`` takes
    stream positions ``s*P .. s*P + P - 1`` (``P`` = ``pairs_per_step``), rank ``r`` of ``W`` the ``r``-th
    contiguous ``P / W`` of them. A pair's id is its stream position. Tokenizing is the module's (it owns the
    tokenizer), so batches are host text.

    Args:
        source: ``builtin:<task>``, a ``.jsonl`` file in TRL's preference format, a ``datasets`` name or folder,
            or (from Python) a ``datasets.Dataset`` / list of dicts.
        pairs_per_step: pairs per optimizer step over all ranks; None = the module's ``dpo.batch_size``.
        prompt_key: column of the prompt (a string or chat messages).
        chosen_key: column of the preferred answer.
        rejected_key: column of the other answer.
        seed: seeds the per-epoch shuffle and a built-in task's draw.
        shuffle: reshuffle every epoch; off = source order.
        builtin_size: pairs drawn from a built-in task for training.
        val_source: held-out pairs (same forms as ``source``); null = a built-in task's held-out pairs, or none.
        val_size: held-out pairs used (the first ``val_size``); 0 disables validation.

    Example::

        dm = PreferenceDataModule("pairs.jsonl", pairs_per_step=32, val_source="held_out.jsonl")
    """

    def __init__(
        self,
        source: str | Sequence[Mapping[str, Any]] = "builtin:arith_small",
        pairs_per_step: int | None = None,
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        seed: int = 0,
        shuffle: bool = True,
        builtin_size: int = 10_000,
        val_source: str | Sequence[Mapping[str, Any]] | None = None,
        val_size: int = 64,
    ) -> None:
        super().__init__()
        if pairs_per_step is not None and (
            not isinstance(pairs_per_step, int) or pairs_per_step < 1
        ):
            raise ValueError(
                f"PreferenceDataModule(pairs_per_step={pairs_per_step!r}): must be a positive integer"
            )
        if val_size < 0:
            raise ValueError(
                f"PreferenceDataModule(val_size={val_size}): must be >= 0 (0 disables validation)"
            )
        self.source = source
        self.val_source = val_source
        self.pairs_per_step = pairs_per_step
        self.keys = {
            "prompt_key": prompt_key,
            "chosen_key": chosen_key,
            "rejected_key": rejected_key,
        }
        self.seed = seed
        self.shuffle = shuffle
        self.builtin_size = builtin_size
        self.val_size = val_size
        self.rank = 0
        self.world_size = 1
        self._pairs: list[PreferencePair] | None = None
        self._val: list[PreferencePair] = []
        self._orders: dict[int, list[int]] = {}
        self._consumed = 0

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None:
            self.rank = self.trainer.global_rank
            self.world_size = self.trainer.world_size
            dpo = getattr(self.trainer.lightning_module, "dpo", None)
            if self.pairs_per_step is None and dpo is not None:
                self.pairs_per_step = dpo.batch_size
        if self.pairs_per_step is None:
            raise ValueError(
                "PreferenceDataModule(pairs_per_step=None): without a DPOModule trainer, give it"
            )
        if self.pairs_per_step % self.world_size:
            raise ValueError(
                f"PreferenceDataModule(pairs_per_step={self.pairs_per_step}): must divide evenly over "
                f"{self.world_size} data-parallel ranks"
            )
        if self._pairs is None:
            self._pairs = load_pairs(
                self.source, **self.keys, size=self.builtin_size, seed=self.seed
            )
            self._val = self._load_val()
        if self.trainer is not None and not self._val and stage == "fit":
            # No held-out pairs (val_size: 0): validation off by Lightning's knob, as PromptDataModule does, instead of
            # an empty val_dataloader it warns about ("Total length of `list` across ranks is zero") every fit.
            self.trainer.limit_val_batches = 0

    def _load_val(self) -> list[PreferencePair]:
        if self.val_size == 0:
            return []
        if self.val_source is not None:
            return load_pairs(
                self.val_source, **self.keys, size=self.val_size, seed=self.seed
            )[: self.val_size]
        if isinstance(self.source, str) and self.source.startswith("builtin:"):
            return load_pairs(
                self.source, split="val", size=self.val_size, seed=self.seed
            )
        return []

    @property
    def position(self) -> int:
        """Optimizer steps of pairs drawn so far."""
        return self._consumed

    def pairs_at(self, step: int) -> list[PreferencePair]:
        """This rank's pairs of step ``step`` (ids are stream positions)."""
        if self._pairs is None:
            self.setup("fit")
        per_rank = self.pairs_per_step // self.world_size
        n = len(self._pairs)
        start = step * self.pairs_per_step + self.rank * per_rank
        out = []
        for position in range(start, start + per_rank):
            epoch, slot = divmod(position, n)
            out.append(replace(self._pairs[self._order(epoch)[slot]], id=position))
        return out

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self._pairs)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def val_batches(self) -> list[list[PreferencePair]]:
        """This rank's held-out pairs in equal lists (the last wraps around, so every rank runs as many)."""
        if self._pairs is None:
            self.setup("fit")
        n = len(self._val)
        per_rank = self.pairs_per_step // self.world_size
        batches = []
        for step in range(-(-n // self.pairs_per_step) if n else 0):
            start = step * self.pairs_per_step + self.rank * per_rank
            batches.append([self._val[(start + i) % n] for i in range(per_rank)])
        return batches

    @override
    def train_dataloader(self) -> DataLoader:
        return step_loader(Steps(self.pairs_at, self))

    @override
    def val_dataloader(self) -> DataLoader | list:
        batches = self.val_batches()
        return step_loader(batches) if batches else []

    @override
    def transfer_batch_to_device(
        self, batch: Any, device: Any, dataloader_idx: int
    ) -> Any:
        return batch  # host text: the module tokenizes and moves tensors per chunk

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is None or self.trainer.training:
            self.mark_consumed(batch)
        return batch

    def mark_consumed(self, batch: Sequence[PreferencePair]) -> None:
        if batch:
            self._consumed = max(self._consumed, batch[0].id // self.pairs_per_step + 1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.state_dict_at(self._consumed)

    def state_dict_at(self, position: int) -> dict[str, Any]:
        return {
            "position": position,
            "pairs_per_step": self.pairs_per_step,
            "seed": self.seed,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("pairs_per_step")
        if (
            self.pairs_per_step is not None
            and saved is not None
            and saved != self.pairs_per_step
        ):
            raise ValueError(
                f"resumed PreferenceDataModule(pairs_per_step={self.pairs_per_step}) but the checkpoint "
                f"used {saved}: keep pairs_per_step unchanged"
            )
        self.pairs_per_step = self.pairs_per_step or saved
        self._consumed = int(state_dict["position"])
