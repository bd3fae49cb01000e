"""Prompts with deterministic ids, one list per loop step, sharded over data-parallel ranks.

The stream and its ids are ``data/stream.py``'s. Resuming from ``state_dict`` continues at the next step, and
the refill lane (dynamic sampling) at its next round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_grpo.data.chat import fit_items
from lightning_grpo.data.holdout import (
    HOLDOUT_SEED,
    hold_out,
    load_held_out,
    val_batches,
)
from lightning_grpo.data.image_files import check_image_files
from lightning_grpo.data.items import TaskItem
from lightning_grpo.data.seam import PromptConsumer, PromptProvider
from lightning_grpo.data.sources import load_items
from lightning_grpo.data.steps import Fixed, Steps, step_loader
from lightning_grpo.data.stream import PromptRecord, PromptStream

# the stream's and the held-out seed's names, from here too
__all__ = ["HOLDOUT_SEED", "PromptDataModule", "PromptRecord", "PromptStream"]


def _name(source: Any) -> str:
    return repr(source) if isinstance(source, str) else f"<{type(source).__name__}>"


class PromptDataModule(PromptProvider, LightningDataModule):
    """Prompt lists for the GRPO loop: one list (this rank's share) per loop step, with deterministic ids.

    The train loader is an infinite ``IterableDataset`` with ``batch_size=None``, so Lightning
    injects no ``DistributedSampler``: the sharding is ours (see the module docstring). The
    position (steps consumed) advances when a training batch reaches the model
    (``on_before_batch_transfer``), so a checkpoint taken after a step resumes with the next one.

    Args:
        source: ``"builtin:<task>"`` (e.g. ``builtin:arith``), a local file (``.jsonl``, ``.json``,
            ``.parquet``, ``.csv``), a folder (``save_to_disk`` output or data files), a ``datasets`` Hub id
            (``openai/gsm8k``; offline: from the local datasets cache), or (from Python) a ``datasets.Dataset`` /
            list of dicts.
        split: split of a ``datasets`` id or folder to train on (``train``); a single file has one.
        subset: configuration (subset) of a ``datasets`` id, e.g. ``main`` for ``openai/gsm8k``; null = the default.
        prompts_per_step: prompts per loop step over all data-parallel ranks (each rank gets
            ``prompts_per_step / world_size``); None = the module's ``rl.prompts_per_batch``.
        prompt_key: column of the prompt: a string, or a list of chat messages (TRL's conversational format).
        answer_key: column of the reference answer; null when the prompts have none. Every column of a row
            (this one too) travels with its prompt to the reward functions.
        prompt_template: ``"gsm8k"`` or a format string with ``{prompt}`` wrapped around every string prompt;
            null = as is.
        system_prompt: a system message put first in chat prompts; prepended (plus a newline) to plain ones.
        chat: wrap string prompts as one user message so they go through the tokenizer's chat template (what an
            instruct model expects); chat-message prompts always do.
        seed: seeds the per-epoch shuffle (``seed + epoch``) and a built-in task's draw.
        shuffle: reshuffle every epoch; off = source order.
        builtin_size: prompts drawn from a built-in task for training.
        val_source: held-out prompts (same forms as ``source``); null = a built-in task's held-out draw,
            ``val_split`` of ``source``, or else ``val_size`` rows held out of ``source`` (never trained on).
        val_split: split holding the held-out prompts (of ``val_source``, else of ``source``), e.g. ``test``.
        val_size: held-out prompts to use; 0 disables validation.
        val_samples_per_prompt: k sampled completions per held-out prompt (the training temperature) beside the
            greedy one, for ``val/pass@k`` (unbiased estimator), ``val/pass@1`` and ``val/mean@k``; 0 = greedy only.
        val_pass_reward: a sampled completion passes when its total reward is at least this (1.0: a verifiable
            reward's "correct").
        image_key: column of the prompt's images (paths, bytes, PIL images or a ``datasets`` Image column; one or a
            list; ``image`` is read when it is absent). Records keep references; pixels are decoded per chunk.
        on_bad_record: a record whose image cannot be read, met at the loop step that draws it: ``error`` stops
            the run naming the record id and path; ``skip`` trains that step without the record's group (counted
            in ``data/bad_records_skipped``).

    Example::

        dm = PromptDataModule("builtin:arith", prompts_per_step=4)
        first = next(iter(dm.train_dataloader()))  # [PromptRecord(id=0, ...), ..., PromptRecord(id=3, ...)]
    """

    def __init__(
        self,
        source: str | Sequence[Mapping[str, Any]] = "builtin:arith",
        split: str = "train",
        subset: str | None = None,
        prompts_per_step: int | None = None,
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        prompt_template: str | None = None,
        system_prompt: str | None = None,
        chat: bool = False,
        seed: int = 0,
        shuffle: bool = True,
        builtin_size: int = 10_000,
        val_source: str | Sequence[Mapping[str, Any]] | None = None,
        val_split: str | None = None,
        val_size: int = 64,
        val_samples_per_prompt: int = 0,
        val_pass_reward: float = 1.0,
        image_key: str = "images",
        on_bad_record: Literal["error", "skip"] = "error",
    ) -> None:
        super().__init__()
        _check_knobs(prompts_per_step, val_size, val_samples_per_prompt, on_bad_record)
        self.val_samples_per_prompt = val_samples_per_prompt
        self.val_pass_reward = val_pass_reward
        self.on_bad_record = on_bad_record
        self.bad_records_skipped = 0
        """Records skipped for an unreadable image (``on_bad_record=skip``; logged: data/bad_records_skipped)."""
        # the train / held-out pairs
        self.source = source
        self.val_source = val_source
        self.split = split
        self.val_split = val_split
        self.prompts_per_step = prompts_per_step
        self._load = {
            "prompt_key": prompt_key,
            "answer_key": answer_key,
            "prompt_template": prompt_template,
            "system_prompt": system_prompt,
            "chat": chat,
            "seed": seed,
            "subset": subset,
            "image_key": image_key,
        }
        self.seed = seed
        self.shuffle = shuffle
        self.builtin_size = builtin_size
        self.val_size = val_size
        self.rank = 0
        self.world_size = 1
        self.long_prompts_dropped = 0
        """Training prompts dropped as longer than ``rollout.max_prompt_tokens`` (logged: data/long_prompts_dropped)."""
        self._start_unloaded()

    def _start_unloaded(self) -> None:
        """Nothing loaded yet (``setup`` loads), the stream at its start."""
        self._items: list[TaskItem] | None = None
        self._val_given: list[TaskItem] | None = None
        self._stream: PromptStream | None = None
        self._val_items: list[TaskItem] | None = None
        self._prepared: tuple | None = None
        self._consumed = 0
        # the refill lane (dynamic sampling), over the training items
        self._refill: PromptStream | None = None
        # refill rounds drawn, every rank alike (each rank takes its share of a round)
        self._refill_rounds = 0
        # refill rounds drawn before the current loop step (its boundary)
        self._rounds_at: dict[int, int] = {}

    # -- setup -------------------------------------------------------------------------------------------------------
    @override
    def setup(self, stage: str | None = None) -> None:
        """Read rank/world and ``prompts_per_step`` from the trainer (if attached), then load the sources."""
        if self.trainer is not None:
            self.rank = self.trainer.global_rank
            self.world_size = self.trainer.world_size
            if self.prompts_per_step is None:
                self.prompts_per_step = self._prompts_from_module()
        if self.prompts_per_step is None:
            raise ValueError(
                "PromptDataModule(prompts_per_step=None): without a trainer, give prompts_per_step"
            )
        if self.prompts_per_step % self.world_size:
            raise ValueError(
                f"PromptDataModule(prompts_per_step={self.prompts_per_step}): must divide evenly over "
                f"{self.world_size} data-parallel ranks (a prompt's group never splits across ranks)"
            )
        if self._items is None:
            self._items = load_items(
                self.source,
                size=self.builtin_size,
                split="train",
                dataset_split=self.split,
                **self._load,
            )
            self._val_given = load_held_out(
                self.source,
                self.val_source,
                self.split,
                self.val_split,
                self.val_size,
                self._load,
            )
            check_image_files(self._items, _name(self.source), self.on_bad_record)
            self._assemble()
        if self.trainer is not None and not self._val_items and stage == "fit":
            # No held-out prompts (data.val_size: 0): validation is off. Lightning's knob for that, instead of an
            # empty val_dataloader it would warn about ("Total length of `list` across ranks is zero") every fit.
            self.trainer.limit_val_batches = 0

    def prepare_prompts(
        self, tokenizer, max_tokens: int | None, on_long: str = "drop"
    ) -> None:
        """Fit the prompts to the policy, once, before training (``GRPOModule.setup`` calls this).

        Chat prompts need the tokenizer's chat template; prompts over ``max_tokens`` are dropped (counted in
        ``long_prompts_dropped``, warned once) or refused (``on_long="error"``). Raises before any step runs.
        """
        self._ensure_setup()
        key = (id(tokenizer), max_tokens, on_long)
        if self._prepared != key:
            self._assemble(tokenizer, max_tokens, on_long)
            self._prepared = key

    def _assemble(
        self, tokenizer=None, max_tokens: int | None = None, on_long: str = "drop"
    ) -> None:
        """The training stream and the held-out items from the loaded ones (fitted to ``tokenizer`` if given)."""
        items = self._items
        rows = list(range(len(self._items)))
        val = self._val_given
        if tokenizer is not None:
            items, rows = fit_items(
                items,
                tokenizer,
                max_tokens,
                on_long,
                f"data.source={_name(self.source)}",
            )
            self.long_prompts_dropped = len(self._items) - len(items)
            if val:
                val, _ = fit_items(
                    val, tokenizer, max_tokens, on_long, "held-out prompts (validation)"
                )
        if val is None:  # hold val_size rows of the source out of training
            items, rows, val = hold_out(items, rows, self.val_size, _name(self.source))
        self._stream = PromptStream(items, self.seed, self.shuffle, rows)
        self._refill = PromptStream(items, self.seed, self.shuffle, rows, lane="refill")
        self._val_items = val

    @property
    def has_images(self) -> bool:
        """Whether any training or held-out prompt carries images (a text-only policy is refused at setup)."""
        self._ensure_setup()
        return any(it.images for it in self._items) or any(
            it.images for it in self._val_given or []
        )

    @property
    def columns(self) -> set[str]:
        """Names of the columns that travel with each prompt to the reward functions (``answer`` included)."""
        self._ensure_setup()
        names = {k for it in self._items for k in it.meta}
        return names | (
            {"answer"} if any(it.answer is not None for it in self._items) else set()
        )

    def _prompts_from_module(self) -> int:
        module = self.trainer.lightning_module
        if not isinstance(module, PromptConsumer):
            raise ValueError(
                "PromptDataModule(prompts_per_step=None) reads the module's prompts_per_step (data/seam.py), "
                f"which {type(module).__name__} lacks; give prompts_per_step"
            )
        return int(module.prompts_per_step)

    # -- stream --------------------------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Loop steps consumed so far (the next training batch is this step's prompts)."""
        return self._consumed

    def records(self, step: int) -> list[PromptRecord]:
        """This rank's prompts of loop step ``step``."""
        self._ensure_setup()
        return self._stream.step(
            step, self.prompts_per_step, self.rank, self.world_size
        )

    def upcoming_records(self, ahead: int) -> list[PromptRecord]:
        """This rank's prompts of the loop step ``ahead`` steps after the one being drawn (its batch already fetched:
        the position has passed it)."""
        return self.records(self.position - 1 + ahead)

    def refill_records(self) -> list[PromptRecord]:
        """This rank's share of the next refill round (dynamic sampling): ``prompts_per_step`` prompts of the refill
        lane over all ranks, sharded like a loop step. Every rank calls it once per round, so the cursor agrees."""
        self._ensure_setup()
        self._refill_rounds += 1
        return self._refill.step(
            self._refill_rounds - 1, self.prompts_per_step, self.rank, self.world_size
        )

    def val_batches(self) -> list[list[PromptRecord]]:
        """This rank's held-out prompts, one list per validation step; ids are held-out indices.

        The last step wraps around to the start, so every rank gets the same number of equal lists
        (uneven ranks would hang a distributed validation loop); wrapped prompts repeat their ids.
        """
        self._ensure_setup()
        return val_batches(
            self._val_items, self.prompts_per_step, self.rank, self.world_size
        )

    def _ensure_setup(self) -> None:
        if self._items is None:
            self.setup("fit")

    # -- loaders -------------------------------------------------------------------------------------------------
    @override
    def train_dataloader(self) -> DataLoader:
        self._ensure_setup()
        return step_loader(Steps(self.records, self))

    @override
    def val_dataloader(self) -> DataLoader | list:
        batches = self.val_batches()
        return step_loader(Fixed(batches)) if batches else []

    @override
    def transfer_batch_to_device(
        self, batch: Any, device: Any, dataloader_idx: int
    ) -> Any:
        # Records are host text (tensors move per chunk in GRPOModule.forward_chunk). The only override of this
        # hook: GRPOModule has none, so Lightning never warns that two implementations compete.
        return batch

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Advance the position when a training batch reaches the model (not when the loader prefetches it)."""
        if self.trainer is None or self.trainer.training:
            self.mark_consumed(batch)
        return batch

    def mark_consumed(self, batch: Sequence[PromptRecord]) -> None:
        """Record that ``batch`` (one step's records) was used; loops without a Trainer call this themselves."""
        if batch and batch[0].id // self.prompts_per_step + 1 > self._consumed:
            # this step's boundary
            self._rounds_at = {
                batch[0].id // self.prompts_per_step: self._refill_rounds
            }
            self._consumed = batch[0].id // self.prompts_per_step + 1

    # -- checkpoint ----------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return self.state_dict_at(self._consumed)

    def state_dict_at(self, position: int) -> dict[str, Any]:
        """``state_dict()`` as it was after ``position`` loop steps (a checkpoint written inside a loop step
        records the state before it, so the resume draws that step's prompts again, and its refills)."""
        rounds = self._rounds_at.get(position, self._refill_rounds)
        return {
            "position": position,
            "prompts_per_step": self.prompts_per_step,
            "seed": self.seed,
            "refill_rounds": rounds,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("prompts_per_step")
        if (
            self.prompts_per_step is not None
            and saved is not None
            and saved != self.prompts_per_step
        ):
            raise ValueError(
                f"resumed PromptDataModule(prompts_per_step={self.prompts_per_step}) but the checkpoint used {saved}: "
                "the prompt stream would not continue where it stopped; keep prompts_per_step unchanged"
            )
        self.prompts_per_step = self.prompts_per_step or saved
        self._consumed = int(state_dict["position"])
        self._refill_rounds = int(state_dict.get("refill_rounds", 0))
        self._rounds_at = {}


def _check_knobs(
    prompts_per_step: int | None,
    val_size: int,
    val_samples_per_prompt: int,
    on_bad_record: str,
) -> None:
    """The constructor's arguments that have a range, checked in order (the first one out of range raises)."""
    if prompts_per_step is not None and (
        not isinstance(prompts_per_step, int) or prompts_per_step < 1
    ):
        raise ValueError(
            f"PromptDataModule(prompts_per_step={prompts_per_step!r}): must be a positive integer"
        )
    if val_size < 0:
        raise ValueError(
            f"PromptDataModule(val_size={val_size}): must be >= 0 (0 disables validation)"
        )
    if not isinstance(val_samples_per_prompt, int) or val_samples_per_prompt < 0:
        raise ValueError(
            f"PromptDataModule(val_samples_per_prompt={val_samples_per_prompt!r}): must be an integer "
            ">= 0 (0 = greedy validation only)"
        )
    if on_bad_record not in ("error", "skip"):
        raise ValueError(
            f"PromptDataModule(on_bad_record={on_bad_record!r}): must be 'error' or 'skip'"
        )
