"""Frozen pi_old across the window: the ahead pass, its per-row records, and the one-shot determinism probe.

At ``n_mini > 1`` one collected batch drives several optimizer steps. If pi_old were the
current logprobs detached, it would follow the drifting policy: the ratio returns to 1 on
every mini-batch, the clip never binds and the batch takes ``n_mini`` unconstrained steps
(a real run collapsed to reward 0 this way). So before training, the ahead pass walks the
same ``ChunkPlan`` with the model in ``eval()`` and ``no_grad()`` and records pi_old per row
(``records.py``); training chunk ``k`` then scores against its rows' records laid out as it is cut.

Cheaper than one full extra forward: mini-batch 0 trains before any update, so its pi_old
*is* its current logprobs detached. Once the probe has shown that train-mode and eval-mode
forwards agree, the walk skips mini-batch 0 (entries ``None``), saving ``1 / n_mini`` of
the pass. Not at ``mu_iterations > 1``: later epochs train mini-batch 0 again after updates, so
every chunk is recorded once and each epoch replays the same records (pi_old stays the rollout
policy's; it is never recomputed per epoch). With ``rl.max_tokens_per_ahead_micro`` the pass
walks bigger chunks of its own and lays its per-row records out as the training chunks.

The probe is a one-shot screen, not a monitor: on the first ahead chunk of a run it
re-scores that chunk in ``train()`` mode at unchanged weights and compares with the
``eval()`` record, with every ``ChunkHook`` replaying what it captured on that chunk. A stochastic
layer that fires there (dropout left on, a discontinuous choice that churns between forwards)
fails the run with an explicit error instead of silently biasing every ratio.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_grpo.batch import RolloutBatch
from lightning_grpo.distributed import single_process
from lightning_grpo.update.plan import (
    EMPTY,
    ChunkPlan,
    Needs,
    Rows,
    pi_old_source,
    sequence_lengths,
    take,
)
from lightning_grpo.update.records import ChunkHook, Recorder, RowRecords

log = logging.getLogger(__name__)

# chunk -> [B, T-1] logprobs of the policy (the same scorer training uses, minus autograd).
Score = Callable[[RolloutBatch], Tensor]
# Sums a 0-d tensor over data-parallel ranks (identity on one device): the probe gates mesh-wide.
DPSum = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class ForwardNoisePolicy:
    """How much train()-vs-eval() forward noise a policy model tolerates at unchanged weights.

    A model declares one as the attribute ``forward_noise_policy``; a model that declares none
    gets the strict gate (0.05 nats on any token fails).

    Example::

        model.forward_noise_policy = ForwardNoisePolicy(bound_nats=0.1, max_fraction=0.01)
    """

    bound_nats: float = 0.05
    """Per-token bound: a token fails when its logprob moved by more than this many nats."""
    max_fraction: float = 0.0
    """Allowed fraction of counted tokens past the bound; 0 = any failing token fails the probe."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bound_nats) and self.bound_nats > 0):
            raise ValueError(
                f"ForwardNoisePolicy(bound_nats={self.bound_nats}): must be a finite number > 0"
            )
        if not 0 <= self.max_fraction < 1:
            raise ValueError(
                f"ForwardNoisePolicy(max_fraction={self.max_fraction}): must be in [0, 1)"
            )


STRICT = ForwardNoisePolicy()


def noise_policy_of(model: nn.Module) -> ForwardNoisePolicy:
    """The tolerance ``model`` declares, or the strict gate."""
    declared = getattr(model, "forward_noise_policy", None)
    return declared if isinstance(declared, ForwardNoisePolicy) else STRICT


class NondeterministicForwardError(RuntimeError):
    """train()-mode and eval()-mode forwards disagree, so an eval-mode pi_old would bias every ratio."""


class PairingError(RuntimeError):
    """A recorded pi_old does not fit the chunk training paired it with (the two walks diverged)."""


def paired(
    pi_old: Sequence[Tensor | None] | None, k: int, chunk: RolloutBatch
) -> Tensor | None:
    """Record ``k`` of the ahead walk, checked against chunk ``k`` of the training walk."""
    if pi_old is None:
        return None
    old = pi_old[k]
    want = (len(chunk), chunk.input_ids.shape[1] - 1)  # [B, T-1], T trimmed per chunk
    if old is not None and tuple(old.shape) != want:
        raise PairingError(
            f"chunk {k} of the training walk has logprob shape {want} but the ahead pass recorded "
            f"{tuple(old.shape)}: both walks must use the same ChunkPlan in the same order"
        )
    return old


@dataclass(frozen=True)
class ProbeResult:
    """What the one-shot probe measured on the first ahead chunk."""

    fraction: float
    """Mesh-wide fraction of counted tokens whose logprob moved past the bound."""
    max_diff: float
    """Largest |train - eval| logprob on this rank's counted tokens (nats)."""
    policy: ForwardNoisePolicy

    @property
    def passed(self) -> bool:
        return self.fraction <= self.policy.max_fraction


class AheadPass:
    """Records frozen pi_old (and every hook's and ``Recorder``'s per-token record) before training; runs the probe.

    Args:
        model: the policy (its modes are toggled, its ``forward_noise_policy`` read).
        score: ``chunk -> [B, T-1]`` policy logprobs, the very scorer training uses.
        dp_sum: sum over data-parallel ranks, so every rank takes the same probe decision.
        skip_first_mini: leave mini-batch 0 out of the walk once the probe passed (``False``
            keeps the reference design's full walk; the bench compares both).
        hooks: per-chunk hooks (``records.ChunkHook``): recorded first, on every chunk scored, and each one's capture
            of the probe's chunk replayed in the probe's train() re-score.
        recorders: more per-token records to take on every chunk scored (``records.Recorder``; docs/update.md).

    Example::

        ahead = AheadPass(policy, lambda c: token_logprobs(policy, c.input_ids, positions=c.completion_mask[:, 1:]))
        loop.run(batch, plan, ahead.compute(batch, plan, Needs(pi_old=True)))
    """

    def __init__(
        self,
        model: nn.Module,
        score: Score,
        dp_sum: DPSum = single_process,
        skip_first_mini: bool = True,
        hooks: Sequence[ChunkHook] = (),
        recorders: Sequence[Recorder] = (),
    ) -> None:
        self.model = model
        self.score = score
        self.dp_sum = dp_sum
        self.skip_first_mini = skip_first_mini
        self.hooks: list[ChunkHook] = list(hooks)
        # the hooks first: their captures lead
        self.recorders: list[Recorder] = [*self.hooks, *recorders]
        # set once per run; resumes from state_dict
        self._probe: ProbeResult | None = None
        self.records: dict[str, RowRecords] = {}
        """The latest pass's per-row records: ``pi_old`` and one per hook or recorder, under its ``name``."""

    @property
    def probe_passed(self) -> bool:
        return self._probe is not None and self._probe.passed

    def skips_first_mini(self, needs: Needs, mu_iterations: int = 1) -> bool:
        """Whether mini-batch 0 goes unrecorded (``Needs.skips_first_mini``, once the probe has passed)."""
        return self.skip_first_mini and needs.skips_first_mini(
            self.probe_passed, mu_iterations
        )

    def compute(
        self,
        batch: RolloutBatch,
        plan: ChunkPlan,
        needs: Needs,
        ahead: ChunkPlan | None = None,
    ) -> list[Tensor | None]:
        """pi_old of every chunk of ``plan`` in training-walk order, every epoch; ``None`` = current logprobs
        detached (mini-batch 0 of a single epoch, see ``skips_first_mini``).

        ``ahead``: the pass's own plan over the rows it scores (``rl.max_tokens_per_ahead_micro``; a no-grad forward
        can take bigger chunks). Without it the pass walks ``plan``'s chunks themselves. Either way each chunk is
        scored once, its records are kept per row (``records.py``), and each training chunk lays its own out.
        """
        self.records = {
            "pi_old": RowRecords(0),
            **{r.name: RowRecords(r.token_dim) for r in self.recorders},
        }
        lengths = sequence_lengths(batch)[0]
        with eval_mode(self.model), torch.no_grad():
            # asked per chunk: once the probe passes, the rest of mini-batch 0 is skipped
            if ahead is None:
                for mini, micro in plan.walk():
                    if not (
                        mini == 0 and self.skips_first_mini(needs, plan.mu_iterations)
                    ):
                        self._score(batch, plan.rows[mini][micro], lengths)
            else:  # empty chunks run too: every rank takes the same number of forwards
                for _, micro in ahead.walk():
                    self._score(batch, ahead.rows[0][micro], lengths)
        # also when the probe passed during this pass
        if self.skips_first_mini(needs, plan.mu_iterations):
            # mini-batch 0 trains at pi_old itself: its hooks see no record
            for record in self.records.values():
                record.drop(r for rows in plan.rows[0] for r in rows)
        # each chunk laid out once: every epoch reuses its record
        laid: dict[tuple[int, int], Tensor | None] = {}
        for mini, micro in plan.walk():
            laid[mini, micro] = self._pi_old(plan.rows[mini][micro], lengths)
        return [laid[mini, micro] for _, mini, micro in plan.training_walk()]

    def _score(self, batch: RolloutBatch, rows: Rows, lengths: list[int]) -> None:
        """Score the chunk of ``rows`` once; keep its pi_old and every recorder's record per row."""
        chunk = take(batch, rows)
        with contextlib.ExitStack() as stack:
            captures = [stack.enter_context(r.capture()) for r in self.recorders]
            logprobs = self.score(chunk)  # [B, T-1]
        # the probe's train() re-score replays what each hook captured on this chunk
        if self._probe is None:
            self._run_probe(
                chunk, logprobs, [cap.value for cap in captures[: len(self.hooks)]]
            )
        self.records["pi_old"].put(rows, logprobs)
        for recorder, cap in zip(self.recorders, captures):
            self.records[recorder.name].put(
                rows, recorder.split(cap.value, rows, lengths)
            )

    def _pi_old(self, rows: Rows, lengths: list[int]) -> Tensor | None:
        """The pi_old record of a training chunk of ``rows``: its ``[B, T-1]``, or None (unrecorded rows)."""
        record = self.records["pi_old"]
        if rows == EMPTY:  # a DP filler: [1, 1], nothing counted
            return next(iter(record.by_row.values())).new_zeros(1, 1)
        if not record.covers(rows):
            return None  # mini-batch 0, skipped
        # the training chunk's [B, T-1]
        return record.layout(rows, max(max(lengths[r] for r in rows), 2) - 1)

    # -- the probe ---------------------------------------------------------------------------------------------
    def _run_probe(
        self, chunk: RolloutBatch, eval_logprobs: Tensor, captured: Sequence = ()
    ) -> None:
        """Re-score ``chunk`` in train() mode at unchanged weights; raise if it moved past the declared bound.
        ``captured``: each hook's capture of ``chunk``'s eval() forward, in hook order."""
        policy = noise_policy_of(self.model)
        # Still under no_grad: what differs between the two forwards is the mode (dropout, a hook's choice), and a
        # forward with grad but no backward would leave an autograd graph (and FSDP2/DDP hooks) waiting for nothing.
        # Each hook replays its capture in the re-score, exactly as training will replay its records.
        with contextlib.ExitStack() as stack:
            stack.enter_context(train_mode(self.model))
            for hook, value in zip(self.hooks, captured):
                stack.enter_context(hook.replay(value))
            train_logprobs = self.score(chunk)
        mask = chunk.completion_mask[:, 1:].to(eval_logprobs.device)  # [B, T-1]
        diff = (train_logprobs - eval_logprobs).abs().masked_fill(~mask, 0.0)
        past = ~(diff <= policy.bound_nats) & mask  # a NaN counts as moved
        moved = self.dp_sum(past.sum().double())
        counted = self.dp_sum(mask.sum().double())
        fraction = float(moved / counted.clamp(min=1))  # one host sync, once per run
        result = ProbeResult(
            fraction, float(diff.max()) if diff.numel() else 0.0, policy
        )
        if not result.passed:
            raise NondeterministicForwardError(_probe_message(result))
        log.info(
            "pi_old determinism probe passed: %.4g of tokens past %.3g nats (max |diff| %.3g nats)",
            result.fraction,
            policy.bound_nats,
            result.max_diff,
        )
        self._probe = result

    # -- resume ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The probe runs once per run; a resumed run must not run it again."""
        p = self._probe
        return {
            "probe": None
            if p is None
            else {
                "fraction": p.fraction,
                "max_diff": p.max_diff,
                "bound_nats": p.policy.bound_nats,
                "max_fraction": p.policy.max_fraction,
            }
        }

    def load_state_dict(self, state: dict) -> None:
        p = state.get("probe")
        self._probe = (
            None
            if p is None
            else ProbeResult(
                p["fraction"],
                p["max_diff"],
                ForwardNoisePolicy(p["bound_nats"], p["max_fraction"]),
            )
        )


def _probe_message(r: ProbeResult) -> str:
    allowed = (
        "any token"
        if r.policy.max_fraction == 0
        else f"more than {r.policy.max_fraction:.4g} of tokens"
    )
    return (
        f"pi_old determinism probe failed: {r.fraction:.4g} of completion tokens moved by more than "
        f"{r.policy.bound_nats:.3g} nats (max {r.max_diff:.3g} nats) between the eval() record and a train() "
        f"re-score at unchanged weights; the gate fails on {allowed}. The ahead pass records pi_old in eval() mode, "
        "so every ratio would carry this noise. Likely causes: dropout left on (attention_dropout, hidden_dropout, "
        "resid_pdrop in the model config), another stochastic layer, or MoE routing churn between two identical "
        "forwards. Fix: set the model's dropout probabilities to 0 for RL, pin MoE routing (routing replay); or, "
        "if the noise is expected and small, declare it on the model "
        "(model.forward_noise_policy = ForwardNoisePolicy(bound_nats=..., max_fraction=...))."
    )


class _ModeSwitch:
    """Set every submodule to one mode, then restore each one's own mode (a frozen tower may sit in eval)."""

    def __init__(self, model: nn.Module, training: bool) -> None:
        self.model = model
        self.training = training
        self._saved: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> None:
        self._saved = [(m, m.training) for m in self.model.modules()]
        self.model.train(self.training)

    def __exit__(self, *exc) -> None:
        for m, mode in self._saved:
            m.training = mode


def eval_mode(model: nn.Module) -> _ModeSwitch:
    """Context: every submodule in eval() (no dropout); each one's own mode comes back after."""
    return _ModeSwitch(model, training=False)


def train_mode(model: nn.Module) -> _ModeSwitch:
    """Context: every submodule in train(); each one's own mode comes back after."""
    return _ModeSwitch(model, training=True)


def warn_if_unfrozen(rl) -> None:
    """The diagnostic switch is off-label: say so once, when the module is built."""
    # several steps, pi_old not frozen
    if rl.steps_per_loop_step > 1 and pi_old_source(rl) == "current":
        log.warning(
            "rl.freeze_pi_old=false at n_mini=%d, mu_iterations=%d: pi_old follows the drifting policy, the "
            "ratio returns to 1 on every mini-batch and the clip never binds. Diagnostic only; keep it true to "
            "train.",
            rl.n_mini,
            rl.mu_iterations,
        )
