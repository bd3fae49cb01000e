"""MoE routing hooks: record each token's top-k experts once, force the same choice in every later forward.

On a sparse-MoE policy a token's output depends on *which* experts its router picks, and a
top-k is discontinuous: two forwards of the same tokens that differ by kernel noise (bf16
rounding, atomics, train-mode router jitter, another engine's kernels) can pick different
experts for near-tied tokens, and a flipped expert moves that token's logprob by O(1). The
ratio ``pi / pi_old`` then carries routing churn instead of the policy's change.

Replay pins the dispatch: the ahead pass (``update/ahead.py``) records every router's top-k
indices and keeps them per row of the collected batch (``update/records.py``: a row's own tokens, no
padding), so any later chunk made of those rows gets its experts back whatever the split: the
probe's train() re-score, every training chunk of a fixed or token-budgeted plan, every inner
epoch. A chunk's padding positions route naturally (nothing reads them). The router logits are
still computed from the current weights, and the combine weights are the router probabilities
*of the replayed experts* (renormalized exactly as the router does), so the gate's gradient flows.

Stock Hugging Face blocks only (transformers 5.x): each supported block calls a ``*TopKRouter``
returning ``(router_logits, top_k_scores, top_k_indices)``; a forward hook on that router
replaces the last two. ``ReplayHooks`` verifies each router class once against this contract
(its own scores must be reproduced bit-for-bit), so a transformers change fails loudly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Router class -> whether it renormalizes its top-k probabilities (a bool, or the attribute that says).
SUPPORTED_ROUTERS: dict[str, bool | str] = {
    "Qwen3MoeTopKRouter": "norm_topk_prob",
    "Qwen2MoeTopKRouter": "norm_topk_prob",
    "OlmoeTopKRouter": "norm_topk_prob",
    "MixtralTopKRouter": True,
}
SUPPORTED_BLOCKS = (
    "Qwen3MoeSparseMoeBlock",
    "Qwen2MoeSparseMoeBlock",
    "OlmoeSparseMoeBlock",
    "MixtralSparseMoeBlock",
)


class RoutingReplayError(RuntimeError):
    """Routing replay cannot do what was asked (no MoE layer, unsupported block, record/forward mismatch)."""


@dataclass(frozen=True)
class RoutingRecord:
    """Top-k expert indices of one chunk's forward, one ``[B*T, k]`` int16 tensor per MoE layer (model order)."""

    routes: tuple[Tensor, ...]
    rows: int
    """``B*T`` of the chunk the record was made on (what every router saw)."""
    forced: Tensor | None = None
    """``[B*T]`` bool: the positions replay forces (a row's recorded tokens); None = every position."""
    n_forced: int = -1
    """How many positions are forced (``rows`` when ``forced`` is None); counted once, not per layer."""

    def __post_init__(self) -> None:
        if self.n_forced < 0:
            object.__setattr__(
                self,
                "n_forced",
                self.rows if self.forced is None else int(self.forced.sum()),
            )


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every sparse-MoE block of ``model`` (a module with an ``experts`` child), supported or not."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "experts", None), nn.Module)
    ]


def find_routers(
    model: nn.Module, knob: str = "rl.routing_replay"
) -> list[tuple[str, nn.Module]]:
    """(name, router) of every MoE layer in call order; refuses a dense model or an unsupported block."""
    blocks = moe_blocks(model)
    if not blocks:
        raise RoutingReplayError(
            f"{knob} is on but {type(model).__name__} has no MoE layers (no module with an 'experts' child): "
            f"routing replay only applies to sparse-MoE policies; set {knob}=off"
        )
    routers = []
    for name, block in blocks:
        gate = getattr(block, "gate", None)
        if (
            type(block).__name__ not in SUPPORTED_BLOCKS
            or type(gate).__name__ not in SUPPORTED_ROUTERS
        ):
            raise RoutingReplayError(
                f"{knob}: MoE block {type(block).__name__} at {name} (router {type(gate).__name__}) is not supported; "
                f"supported blocks: {', '.join(SUPPORTED_BLOCKS)}. Set {knob}=off for this model"
            )
        routers.append((f"{name}.gate", gate))
    return routers


def renormalizes(router: nn.Module) -> bool:
    rule = SUPPORTED_ROUTERS[type(router).__name__]
    return bool(getattr(router, rule)) if isinstance(rule, str) else rule


def replayed_scores(
    logits: Tensor, indices: Tensor, renorm: bool, dtype: torch.dtype
) -> Tensor:
    """The router's combine weights for *given* experts: softmax probabilities gathered at ``indices``."""
    # [N, E], as the routers compute it (fp32)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    top = probs.gather(-1, indices.long())  # [N, k]
    if renorm:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(dtype)


def verify_router(router: nn.Module) -> None:
    """Check once that ``router``'s own scores are reproduced bit-for-bit from its logits and indices."""
    w = next(router.parameters())
    x = torch.randn(7, w.shape[-1], generator=torch.Generator().manual_seed(0)).to(
        w.device, w.dtype
    )
    with torch.no_grad():
        logits, scores, idx = router(x)
        mine = replayed_scores(logits, idx, renormalizes(router), scores.dtype)
    if not torch.equal(mine, scores):
        raise RoutingReplayError(
            f"{type(router).__name__} no longer computes softmax -> top-k{' -> renormalize' * renormalizes(router)} "
            "as routing replay assumes (its scores differ from the replayed ones); this transformers version is "
            "not supported by rl.routing_replay"
        )


@dataclass
class _Active:
    """What the hooks do during one forward (or one chunk's forward + backward)."""

    record: RoutingRecord | None = None
    """Replay this record; None = record the forward instead."""
    captured: dict[int, Tensor] = field(default_factory=dict)
    aux_mask: Tensor | None = None
    """``[B*T]`` float mask of the tokens the aux loss counts; set = collect per-layer router probability sums."""
    prob_sums: dict[int, Tensor] = field(default_factory=dict)
    """Per MoE layer ``[E]`` sums of router probabilities over masked tokens (with grad)."""
    counts: dict[int, Tensor] = field(default_factory=dict)
    """Per MoE layer ``[E]`` top-k assignment counts over masked tokens (no grad)."""
    count_flips: bool = True
    """Add this scope's flips to ``moe/route_flip_frac`` (not the probe's re-score: it trains nothing)."""
    flipped: dict[int, Tensor] = field(default_factory=dict)
    """Per MoE layer, the forced positions whose natural top-k set differed: its first call in the scope only (a
    checkpointed recompute in backward re-runs the same forward and must not count twice)."""


class ReplayHooks:
    """Forward hooks on every router of a policy: record a forward's top-k choice, or force a recorded one.

    Args:
        model: the policy (hooks go on its routers only; a deepcopy of it, e.g. the KL reference,
            keeps routing naturally: the hooks check the module they fire on).

    Example::

        hooks = ReplayHooks(policy)
        with hooks.record() as rec:
            old = score(chunk)                # eval(), no_grad: the ahead pass
        with hooks.replay(rec.record):
            new = score(chunk)                # same experts, current router probabilities
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        for name, router in self.routers:
            verify_router(router)
        self.num_experts = int(self.routers[0][1].num_experts)
        self._active: _Active | None = None
        self._handles = [
            router.register_forward_hook(self._make_hook(i, router))
            for i, (_, router) in enumerate(self.routers)
        ]
        # replayed (token, layer) rows whose natural top-k set differed
        self._flipped: Tensor | None = None
        # replayed (token, layer) rows: real tokens of counted scopes; both since take_flip_counts()
        self._replayed = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- the two modes -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def record(self) -> Iterator[_Recording]:
        """Record every router's choice during the enclosed forward; ``.record`` holds it afterwards."""
        out = _Recording()
        with self._activate(_Active()) as active:
            yield out
        out.record = self._finish_record(active)

    @contextlib.contextmanager
    def replay(
        self,
        record: RoutingRecord | None,
        aux_mask: Tensor | None = None,
        count_flips: bool = True,
    ) -> Iterator[_Active]:
        """Force ``record`` in every router call inside (a checkpointed recompute in backward included).

        ``record=None`` routes naturally (still collecting aux-loss sums when ``aux_mask`` is given). With
        ``count_flips`` the scope adds each layer's flips and forced positions once to ``take_flip_counts``.
        """
        if record is not None and len(record.routes) != len(self.routers):
            raise RoutingReplayError(
                f"routing record has {len(record.routes)} MoE layers, the policy "
                f"{len(self.routers)}: it was recorded on another model"
            )
        mask = None if aux_mask is None else aux_mask.reshape(-1).float()
        with self._activate(
            _Active(record=record, aux_mask=mask, count_flips=count_flips)
        ) as active:
            yield active
        if active.flipped:  # one forward's worth per layer, however often the layer ran
            # stays on device: one sync per loop step
            flipped = torch.stack(list(active.flipped.values())).sum()
            self._flipped = (
                flipped if self._flipped is None else self._flipped + flipped
            )
            self._replayed += record.n_forced * len(active.flipped)

    @contextlib.contextmanager
    def _activate(self, active: _Active) -> Iterator[_Active]:
        if self._active is not None:
            raise RoutingReplayError(
                "routing replay: record()/replay() scopes do not nest"
            )
        self._active = active
        try:
            yield active
        finally:
            self._active = None

    def _finish_record(self, active: _Active) -> RoutingRecord:
        missing = [
            self.routers[i][0]
            for i in range(len(self.routers))
            if i not in active.captured
        ]
        if missing:
            raise RoutingReplayError(
                f"routing record: the forward never called the routers {missing}"
            )
        routes = tuple(active.captured[i] for i in range(len(self.routers)))
        return RoutingRecord(routes, int(routes[0].shape[0]))

    # -- the hook ------------------------------------------------------------------------------------------------
    def _make_hook(self, i: int, router: nn.Module):
        renorm = renormalizes(router)

        def hook(module: nn.Module, args, output):
            active = self._active
            # idle, or a copy of the policy (the reference model)
            if active is None or module is not router:
                return None
            logits, scores, indices = output
            if active.record is None:
                if active.aux_mask is None:  # recording (the ahead pass)
                    if i in active.captured:
                        raise RoutingReplayError(
                            f"routing record: router {self.routers[i][0]} ran twice in one "
                            "forward; record one forward per chunk"
                        )
                    active.captured[i] = indices.detach().to(torch.int16)
                self._collect_aux(active, i, logits, indices)
                return None
            record = active.record
            forced = self._paired(record, i, indices)
            # padding positions keep their natural experts (nothing reads them)
            if record.forced is not None:
                forced = torch.where(
                    record.forced.to(indices.device)[:, None], forced, indices
                )
            # padding never differs: it routes naturally
            if active.count_flips and i not in active.flipped:
                active.flipped[i] = (
                    (indices.detach().sort(-1).values != forced.sort(-1).values)
                    .any(-1)
                    .sum()
                )
            self._collect_aux(active, i, logits, forced)
            return logits, replayed_scores(logits, forced, renorm, scores.dtype), forced

        return hook

    def _paired(self, record: RoutingRecord, i: int, indices: Tensor) -> Tensor:
        want = record.routes[i]
        if want.shape != indices.shape:
            raise RoutingReplayError(
                f"routing replay: layer {self.routers[i][0]} sees top-k indices of shape {tuple(indices.shape)} "
                f"([B*T, k] of this chunk) but the record has {tuple(want.shape)}: the record belongs to another "
                "chunk (both walks must use the same ChunkPlan in the same order)"
            )
        return want.to(indices.device, indices.dtype)

    def _collect_aux(
        self, active: _Active, i: int, logits: Tensor, indices: Tensor
    ) -> None:
        if active.aux_mask is None:
            return
        m = active.aux_mask.to(logits.device)  # [N]
        if m.shape[0] != logits.shape[0]:
            raise RoutingReplayError(
                f"aux loss: layer {self.routers[i][0]} routed {logits.shape[0]} tokens but "
                f"the chunk's token mask has {m.shape[0]}"
            )
        probs = F.softmax(logits, dim=-1, dtype=torch.float)  # [N, E]
        active.prob_sums[i] = (probs * m[:, None]).sum(0)  # [E], with grad
        with torch.no_grad():
            active.counts[i] = assignment_counts(indices, m, self.num_experts)

    def take_flip_counts(self) -> tuple[float, float]:
        """(flipped, replayed) (token, layer) rows since the last call (one host sync per loop step)."""
        out = (
            (0.0 if self._flipped is None else float(self._flipped)),
            float(self._replayed),
        )
        self._flipped = None
        self._replayed = 0
        return out


@dataclass
class _Recording:
    record: RoutingRecord | None = None

    @property
    def value(self) -> RoutingRecord | None:
        """The record, as the ahead pass reads every recorder's capture (``update/records.py``)."""
        return self.record


def assignment_counts(indices: Tensor, mask: Tensor, num_experts: int) -> Tensor:
    """``[E]`` top-k assignments per expert over the tokens ``mask`` (``[N]``) counts."""
    weights = mask.to(torch.float64).repeat_interleave(indices.shape[-1])  # [N*k]
    return torch.zeros(
        num_experts, dtype=torch.float64, device=indices.device
    ).scatter_add_(0, indices.reshape(-1).long(), weights)


def record_counts(record: RoutingRecord, mask: Tensor, num_experts: int) -> Tensor:
    """``[E]`` assignments summed over every layer of ``record``, over the tokens ``mask`` counts."""
    m = mask.reshape(-1)
    return sum(assignment_counts(r, m.to(r.device), num_experts) for r in record.routes)
