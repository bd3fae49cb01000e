"""The fused LM head: per-token logprobs of hidden states through the head, chunked, with a fused backward.

The scored hidden states go through the LM head in chunks of tokens, inside one autograd function:

* forward: per chunk, ``logits = h @ W.T`` (float32 or wider), the target's logit minus the
  logsumexp. No ``[B, T, V]`` tensor exists at any point, for long completions too.
* backward: the softmax gradient ``(onehot - softmax) * g / T`` is formed *in place* in the
  chunk's buffer, then two matmuls give the hidden-state and head-weight gradients. Chunks
  whose ``exp(logits - max)`` was kept from forward (up to ``keep_bytes`` in all) skip the head
  matmul and the exponential; the rest recompute the logits and form the softmax from the saved
  logsumexp. So memory decides, by size, where the head is recomputed: a 64-token GRPO batch on
  a 32k vocabulary keeps everything (no recompute), 2048-token completions keep a bounded slice.
  Every vocabulary-wide step works in place on the chunk's one buffer: fresh buffers of that
  size cost page faults on every call (CPU) or allocator traffic (GPU).

Entropy of the policy at the same positions (``H = logsumexp - sum(p * logits)``) comes from the same chunk pass on
request: a dot product per row of ``exp(logits - max)`` with ``logits - max`` (cache-sized row blocks), no second head
matmul and no second chunk buffer (bench/entropy_cost.py). It carries no
gradient there; ``entropy="grad"`` (an entropy bonus) adds a checkpointed autograd pass of the head for it instead,
one chunk alive at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

CHUNK_BYTES = 64 << 20
"""Float32 logits of one head chunk (512 tokens at a 32k vocabulary): the working set of forward and backward."""
KEEP_BYTES = 256 << 20
"""Float32 logits kept from forward for backward, in all (2048 tokens at 32k). Beyond: the head is recomputed.
The module passes ``rl.logits_keep_mb``."""


def head_logprobs(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_bytes: int = CHUNK_BYTES,
    keep_bytes: int = KEEP_BYTES,
    entropy: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``log_softmax((h @ weight.T + bias) / temperature)[n, targets[n]]``: ``[N]``, chunked, fused backward.

    Under autocast the head matmuls run in the autocast dtype (as ``nn.Linear`` would), the softmax in float32.
    ``entropy`` (None, ``"value"`` or ``"grad"``): also return the softmax's entropy ``[N]``
    (see ``logprobs.token_logprobs``).
    """
    plan = _Plan.of(h, weight, chunk_bytes, keep_bytes)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (h, weight, bias)
    )
    if needs_grad:
        out = _FusedHeadLogprobs.apply(
            h, weight, bias, targets, temperature, plan, entropy == "value"
        )
        # the fused backward has no entropy term: autograd through a checkpointed head pass
        if entropy == "grad":
            return out, _entropy_with_grad(h, weight, bias, temperature, plan)
        return out
    with torch.no_grad():  # scoring only (ahead pass, reference model): nothing to keep
        w_c, b_c = _cast(weight, bias, plan)
        parts = [
            _chunk_forward(
                h[s:e], w_c, b_c, targets[s:e], temperature, plan, entropy is not None
            )
            for s, e in plan.bounds
        ]
        empty = h.new_zeros(0, dtype=plan.out_dtype)
        lp = torch.cat([p[0] for p in parts]) if parts else empty
        return (
            lp
            if entropy is None
            else (lp, torch.cat([p[4] for p in parts]) if parts else empty)
        )


class _Plan:
    """Chunk bounds, which chunks keep their logits, and the dtypes, fixed once per call."""

    def __init__(
        self,
        n: int,
        chunk: int,
        keep_chunks: int,
        compute_dtype: torch.dtype,
        device_type: str,
    ) -> None:
        self.bounds = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
        # The last chunks are kept: forward computes the recomputed ones first (one transient buffer), backward
        # walks back and frees the kept ones before it recomputes, so the peak is max(kept, one chunk), not both.
        self.first_kept = max(len(self.bounds) - keep_chunks, 0)
        # the head matmul's dtype (the autocast dtype under autocast)
        self.compute_dtype = compute_dtype
        self.out_dtype = (
            torch.float64 if compute_dtype == torch.float64 else torch.float32
        )
        self.device_type = device_type

    @classmethod
    def of(cls, h: Tensor, weight: Tensor, chunk_bytes: int, keep_bytes: int) -> _Plan:
        vocab = weight.shape[0]
        device_type = h.device.type
        compute = weight.dtype
        # what autocast would cast
        if torch.is_autocast_enabled(device_type) and weight.dtype == torch.float32:
            compute = torch.get_autocast_dtype(device_type)
        row_bytes = vocab * (8 if compute == torch.float64 else 4)
        chunk = max(1, chunk_bytes // row_bytes)
        # Whole chunks only: as many chunks are kept as fit the budget together.
        keep_chunks = keep_bytes // (chunk * row_bytes)
        return cls(h.shape[0], chunk, keep_chunks, compute, device_type)


def _cast(
    weight: Tensor, bias: Tensor | None, plan: _Plan
) -> tuple[Tensor, Tensor | None]:
    """The head's weight and bias in its compute dtype, once per pass (no copy without autocast)."""
    dt = plan.compute_dtype
    return weight.to(dt), None if bias is None else bias.to(dt)


def _chunk_logits(
    h: Tensor, w_c: Tensor, b_c: Tensor | None, temperature: float, plan: _Plan
) -> Tensor:
    """``(h @ W.T + b) / T`` as a fresh float32 (or float64) buffer; forward and backward share this exact code."""
    with torch.autocast(plan.device_type, enabled=False):
        logits = F.linear(h.to(plan.compute_dtype), w_c, b_c)  # [C, V]
    # a copy for half types: the softmax runs in float32
    logits = logits.to(plan.out_dtype)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def _chunk_forward(h, w_c, b_c, targets, temperature, plan, entropy: bool = False):
    """(logprobs [C], logsumexp [C], exp(logits - max) [C, V], its row sums [C], entropy [C] or None) of one chunk."""
    logits = _chunk_logits(h, w_c, b_c, temperature, plan)
    picked = logits.gather(1, targets[:, None])[:, 0]
    top = logits.amax(dim=-1, keepdim=True)  # [C, 1]
    shifted = logits.sub_(top)
    # before the exponential below overwrites x
    dots = _exp_dots(shifted) if entropy else None
    unnormalized = shifted.exp_()  # in place: the logits are not needed again
    total = unnormalized.sum(dim=-1)
    lse = top[:, 0] + total.log()
    # H = log Z - sum(exp(x) x) / Z
    ent = None if dots is None else total.log() - dots / total
    return picked - lse, lse, unnormalized, total, ent


def _exp_dots(x: Tensor, block_bytes: int = 1 << 20) -> Tensor:
    """``[C]`` ``sum_v exp(x) * x`` per row, in row blocks of ~1 MiB: each block's exponential stays in cache and
    no second ``[C, V]`` buffer exists. The entropy is ``log Z - this / Z`` with ``x = logits - max``: no log over
    the vocabulary. The chunk's own in-place exponential runs after, unchanged, so the logprobs keep their bits."""
    rows = max(1, block_bytes // (x.shape[1] * x.element_size()))
    out = x.new_empty(x.shape[0])
    # Outside autocast: under bf16 autocast bmm would cast both operands to bf16 (two [rows, V] copies per block and
    # a slow bf16 batched dot), which cost a third of a bf16 update and rounded the entropy to bf16.
    with torch.autocast(x.device.type, enabled=False):
        for s in range(0, x.shape[0], rows):
            xb = x[s : s + rows]
            # batched dot, no temporary
            out[s : s + rows] = torch.bmm(xb.exp()[:, None, :], xb[:, :, None])[:, 0, 0]
    return out


def _entropy_with_grad(
    h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, plan: _Plan
) -> Tensor:
    """``[N]`` entropy through autograd, per chunk under activation checkpointing: one chunk's logits alive at a time
    (forward keeps none, backward recomputes each). Costs a second head pass; only an entropy bonus asks for it."""
    # differentiable casts (no copy without autocast)
    w_c, b_c = _cast(weight, bias, plan)
    parts = [
        checkpoint(
            _chunk_entropy, h[s:e], w_c, b_c, temperature, plan, use_reentrant=False
        )
        for s, e in plan.bounds
    ]
    return torch.cat(parts) if parts else h.new_zeros(0, dtype=plan.out_dtype)


def _chunk_entropy(
    h: Tensor, w_c: Tensor, b_c: Tensor | None, temperature: float, plan: _Plan
) -> Tensor:
    logp = _chunk_logits(h, w_c, b_c, temperature, plan).log_softmax(-1)  # [C, V]
    return -(logp.exp() * logp).sum(-1)


class _FusedHeadLogprobs(torch.autograd.Function):
    """The LM head + log-softmax + gather of the scored tokens, with an in-place softmax gradient."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature, plan, entropy=False):
        out = []
        lses = []
        kept = []
        ents = []
        w_c, b_c = _cast(weight, bias, plan)
        for i, (s, e) in enumerate(plan.bounds):
            lp, lse, unnormalized, total, ent = _chunk_forward(
                h[s:e], w_c, b_c, targets[s:e], temperature, plan, entropy
            )
            out.append(lp)
            lses.append(lse)
            ents.append(ent)
            # the rest: recomputed in backward
            kept.append((unnormalized, total) if i >= plan.first_kept else None)
        ctx.save_for_backward(
            h, weight, bias, targets, torch.cat(lses) if lses else h.new_zeros(0)
        )
        ctx.temperature = temperature
        ctx.plan = plan
        ctx.kept = kept
        lp = torch.cat(out) if out else h.new_zeros(0, dtype=plan.out_dtype)
        if not entropy:
            return lp
        ent = torch.cat(ents) if ents else h.new_zeros(0, dtype=plan.out_dtype)
        # a logged figure; the bonus takes the autograd path (_entropy_with_grad)
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, *_):
        h, weight, bias, targets, lse = ctx.saved_tensors
        plan = ctx.plan
        temperature = ctx.temperature
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dt = plan.compute_dtype
        w_c, b_c = _cast(weight, bias, plan)
        grad_h = torch.empty_like(h) if need_h else None
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_w = (
            torch.zeros(weight.shape, dtype=acc, device=weight.device)
            if need_w
            else None
        )
        grad_b = (
            torch.zeros(weight.shape[0], dtype=acc, device=weight.device)
            if need_b
            else None
        )
        # kept chunks first: each is freed before any recompute
        for i in reversed(range(len(plan.bounds))):
            s, e = plan.bounds[i]
            # [C]: d logits_raw = (onehot - p) * g / T
            g = grad_out[s:e].to(plan.out_dtype) / temperature
            # softmax = exp(logits - max) / its row sum, kept from forward
            if ctx.kept[i] is not None:
                d, total = ctx.kept[i]
                # consumed in place below; a second backward (retain_graph) recomputes it
                ctx.kept[i] = None
                d.mul_((-g / total)[:, None])  # -p * g
            else:
                d = _chunk_logits(h[s:e], w_c, b_c, temperature, plan)
                # -p * g, from the saved logsumexp
                d.sub_(lse[s:e, None]).exp_().mul_(-g[:, None])
            d.scatter_add_(1, targets[s:e, None], g[:, None])  # + onehot * g
            _backward_matmuls(
                d, h[s:e], w_c, grad_h[s:e] if grad_h is not None else None, grad_w, dt
            )
            if grad_b is not None:
                grad_b += d.sum(0).to(acc)
            del d  # before the next chunk allocates its own
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def _backward_matmuls(
    d: Tensor,
    h: Tensor,
    w_c: Tensor,
    grad_h: Tensor | None,
    grad_w: Tensor | None,
    dt: torch.dtype,
) -> None:
    """``grad_h = d @ W`` ([C, H]) and ``grad_w += d.T @ h`` ([V, H]), into their buffers when the dtypes allow."""
    d_c = d.to(dt)  # the head's compute dtype (bf16 under autocast); a no-op otherwise
    if grad_h is not None:
        if grad_h.dtype == dt:
            torch.mm(d_c, w_c, out=grad_h)
        else:
            grad_h.copy_(d_c @ w_c)
    if grad_w is not None:
        if grad_w.dtype == dt:
            # accumulated in place: no [V, H] temporary per chunk
            grad_w.addmm_(d_c.T, h.to(dt))
        else:
            # bf16 products, float32 accumulation
            grad_w += (d_c.T @ h.to(dt)).to(grad_w.dtype)
