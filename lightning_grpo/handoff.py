"""The colocated hand-off: one phase machine that passes the device between the rollout engine and the trainer.

Every loop step runs the same cycle (the event log records it, names as in ``handoff_events.py``)::

    generate -> engine.sleep -> trainer.onload -> train
             -> engine.wake_up(weights) -> weight_sync -> trainer.offload -> engine.wake_up(kv_cache)
             -> next generate

The second line (publication) runs lazily, at the start of the next loop step, so a
checkpoint taken at the batch boundary always sees the trainer resident and the engine
asleep. A run, fresh or resumed, starts at that boundary: the engine is put to sleep
(on resume before the optimizer state is restored) and the first hand-off publishes the
trainer's policy before any sampling. See docs/handoff.md.

The callback talks to the module through ``WeightPublisher`` (publisher.py) only: the module hands
it the engine and the policy once (``on_engine_ready``) and tells it about the two in-step boundaries.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from typing_extensions import override

from lightning_grpo.handoff_events import (
    ENGINE_SLEEP,
    GENERATE,
    TRAIN,
    TRAINER_OFFLOAD,
    TRAINER_ONLOAD,
    WAKE_KV_CACHE,
    WAKE_WEIGHTS,
    WEIGHT_SYNC,
    Phase,
)
from lightning_grpo.offload import OffloadBackend, TrainerOffload, trainer_offload
from lightning_grpo.publisher import generates_with
from lightning_grpo.rollout.base import DrawsAhead, RolloutEngine
from lightning_grpo.rollout.full_sync import publish_checked
from lightning_grpo.rollout.sleep import sleep_level_problem
from lightning_grpo.rollout.weight_sync import SyncStats
from lightning_grpo.run_check import check_async_handoff
from lightning_grpo.timing import SYNC, ProfileRecords, StepTimer, profiling_requested

log = logging.getLogger(__name__)

NO_SYNC = SyncStats(n_buckets=0, n_tensors=0, bytes=0, seconds=0.0)


class HandoffCallback(Callback):
    """Hands the device between rollout engine and trainer once per collected batch, and publishes weights.

    Implements ``WeightPublisher``: ``GRPOModule`` hands it the engine and policy once per fit
    (``on_engine_ready``, which also puts the engine to sleep), calls ``on_rollout_end`` after
    generation and ``on_update_end`` after the update; Lightning calls the rest. A module whose
    engine holds its own weights attaches one itself (``colocated_offload=False``) when none is given.

    Args:
        placement: ``colocated``: engine and trainer share the device, so they take turns;
            ``disaggregated``: disjoint devices, nothing sleeps or moves (weights still sync).
        colocated_offload: with ``colocated``: False keeps both resident for the whole step
            (shorter step, both footprints at once) and builds a vLLM engine without sleep mode.
        sleep_level: 1: the engine backs its weights up to host while asleep; 2: it discards
            them, and the full sync before the next draw must rewrite every tensor the engine
            holds (checked against the engine's ``weight_names()``: a partial sync raises).
        offload_backend: ``auto``: torch_memory_saver if usable, else host copies, nothing on
            CPU; ``host``: host copies even on CPU (tests); ``torch_memory_saver``: required.
        sync_bucket_mb: weight-sync bucket size; None = the module's ``rollout.sync_bucket_mb``.
        profile: write ``profile.jsonl`` records under ``trainer.log_dir``; None = the
            ``LIGHTNING_GRPO_PROFILE_LOOP`` environment variable.

    Raises:
        ValueError: a knob out of range (all problems listed at once).

    Example::

        trainer = Trainer(max_steps=100, callbacks=[HandoffCallback(sleep_level=2)])
        trainer.fit(GRPOModule(rollout=RolloutConfig(engine="vllm")), datamodule=PromptDataModule())
        trainer.callbacks[0].events[:5]  # ['engine.sleep', 'engine.wake_up(weights)', 'weight_sync', ...]
    """

    def __init__(
        self,
        placement: Literal["colocated", "disaggregated"] = "colocated",
        colocated_offload: bool = True,
        sleep_level: Literal[1, 2] = 1,
        offload_backend: OffloadBackend = "auto",
        sync_bucket_mb: float | None = None,
        profile: bool | None = None,
    ) -> None:
        problems = []
        if placement not in ("colocated", "disaggregated"):
            problems.append(
                f"placement={placement!r}: must be 'colocated' or 'disaggregated'"
            )
        if problem := sleep_level_problem(sleep_level, "sleep_level"):
            problems.append(problem)
        if offload_backend not in ("auto", "torch_memory_saver", "host"):
            problems.append(
                f"offload_backend={offload_backend!r}: must be 'auto', 'torch_memory_saver' or 'host'"
            )
        if sync_bucket_mb is not None and not sync_bucket_mb > 0:
            problems.append(
                f"sync_bucket_mb={sync_bucket_mb!r}: must be > 0 (or None: the module's rollout config)"
            )
        if problems:
            raise ValueError("HandoffCallback(" + "; ".join(problems) + ")")
        self.placement = placement
        self.sleep_level = sleep_level
        self.offload_backend = offload_backend
        self.handoff = placement == "colocated" and colocated_offload
        """Whether engine sleep/wake and trainer offload/onload happen at all."""
        self._sync_bucket_mb = sync_bucket_mb
        self._profile_flag = profile
        self._phase = Phase.IDLE
        self._events: list[str] = []
        self._stale = True  # the engine does not hold the trainer's current policy
        # a level-2 sleep dropped the engine's weights since the last full sync
        self._discarded = False
        self._engine: RolloutEngine | None = None
        self._policy: nn.Module | None = None
        self._bucket_bytes = 0
        self._loop_step = 0  # of the last update, for the profile record
        # chosen at first use: the optimizers exist by then
        self._offload: TrainerOffload | None = None
        # the module's, from on_engine_ready: each action is a phase of the loop step
        self._timer = StepTimer()
        self._state_dict_hook: Any = None
        self._failure: BaseException | None = None
        self.last_sync: SyncStats | None = None
        """What the last weight sync moved (``NO_SYNC`` when the engine is the policy)."""
        # this loop step's sync, for the profile record
        self._step_sync: SyncStats | None = None
        self._step_bytes = {"offloaded": 0, "onloaded": 0}

    # -- read-only views -------------------------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def events(self) -> list[str]:
        """Every transition so far, in order (names from ``CYCLE``)."""
        return list(self._events)

    @property
    def engine_is_policy(self) -> bool:
        """The engine generates with the trained module itself (``HFEngine``): a weight sync has nothing to move."""
        return self._engine is not None and generates_with(self._engine, self._policy)

    # -- the module's side (WeightPublisher) -------------------------------------------------------------------------
    @property
    def sleeps_engine(self) -> bool:
        """Whether the engine sleeps between generations (else the module builds a vLLM engine without sleep mode)."""
        return self.handoff

    def on_engine_ready(
        self,
        trainer: Trainer,
        engine: RolloutEngine,
        policy: nn.Module,
        sync_bucket_mb: float,
        timer: StepTimer | None = None,
    ) -> None:
        """The module built its engine (``on_fit_start``, before Lightning restores optimizer state onto the device):
        enter the batch boundary, so the engine sleeps first and the first hand-off publishes the (restored) policy.
        ``timer``: the module's step timer (the publication is its phase ``sync``)."""
        # GRPOModule refuses it at setup; an engine built by hand comes here
        if isinstance(engine, DrawsAhead):
            check_async_handoff(engine.max_off_policy_steps, self.handoff)
        self._engine = engine
        self._policy = policy
        if timer is not None:
            self._timer = timer
        self._bucket_bytes = int((self._sync_bucket_mb or sync_bucket_mb) * (1 << 20))
        self._start(trainer)

    def on_rollout_end(self, trainer: Trainer) -> None:
        """Generation done: the engine releases the device, the trainer takes it."""
        self._require(Phase.GENERATE, hook="on_rollout_end")
        self._sleep_engine()
        self._onload_trainer()
        self._events.append(TRAIN)
        self._phase = Phase.TRAIN

    def on_update_end(self, trainer: Trainer, loop_step: int) -> None:
        """The policy changed: the engine is stale until the next publication (lazy, before the next draw)."""
        self._require(Phase.TRAIN, hook="on_update_end")
        self._phase = Phase.BOUNDARY
        self._stale = True
        self._loop_step = loop_step

    # -- Lightning hooks -------------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._phase is Phase.IDLE:
            raise RuntimeError(
                f"HandoffCallback was given no engine: {type(pl_module).__name__} never called on_engine_ready. It "
                "works with GRPOModule (or a module that calls the WeightPublisher hooks, see publisher.py)"
            )

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._require(Phase.BOUNDARY, Phase.GENERATE, hook="on_train_batch_start")
        self._publish(trainer)
        self._events.append(GENERATE)

    @override
    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._write_profile(trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._phase is Phase.BOUNDARY:
            # validation samples from the engine: it must hold the current policy
            self._publish(trainer)

    @override
    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._failure = exception
        self._cleanup(exception)

    @override
    def teardown(
        self, trainer: Trainer, pl_module: LightningModule, stage: str
    ) -> None:
        if self._phase in (Phase.PUBLISH, Phase.GENERATE, Phase.TRAIN):
            # a model handed back after fit is resident; the engine stays asleep
            self._cleanup(self._failure)
        if self._state_dict_hook is not None:
            self._state_dict_hook.remove()
            self._state_dict_hook = None
        self._phase = Phase.IDLE
        self._failure = None
        self._timer.records = None  # the next fit decides again

    # -- the phase machine -----------------------------------------------------------------------------------------
    def _start(self, trainer: Trainer) -> None:
        """Enter the batch boundary once per fit: engine asleep, trainer resident, publication pending."""
        if self._phase is not Phase.IDLE:
            return
        self._timer.records = self._profile_records(trainer)
        # Lightning reads the module's state_dict first thing in a save, before any callback hook runs: this pre-hook
        # is the checkpoint window (engine asleep, trainer resident) whatever point of the step the save comes from.
        trained = trainer.lightning_module
        self._state_dict_hook = trained.register_state_dict_pre_hook(
            self._checkpoint_window
        )
        self._events = []
        self._offload = None
        self._stale = True
        self._discarded = False
        self._sleep_engine()  # the first profile record holds it
        self._phase = Phase.BOUNDARY

    def _publish(self, trainer: Trainer) -> None:
        """Boundary -> generate: wake weights, sync if stale, offload the trainer, wake the KV cache."""
        if self._phase is not Phase.BOUNDARY:
            return
        self._phase = Phase.PUBLISH
        with self._timer.phase(SYNC):
            if self.handoff:
                with self._event(WAKE_WEIGHTS):
                    self._engine.wake_up(["weights"])
            if self._stale or self._discarded:
                with self._event(WEIGHT_SYNC):
                    self._step_sync = self._sync()
                    self.last_sync = self._step_sync
                self._stale = False
                self._discarded = False
            if self.handoff:
                with self._event(TRAINER_OFFLOAD):
                    self._step_bytes["offloaded"] += self._trainer_offload(
                        trainer
                    ).offload()
                with self._event(WAKE_KV_CACHE):
                    self._engine.wake_up(["kv_cache"])
        self._phase = Phase.GENERATE

    def _sync(self) -> SyncStats:
        """Push every parameter and persistent buffer to the engine, once per collected batch."""
        if self.engine_is_policy:
            # HFEngine generates with this very module: its weights are already the policy's
            return NO_SYNC
        return publish_checked(
            self._policy, self._engine, self._bucket_bytes, self._discarded
        )

    def _sleep_engine(self) -> None:
        if self.handoff:
            with self._event(ENGINE_SLEEP):
                self._engine.sleep(self.sleep_level)
            self._discarded = self._discarded or self.sleep_level == 2

    def _onload_trainer(self) -> None:
        if self.handoff:
            with self._event(TRAINER_ONLOAD):
                if self._offload is not None:  # None: never offloaded yet, so resident
                    self._step_bytes["onloaded"] += self._offload.onload()

    def _checkpoint_window(self, *hook_args: Any) -> None:
        """A save is reading the module: make sure the trainer is resident and the engine asleep (a state_dict
        pre-hook: ``hook_args`` are the module, prefix and keep_vars, unread)."""
        # a validation or emergency save after publication
        if self._phase in (Phase.GENERATE, Phase.PUBLISH):
            self._sleep_engine()
            self._onload_trainer()
            # level 1: weights come back on wake; level 2: _discarded forces a sync
            self._phase = Phase.BOUNDARY

    def _cleanup(self, exception: BaseException | None) -> None:
        """Engine asleep, trainer resident. While ``exception`` is in flight, a cleanup failure never replaces it."""
        try:
            if self._engine is not None:
                # idempotent; re-releases weights after a weights-only wake
                self._sleep_engine()
                self._onload_trainer()
            self._phase = Phase.BOUNDARY
        except Exception as err:
            # state unknown: the machine stops managing anything
            self._phase = Phase.IDLE
            if exception is None:
                raise
            log.error("hand-off cleanup failed while handling %r: %r", exception, err)
            if hasattr(exception, "add_note"):  # Python >= 3.11
                exception.add_note(f"(the hand-off cleanup also failed: {err!r})")

    @contextlib.contextmanager
    def _event(self, name: str) -> Iterator[None]:
        """One action of the cycle: logged in ``events``, timed as a phase (profile records hold it)."""
        self._events.append(name)
        with self._timer.phase(name):
            yield

    def _require(self, *phases: Phase, hook: str) -> None:
        if self._phase not in phases:
            raise RuntimeError(
                f"HandoffCallback.{hook} in phase {self._phase.value!r}, expected {[p.value for p in phases]}: "
                "the hand-off hooks ran out of order (is the callback attached to the trainer that runs the module?)"
            )

    # -- setup helpers ---------------------------------------------------------------------------------------------
    def _trainer_offload(self, trainer: Trainer) -> TrainerOffload:
        if self._offload is None:
            backend = self.offload_backend
            self._offload = trainer_offload(
                backend, trainer, self._policy, self.engine_is_policy
            )
        return self._offload

    def _profile_records(self, trainer: Trainer) -> ProfileRecords | None:
        wanted = (
            profiling_requested() if self._profile_flag is None else self._profile_flag
        )
        if not trainer.strategy.broadcast(wanted):
            return None
        rank = trainer.global_rank
        name = "profile.jsonl" if rank == 0 else f"profile.rank{rank}.jsonl"
        folder = trainer.log_dir or trainer.default_root_dir
        return ProfileRecords(f"{folder}/{name}", trainer.lightning_module.device)

    def _write_profile(self, trainer: Trainer) -> None:
        """This loop step's profile record (when profiling): its phases and what the hand-off moved."""
        sync = self._step_sync
        moved = self._step_bytes
        self._step_sync = None
        self._step_bytes = {"offloaded": 0, "onloaded": 0}
        records = self._timer.records
        if records is None:
            return
        backend = self._offload.kind if self._offload else None
        records.write(
            loop_step=self._loop_step,
            global_step=trainer.global_step,
            placement=self.placement,
            handoff=self.handoff,
            sleep_level=self.sleep_level,
            offload_backend=backend,
            engine_is_policy=self.engine_is_policy,
            sync=None if sync is None else asdict(sync),
            offload_bytes=moved,
        )
