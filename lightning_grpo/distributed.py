"""Data parallel on Lightning's strategies: FSDP2 sharding and gradient-sync control.

Two engines, both Lightning's own (no home-made distribution):

* ``strategy="ddp"``: Lightning wraps the LightningModule in ``DistributedDataParallel``;
  ``no_sync()`` on that wrapper skips the all-reduce of non-final micro-steps (Lightning's
  ``DDPStrategy.pre_backward`` prepares the reducer only when sync is on, so this works under
  manual optimization).
* ``ModelParallelStrategy(data_parallel_size=W, tensor_parallel_size=1)``: FSDP2. The module
  shards its policy in ``configure_model`` with :func:`shard_fsdp2` (``fully_shard`` per decoder
  layer, then the root); ``set_requires_gradient_sync(False)`` skips the reduce-scatter of
  non-final micro-steps (gradients accumulate unsharded until the last one).

Either way the strategy *averages* gradients over ranks, and the objective's divisor is the DP
mean of masked token counts, so the step equals the single-process step on the whole batch
(see docs/distributed.md for the argument).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_grpo.vision import vision_tower


def single_process(t: Tensor) -> Tensor:
    """A reduction over data-parallel ranks when there is one process: the tensor itself."""
    return t


@dataclass(frozen=True)
class DataParallelGroup:
    """This rank's place among the data-parallel ranks and their reductions, fixed once the strategy is known.

    A module builds it when a Trainer has set up its strategy (``DataParallelOps.dp_group``), never earlier: a part
    built before ``fit`` (``configure_model`` called by the user) would otherwise keep the one-process answers for
    good, and ranks that plan different chunk counts then hang in their collectives.
    """

    size: int = 1
    rank: int = 0
    all_reduce: Callable[[Tensor, str], Tensor] | None = None
    """``(t, op) -> t`` reduced over ranks (sum, mean, max, min) on the host; None in one process."""

    def reduce(self, t: Tensor, op: str) -> Tensor:
        """``op`` of ``t`` over ranks (``t`` itself in one process)."""
        if self.size == 1 or self.all_reduce is None:
            return t
        return self.all_reduce(t, op)

    def max(self, t: Tensor) -> Tensor:
        """Element-wise max over ranks (the token-budgeted chunk counts)."""
        return self.reduce(t, "max")

    def total(self, count: int) -> int:
        """``count`` summed over ranks."""
        if self.size == 1:
            return count
        return int(self.reduce(torch.tensor(float(count)), "sum"))


ONE_PROCESS_GROUP = DataParallelGroup()


def is_fsdp2(module: nn.Module | None) -> bool:
    """True if ``fully_shard`` was applied to ``module`` (its class is then an ``FSDPModule``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one: classes listed in the HF model's ``_no_split_modules``.

    Falls back to the children of the largest ``nn.ModuleList`` (the layer stack of most
    causal LMs) for models that do not declare ``_no_split_modules``.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(stacks, key=len)) if stacks else []


def shard_fsdp2(model: nn.Module, mesh) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, tied head, a VLM's vision tower).

    One all-gather per layer in forward and one reduce-scatter per layer in backward; the root
    group holds what is left (with tied embeddings the shared weight stays in one group).
    Idempotent: a model that is already sharded is returned as is (Lightning may call
    ``configure_model`` again for a later ``validate``).
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if is_fsdp2(model):
        return model
    # A VLM's vision blocks stay in the root group: a chunk without pixels (a DP filler, text-only rows) skips the
    # tower, and a group of its own would then all-gather on one rank and not on the other (a collective mismatch).
    tower = vision_tower(model)
    in_tower = set() if tower is None else {id(m) for m in tower.modules()}
    for layer in decoder_layers(model):
        if id(layer) not in in_tower:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # The memory-bounded logprobs call the decoder and a sliced head, never ``model.forward``, so FSDP2's
    # root hooks (all-gather of the root group, the end-of-backward reduce-scatter) would not run. Give the
    # model a method that is a forward in FSDP2's eyes; ``root_call`` routes through it.
    setattr(model, _ROOT_CALL, _call)
    register_fsdp_forward_method(model, _ROOT_CALL)
    return model


_ROOT_CALL = "_lightning_grpo_root_call"


def _call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def root_call(model: nn.Module, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run as a forward of ``model``: under FSDP2 its root parameters are gathered around it."""
    call = getattr(model, _ROOT_CALL, None)
    return fn(*args, **kwargs) if call is None else call(fn, *args, **kwargs)


def data_parallel_mesh(strategy):
    """The 1-D data-parallel mesh of a ``ModelParallelStrategy``; refuses tensor parallelism (not supported yet)."""
    mesh = strategy.device_mesh
    tp = mesh["tensor_parallel"].size()
    if tp != 1:
        raise ValueError(
            f"ModelParallelStrategy(tensor_parallel_size={tp}): lightning-grpo shards with FSDP2 over data parallelism "
            f"only; use ModelParallelStrategy(data_parallel_size={mesh.size()}, tensor_parallel_size=1) "
            f"(CLI: --trainer.strategy.data_parallel_size={mesh.size()} --trainer.strategy.tensor_parallel_size=1)"
        )
    return mesh["data_parallel"]


def gradient_sync(
    enabled: bool, wrapper: nn.Module | None, policy: nn.Module
) -> contextlib.AbstractContextManager:
    """Context for one backward: with ``enabled=False`` the strategy keeps the gradient local.

    ``wrapper`` is ``trainer.strategy.model`` (the DDP wrapper under DDP); ``policy`` is the
    module that FSDP2 shards. Single process: nothing to skip.
    """
    if enabled:
        return contextlib.nullcontext()
    if is_fsdp2(policy):
        return _fsdp2_no_sync(policy)
    if wrapper is not None and hasattr(wrapper, "no_sync"):
        return wrapper.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp2_no_sync(policy: nn.Module) -> Iterator[None]:
    # recurse=True (the default) reaches every sharded layer, not only the root.
    policy.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        policy.set_requires_gradient_sync(True)


class DataParallelOps:
    """The data-parallel reductions of a manual-optimization LightningModule (``GRPOModule``, ``DPOModule``).

    Each reduction is a no-op in a single process and goes through the Lightning strategy otherwise;
    Lightning's ``reduce`` all-reduces in place, so every one of them reduces a copy. Public: an objective's
    divisor is ``module.dp_mean`` of its count (``objectives/base.py``).
    """

    def dp_size(self) -> int:
        """Data-parallel ranks (1 outside a Trainer)."""
        return self._trainer.world_size if self._trainer is not None else 1

    def dp_mean(self, t: Tensor) -> Tensor:
        """Mean of ``t`` over data-parallel ranks (``t`` itself in one process)."""
        if self.dp_size() == 1:
            return t
        # A copy: ``t`` is often a view of this rank's count (the objective's ``tokens.detach()``), which would
        # otherwise read as the DP mean in the chunk's stats.
        return self.trainer.strategy.reduce(t.clone(), reduce_op="mean")

    def dp_sum(self, t: Tensor) -> Tensor:
        """Sum of ``t`` over data-parallel ranks (the ahead pass's probe counts)."""
        return self.dp_mean(t) * self.dp_size()

    def dp_all_reduce(self, t: Tensor, op: str) -> Tensor:
        """``op`` (sum, mean, max, min) of ``t`` over data-parallel ranks, on the host."""
        return self.trainer.strategy.reduce(
            t.to(self.device, copy=True), reduce_op=op
        ).cpu()

    def dp_group(self) -> DataParallelGroup:
        """The data-parallel ranks as the strategy set them up now (one process outside a Trainer)."""
        if self.dp_size() == 1:
            return ONE_PROCESS_GROUP
        return DataParallelGroup(self.dp_size(), self.global_rank, self.dp_all_reduce)

    def dp_all_finite(self, loss: Tensor) -> bool:
        """Finite on every rank (one tiny all-reduce per chunk under DP): every rank poisons the same window."""
        finite = torch.isfinite(loss).to(torch.float32)
        return bool(
            finite
            if self.dp_size() == 1
            else self.trainer.strategy.reduce(finite, reduce_op="min")
        )

    def dp_grad_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Non-final micro-steps skip the gradient sync (DDP ``no_sync``; FSDP2 ``set_requires_gradient_sync``)."""
        wrapper = self._trainer.strategy.model if self._trainer is not None else None
        return gradient_sync(enabled, wrapper, self.policy)
