"""The typed seam between a GRPO module and its prompt datamodule: what each asks of the other, and nothing else.

``PromptDataModule`` is a ``PromptProvider``; ``GRPOModule`` is a ``PromptConsumer``. Either side may be
the user's own class: a datamodule that is not a ``PromptProvider`` is simply not asked (no chat fitting, no
column check, no counters, no dynamic sampling), a module that is not a ``PromptConsumer`` must be given ``prompts_per_step``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class PromptProvider:
    """What the module asks of its datamodule: fit prompts to the policy, the columns rewards may read, what a record
    with an unreadable image does, and the counters it logs. A datamodule opts in by subclassing it (a nominal type:
    checking a structural one would evaluate ``has_images``, which loads the data)."""

    on_bad_record: str = "error"
    """``error`` or ``skip`` (a record whose image cannot be read)."""
    bad_records_skipped: int = 0
    """Records skipped so far (``on_bad_record=skip``); the module adds the ones it skips."""
    long_prompts_dropped: int = 0
    """Training prompts dropped as longer than the prompt limit."""
    val_samples_per_prompt: int = 0
    """k sampled completions per held-out prompt beside the greedy one (``val/pass@k``; 0 = none)."""
    val_pass_reward: float = 1.0
    """A sampled held-out completion passes when its total reward is at least this."""

    @property
    def has_images(self) -> bool:
        """Whether any prompt carries images (a text-only policy is refused at setup)."""
        raise NotImplementedError

    @property
    def columns(self) -> set[str]:
        """Names of the columns that travel with each prompt to the reward functions."""
        raise NotImplementedError

    def prepare_prompts(
        self, tokenizer, max_tokens: int | None, on_long: str = "drop"
    ) -> None:
        """Fit the prompts to the policy once, before training; raise before any step runs."""
        raise NotImplementedError

    def count_skipped(self, n: int) -> None:
        """``n`` more records were skipped for an unreadable image (``bad_records_skipped``)."""
        self.bad_records_skipped += n

    def upcoming_records(self, ahead: int) -> list | None:
        """This rank's records of the loop step ``ahead`` steps after the one drawn now (async rollouts put it in
        flight early); None when unknown until Lightning fetches it."""
        return None

    def refill_records(self) -> list:
        """This rank's share of the next refill round (``rl.dynamic_sampling``): further prompts, never the loop
        steps' own; checkpointed with the datamodule's state so a resume draws the same ones."""
        raise NotImplementedError


@runtime_checkable
class PromptConsumer(Protocol):
    """What a prompt datamodule asks of the module that trains on it."""

    @property
    def prompts_per_step(self) -> int:
        """Prompts drawn per loop step, over all data-parallel ranks."""
        ...


def prompt_provider(trainer) -> PromptProvider | None:
    """The prompt side of ``trainer``'s datamodule, or None (no trainer, no datamodule, or one of the user's own,
    which is asked nothing)."""
    dm = getattr(trainer, "datamodule", None) if trainer is not None else None
    return dm if isinstance(dm, PromptProvider) else None
