"""Trainer offload: the trainer's device memory goes to the host while the engine generates, and comes back.

Three backends behind one interface (``offload()`` / ``onload()``, both idempotent, each
returning the bytes it moved):

- ``TorchMemorySaverOffload``: ``torch_memory_saver`` pauses the trainer's allocations (contents
  backed up to host) and resumes them at the same device addresses, so nothing that holds a
  pointer (FSDP2 shards, CUDA graphs, registered buffers) notices. Used when the package is
  installed *and* usable: it allocates through CUDA only, so it is never used on CPU.
- ``HostOffload``: parameters, gradients and buffers through ``Module._apply`` (the machinery
  of ``Module.to``, so every ``Parameter`` keeps its identity and the optimizer keeps its
  references) into host copies, and the optimizer state replaced by host copies. Host copies
  are pinned where the build supports it (async copies back), plain otherwise (CPU-only torch).
- ``NoOffload``: nothing to move (training on CPU: host and device are the same memory).

``HostOffload`` always copies, even when host and device coincide, so its round trip is
testable bit for bit on a CPU machine (``tests/test_offload.py``); ``select_offload`` never
picks it for a CPU trainer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

OffloadBackend = Literal["auto", "torch_memory_saver", "host"]
TMS_TAG = "lightning_grpo.trainer"
"""The torch_memory_saver tag of the trainer's allocations (the engine, if it uses the package, has its own)."""


class TrainerOffload(Protocol):
    """Moves the trainer's memory off the device and back. Both calls are idempotent."""

    kind: str
    resident: bool

    def offload(self) -> int: ...

    def onload(self) -> int: ...


class NoOffload:
    """Nothing moves: the trainer is always resident."""

    kind = "none"

    def __init__(self) -> None:
        self.resident = True

    def offload(self) -> int:
        return 0

    def onload(self) -> int:
        return 0


class HostOffload:
    """Parameters/gradients/buffers via ``Module._apply`` and optimizer state as host copies (pinned when possible).

    Args:
        modules: modules whose tensors move (e.g. the LightningModule: policy and reference model).
        optimizers: optimizers whose state tensors move (read at each call: lazily created state is covered).
        device: where the trainer computes; ``onload`` brings tensors back here.
        host: where offloaded tensors live.
        pin_memory: pin host copies; None = when this torch build has an accelerator to pin for.

    Example::

        off = HostOffload([module], [optimizer], device="cuda")
        off.offload()   # device memory of params, grads and Adam moments released
        off.onload()    # back, bit-exact
    """

    kind = "host"

    def __init__(
        self,
        modules: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        device: torch.device | str,
        host: torch.device | str = "cpu",
        pin_memory: bool | None = None,
    ) -> None:
        self.modules = list(modules)
        self.optimizers = list(optimizers)
        self.device = torch.device(device)
        self.host = torch.device(host)
        self.pin_memory = pinning_available() if pin_memory is None else pin_memory
        if self.pin_memory and not pinning_available():
            raise ValueError(
                f"HostOffload(pin_memory=True): this torch build ({torch.__version__}) cannot pin memory"
            )
        self.resident = True

    def offload(self) -> int:
        if not self.resident:
            return 0
        moved = self._move(self._to_host)
        _synchronize(self.device)  # host copies are complete before anyone reads them
        self.resident = False
        _release_cached(self.device)
        return moved

    def onload(self) -> int:
        if self.resident:
            return 0
        # Non-blocking from pinned memory: later kernels on the stream wait for the copies; the caching host
        # allocator keeps each pinned block alive until its copy is done.
        moved = self._move(self._to_device)
        self.resident = True
        return moved

    def _to_device(self, t: Tensor) -> Tensor:
        return t.to(self.device, non_blocking=self.pin_memory)

    def _to_host(self, t: Tensor) -> Tensor:
        out = torch.empty_like(t, device=self.host, pin_memory=self.pin_memory)
        out.copy_(t, non_blocking=self.pin_memory)
        return out

    def _move(self, fn: Callable[[Tensor], Tensor]) -> int:
        # tied parameters are visited once per owner module: move each storage once
        done: set[int] = set()
        moved = 0

        def once(t: Tensor) -> Tensor:
            nonlocal moved
            if t.data_ptr() in done:
                return t
            out = fn(t)
            done.add(out.data_ptr())
            # on a CPU trainer, the way back is the identity: nothing moved
            if out is not t:
                moved += t.numel() * t.element_size()
            return out

        for module in self.modules:
            # Module.to's own path: param.data swapped in place, grads and buffers included
            module._apply(once)
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, Tensor) and not _is_host_scalar_step(
                        key, value, self.device
                    ):
                        state[key] = once(value)
        return moved


class TorchMemorySaverOffload:
    """``torch_memory_saver`` pause/resume of the trainer's allocations, contents backed up to host.

    Only allocations made inside a ``region`` are paused, and the optimizer's state appears
    lazily at its first step. So the trainer is adopted once its optimizer has state: until
    then offload/onload go through ``HostOffload``, and the onload that follows the first
    offload with optimizer state re-allocates everything inside the region (same cost as a
    plain onload). From then on, offload is ``pause`` and onload is ``resume``. Gradients are
    created by autograd's device threads, which a region does not reach; the loop sets them
    to None after every optimizer step, so at the batch boundary there are none to keep.
    """

    kind = "torch_memory_saver"

    def __init__(
        self,
        modules: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        device: torch.device | str,
    ) -> None:
        from torch_memory_saver import torch_memory_saver

        self._tms = torch_memory_saver
        self._host = HostOffload(modules, optimizers, device)
        self._adopted = False
        self.resident = True

    def offload(self) -> int:
        if not self.resident:
            return 0
        if not self._adopted:
            moved = self._host.offload()
        else:
            for module in self._host.modules:
                # outside the region (autograd threads); stale after the step
                module.zero_grad(set_to_none=True)
            _synchronize(self._host.device)
            self._tms.pause(TMS_TAG)
            moved = self._bytes()
        self.resident = False
        return moved

    def onload(self) -> int:
        if self.resident:
            return 0
        if self._adopted:
            self._tms.resume(TMS_TAG)
            moved = self._bytes()
        elif any(opt.state for opt in self._host.optimizers):
            with self._tms.region(tag=TMS_TAG, enable_cpu_backup=True):
                moved = self._host.onload()
            self._adopted = True
        else:
            moved = self._host.onload()
        self.resident = True
        return moved

    def _bytes(self) -> int:
        n = sum(
            t.numel() * t.element_size()
            for m in self._host.modules
            for t in m.parameters()
        )
        for opt in self._host.optimizers:
            n += sum(
                v.numel() * v.element_size()
                for s in opt.state.values()
                for v in s.values()
                if isinstance(v, Tensor)
            )
        return n


# -- choosing a backend ----------------------------------------------------------------------------------------------


def pinning_available() -> bool:
    """Page-locked host memory needs an accelerator runtime; CPU-only builds cannot pin."""
    return torch.cuda.is_available()


def memory_saver_usable() -> tuple[bool, str]:
    """(usable, why not): installed, CUDA present, and a 64 MiB probe really pauses and comes back intact."""
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch_memory_saver allocates through CUDA only)"
    try:
        import torch_memory_saver
    except ImportError:
        return (
            False,
            "torch_memory_saver is not installed (pip install torch_memory_saver)",
        )
    tms = torch_memory_saver.torch_memory_saver
    try:
        if "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""):
            # in-process pluggable allocator; 'preload' needs LD_PRELOAD at launch
            tms.hook_mode = "torch"
    except (AssertionError, AttributeError):
        pass  # already initialized (by us or by the engine): keep its mode
    probe_tag = TMS_TAG + ".probe"
    try:
        with tms.region(tag=probe_tag, enable_cpu_backup=True):
            x = torch.full((16 << 20,), 7.0, device="cuda")  # 64 MiB
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        tms.pause(probe_tag)
        freed = torch.cuda.mem_get_info()[0] - free_before
        tms.resume(probe_tag)
        intact = bool((x == 7.0).all())
        del x
    # noqa: BLE001 - a broken install or driver mismatch: fall back, say why
    except Exception as err:
        return False, f"torch_memory_saver failed its probe: {err!r}"
    if freed < (32 << 20) or not intact:
        return (
            False,
            f"torch_memory_saver probe freed {freed} bytes of 64 MiB (intact={intact})",
        )
    return True, ""


def select_offload(
    backend: OffloadBackend,
    modules: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    device: torch.device,
    tms_ok: bool,
    why_not: str = "",
) -> TrainerOffload:
    """The backend ``backend`` names. auto: torch_memory_saver if usable, else host copies; nothing on CPU."""
    if backend == "torch_memory_saver":
        if not tms_ok:
            raise ValueError(
                f"HandoffCallback(offload_backend='torch_memory_saver'): not usable here: {why_not}"
            )
        return TorchMemorySaverOffload(modules, optimizers, device)
    if backend == "host":
        return HostOffload(modules, optimizers, device)
    if device.type == "cpu":
        return NoOffload()
    if tms_ok:
        return TorchMemorySaverOffload(modules, optimizers, device)
    log.info(
        "trainer offload: host copies (%s)", why_not or "torch_memory_saver not usable"
    )
    return HostOffload(modules, optimizers, device)


def trainer_offload(
    backend: OffloadBackend, trainer, policy: nn.Module, engine_is_policy: bool
) -> TrainerOffload:
    """The offload of every tensor ``trainer`` holds (policy, reference, the optimizers' state), the same backend on
    every rank. When the engine generates with ``policy`` itself, its parameters stay and the rest moves."""
    trained = trainer.lightning_module
    device = trained.device
    usable, why_not = (
        memory_saver_usable() if device.type == "cuda" else (False, "not on CUDA")
    )
    usable = trainer.strategy.reduce_boolean_decision(usable, all=True)
    optimizers = trainer.optimizers
    if engine_is_policy:
        modules = [m for m in trained.children() if not _shares_parameters(m, policy)]
        return select_offload(
            backend, modules, optimizers, device, False, "engine is policy"
        )
    return select_offload(backend, [trained], optimizers, device, usable, why_not)


def _shares_parameters(module: nn.Module, other: nn.Module) -> bool:
    mine = {id(p) for p in module.parameters()}
    return module is other or any(id(p) in mine for p in other.parameters())


def _is_host_scalar_step(key: str, value: Tensor, device: torch.device) -> bool:
    """Adam's ``step`` counter lives on the host unless ``capturable``/fused; leave host scalars where they are."""
    return (
        key == "step"
        and value.device.type == "cpu"
        and value.dim() == 0
        and device.type != "cpu"
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release_cached(device: torch.device) -> None:
    # The one deliberate empty_cache: blocks freed by the offload stay reserved by PyTorch's caching allocator, and
    # the engine's wake_up allocates through its own allocator (vLLM: CuMemAllocator), which needs them truly free.
    if device.type == "cuda":
        torch.cuda.empty_cache()
