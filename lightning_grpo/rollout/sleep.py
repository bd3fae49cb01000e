"""Sleep/wake bookkeeping shared by the engines: which memory is asleep, and idempotent transitions.

The colocated hand-off puts the engine to sleep after generation, wakes its weights for the
weight sync, then wakes its KV cache before the next draw. ``SleepState`` records that
order whether or not the backend really frees memory (vLLM on CPU and the transformers
engine cannot), so the same calls are legal, idempotent and checkable on every engine.
"""

from __future__ import annotations

from collections.abc import Sequence

TAGS = ("weights", "kv_cache")
"""What can sleep, in vLLM's vocabulary (``LLM.wake_up(tags)``)."""


def sleep_level_problem(level: object, name: str = "level") -> str | None:
    """The one rule for sleep levels, as a ``name=value: rule`` line (None when ``level`` is valid)."""
    if level in (1, 2) and not isinstance(level, bool):
        return None
    return (
        f"{name}={level!r}: must be 1 (weights kept on host) or 2 (weights discarded)"
    )


class SleepState:
    """Which tags are asleep. ``sleep``/``wake_up`` return what actually changed (empty = no-op)."""

    def __init__(self) -> None:
        self._asleep: set[str] = set()
        self.level: int | None = None
        """Level of the current sleep; None while fully awake."""

    @property
    def asleep(self) -> frozenset[str]:
        return frozenset(self._asleep)

    @property
    def awake(self) -> bool:
        return not self._asleep

    def sleep(self, level: int) -> bool:
        """Mark everything asleep. False when it already was (a repeated call is a no-op)."""
        if problem := sleep_level_problem(level):
            raise ValueError(f"sleep({problem})")
        if self._asleep == set(TAGS):
            return False
        self._asleep = set(TAGS)
        self.level = level
        return True

    def wake_up(self, tags: Sequence[str] | None) -> list[str]:
        """Mark ``tags`` (None = all) awake; return those that were asleep, in ``TAGS`` order."""
        wanted = set(TAGS if tags is None else tags)
        unknown = wanted - set(TAGS)
        if unknown:
            raise ValueError(
                f"wake_up(tags={list(tags or [])}): unknown tags {sorted(unknown)}; use a subset of {TAGS}"
            )
        woken = [t for t in TAGS if t in wanted & self._asleep]
        self._asleep -= wanted
        if not self._asleep:
            self.level = None
        return woken

    def require(self, *tags: str, call: str) -> None:
        """Raise if any of ``tags`` is asleep: ``call`` would touch freed memory."""
        missing = [t for t in tags if t in self._asleep]
        if missing:
            raise RuntimeError(
                f"{call} while {missing} asleep: call wake_up({missing}) first"
            )


class BookkeptSleep:
    """``sleep`` / ``wake_up`` / ``asleep`` of an engine whose memory is not this process's to free (the HF engine's
    is the trainer's, a server's is another process's): the tags are recorded, so a hand-off reads the same state."""

    _sleep: SleepState

    def sleep(self, level: int = 1) -> None:
        self._sleep.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._sleep.wake_up(tags)

    @property
    def asleep(self) -> frozenset[str]:
        """Tags marked asleep (bookkeeping only)."""
        return self._sleep.asleep
