"""Precision: what each Lightning ``trainer.precision`` means for a GRPO update, and the checks at fit start.

* ``32-true`` / ``64-true``: exact.
* ``bf16-mixed``: fp32 master weights, bf16 autocast over the whole loop step (generation with the
  transformers engine, ahead pass, update). The GPU default, and the fast mode on CPUs with native
  bf16 (AVX512-BF16, AMX); elsewhere bf16 is emulated and slow, so fit start warns with the slowdown
  measured on the spot.
* ``16-mixed``: fp32 master weights, fp16 autocast and Lightning's GradScaler. The step runs through
  the precision plugin in the order unscale -> x 1/sum denom -> clip -> step, and ``scaler.update()``
  also follows a skipped (overflowed) window (``PluginStep``). Refused when the weights
  themselves are fp16 (a GradScaler cannot unscale fp16 gradients).
* ``bf16-true`` / ``16-true`` (or ``policy.dtype`` bfloat16/float16 under any precision): the weights
  are half precision, so an AdamW update below half a weight's rounding step is lost. Warned once.

Measured figures: docs/precision.md (``python -m bench.precision``).
"""

from __future__ import annotations

import math
import platform
import subprocess
import time
from collections.abc import Callable

import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_grpo.update.accumulate import plain_step

HALF = (torch.bfloat16, torch.float16)
# CPU flags of native half-precision arithmetic (x86 /proc/cpuinfo "flags", Arm "Features").
NATIVE_FLAGS = {
    torch.bfloat16: {"avx512_bf16", "amx_bf16", "bf16"},
    torch.float16: {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"},
}
MAC_FEATURES = {
    torch.bfloat16: "hw.optional.arm.FEAT_BF16",
    torch.float16: "hw.optional.arm.FEAT_FP16",
}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The half dtype a Lightning precision computes in (autocast or weights); None for 32/64-bit."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return None


def cpu_supports(dtype: torch.dtype) -> bool | None:
    """Whether this CPU computes ``dtype`` natively; None when it cannot be told (then nothing is claimed)."""
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", MAC_FEATURES[dtype]],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            )
            return out.stdout.strip() == "1" if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        with open("/proc/cpuinfo") as f:
            flags = {
                w
                for line in f
                if line.lower().startswith(("flags", "features"))
                for w in line.split(":")[1].split()
            }
    except OSError:
        return None
    return bool(flags & NATIVE_FLAGS[dtype]) if flags else None


def matmul_slowdown(dtype: torch.dtype, size: int = 256, repeats: int = 5) -> float:
    """Time of a ``size``-cubed matmul under ``dtype`` autocast over its float32 time, on this CPU (best of repeats)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)

    def best(autocast: bool) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    best(True)  # first call pays oneDNN's kernel selection
    return best(True) / max(best(False), 1e-9)


def check_precision(
    precision: str, policy: nn.Module, on_cpu: bool, scaler: object | None
) -> None:
    """Refuse what cannot train, warn (once per fit) about what trains poorly. Called once the weights are final."""
    dtypes = {p.dtype for p in policy.parameters() if p.requires_grad}
    if scaler is not None and torch.float16 in dtypes:
        raise ValueError(
            f"trainer.precision={precision!r} keeps fp32 master weights and unscales their gradients, but the policy's "
            "weights are float16 (a GradScaler cannot unscale fp16 gradients): set model.policy.dtype: float32, or use "
            "precision: bf16-mixed (no scaler needed)"
        )
    half = sorted(str(d).removeprefix("torch.") for d in dtypes & set(HALF))
    if half:
        rank_zero_warn(
            f"the policy's trained weights are {'/'.join(half)} (trainer.precision={precision!r}, or "
            "model.policy.dtype): an AdamW update smaller than half a weight's rounding step is lost. Measured: at lr "
            "1e-6, 4 steps change about 2% of bf16 weights but 99.9% of float32 ones (docs/precision.md). For float32 "
            "master weights with bf16 compute use precision: bf16-mixed with model.policy.dtype: float32."
        )
    dtype = compute_dtype(precision)
    if on_cpu and dtype is not None and cpu_supports(dtype) is False:
        name = str(dtype).removeprefix("torch.")
        rank_zero_warn(
            f"trainer.precision={precision!r} on a CPU without native {name} (no {'/'.join(sorted(NATIVE_FLAGS[dtype]))} "
            f"flag): {name} is emulated, and a {name} matmul took {matmul_slowdown(dtype):.1f}x the float32 time on "
            "this CPU just now (docs/precision.md has whole updates). Use precision: 32-true here; bf16-mixed pays off "
            "on CPUs with AVX512-BF16 or AMX, and on GPUs."
        )


class PluginStep:
    """The accumulator's step driver under a Trainer: the optimizer step through Lightning's precision plugin.

    Without a GradScaler the gradients are at their true scale already: ``finish`` (x 1/sum denom, clip),
    then step unless the norm is non-finite. With one (16-mixed) ``LightningOptimizer.step()`` runs the
    plugin's ``optimizer_step``: it unscales, calls ``on_before_optimizer_step`` (-> ``finish``), then
    ``scaler.step`` skips a non-finite update itself and ``scaler.update()`` lowers the scale. An overflowed
    window is stepped through, never around, or the scale would stay where it overflowed.

    Args:
        trainer: the Trainer (its ``precision_plugin``).
        policy: the trained model (its gradients are clipped).
        optimizer: the ``LightningOptimizer`` of the policy.
    """

    def __init__(self, trainer, policy: nn.Module, optimizer) -> None:
        self.trainer = trainer
        self.policy = policy
        self.optimizer = optimizer
        # set while a GradScaler step waits for the hook
        self._finish: Callable[[], float] | None = None
        self._norm = math.nan

    def __call__(self, finish: Callable[[], float]) -> float:
        if getattr(self.trainer.precision_plugin, "scaler", None) is None:
            return plain_step(self.optimizer)(finish)
        self._finish = finish
        self._norm = math.nan
        self.optimizer.step()
        if self._finish is not None:
            raise RuntimeError(
                f"{type(self.trainer.precision_plugin).__name__}.optimizer_step did not call "
                "on_before_optimizer_step, so the deferred divisor and clipping were not applied"
            )
        return self._norm

    def before_optimizer_step(self) -> None:
        """``GRPOModule.on_before_optimizer_step``: inside a GradScaler step the gradients are unscaled now."""
        if self._finish is not None:
            finish = self._finish
            self._finish = None
            self._norm = finish()

    def clip(self, max_norm: float, norm: Tensor) -> None:
        """Clip through the precision plugin (``LightningModule.clip_gradients``)."""
        plugin = self.trainer.precision_plugin
        if (
            isinstance(plugin, MixedPrecision)
            and plugin.scaler is None
            and _optimizer_handles_unscaling(self.optimizer)
        ):
            # Lightning refuses to clip for a fused optimizer under any MixedPrecision, bf16 too, though without a
            # scaler nothing unscales inside the step (Lightning-AI/pytorch-lightning#21435): clipping here is exact.
            torch.nn.utils.clip_grads_with_norm_(
                [p for p in self.policy.parameters() if p.grad is not None],
                max_norm,
                norm,
            )
        else:
            self.trainer.lightning_module.clip_gradients(
                self.optimizer, max_norm, "norm"
            )


def adamw_kernel(params, fused: bool | None, scaler) -> dict:
    """AdamW's kernel arguments: fused where the device has one (CPU, CUDA) unless ``fused`` says otherwise.

    Not under a GradScaler by default: a fused step unscales inside its kernel, after our clip, and Lightning's
    precision plugin refuses to clip for such an optimizer.
    """
    if fused is None:
        fused = scaler is None and all(
            p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
        )
    # {}: torch's default kernel (foreach on CUDA, a for-loop on CPU)
    return {"fused": True} if fused else {}
