"""Determinism mode (``rl.deterministic``): seeds, deterministic kernels, and the cuBLAS launch-env rule.

``enable_determinism(seed)`` seeds python/numpy/torch, turns on
``torch.use_deterministic_algorithms``, pins cuDNN and switches the fused SDPA kernels
(flash, memory-efficient, cuDNN attention) off so attention takes the math path.

One knob cannot be set from inside the process: cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG``
when it creates its handle, and rollout engine workers (vLLM, Ray actors) are separate
processes that read their own launch environment. Setting it late looks like it worked
and silently does not, so the decision is to **refuse** on a CUDA machine whenever the
variable is missing (or has a value cuBLAS ignores), whether CUDA is already initialized
or not, and to say how to export it before launch. A CPU-only process has no cuBLAS and
needs nothing. The decision is ``cublas_problem`` (a pure function, unit-tested).

The run's seed has one source of truth, Lightning's: ``run_seed`` gives ``model.seed`` when it is
set, else the seed ``seed_everything`` applied (the CLI's ``--seed_everything``; Lightning leaves it
in ``PL_GLOBAL_SEED``), else 0 as Lightning's own ``seed_everything()`` does.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
SEED_ENV = "PL_GLOBAL_SEED"
"""Where Lightning's ``seed_everything`` leaves the seed it applied (spawned ranks inherit it)."""
CUBLAS_VALUES = (":4096:8", ":16:8")
"""The two workspace settings torch accepts as deterministic (":16:8" saves memory, may cost speed)."""


class DeterminismError(RuntimeError):
    """Determinism mode cannot hold in this process as launched."""


@dataclass(frozen=True)
class CudaState:
    """What the process knows about CUDA at the moment determinism mode is applied."""

    available: bool
    """A CUDA device is visible (the run may use cuBLAS)."""
    initialized: bool
    """torch has already created its CUDA context (cuBLAS handles may exist)."""

    @classmethod
    def current(cls) -> CudaState:
        # Neither call initializes CUDA.
        return cls(
            available=torch.cuda.is_available(), initialized=torch.cuda.is_initialized()
        )


def cublas_problem(cuda: CudaState, env: Mapping[str, str]) -> str | None:
    """Why determinism mode must refuse to start (None = fine). Pure: tests pass any state and environment."""
    value = env.get(CUBLAS_ENV)
    if not cuda.available and not cuda.initialized:
        return None  # CPU only: no cuBLAS, nothing to configure
    if value in CUBLAS_VALUES:
        return None
    export = f"export {CUBLAS_ENV}={CUBLAS_VALUES[0]}"
    found = (
        "is unset"
        if value is None
        else f"is {value!r}, which cuBLAS does not treat as deterministic"
    )
    if cuda.initialized:
        when = (
            "CUDA is already initialized in this process, so cuBLAS may have created its handles; setting the "
            "variable now would not reach them"
        )
    else:
        when = (
            "setting it from inside the trainer would be too late for cuBLAS handles created by engine workers "
            "(vLLM, Ray actors) and for any library that initialized CUDA first"
        )
    return (
        f"rl.deterministic=true needs {CUBLAS_ENV} from the launch environment, but it {found}: {when}. "
        f"Fix: `{export}` (or {CUBLAS_VALUES[1]}) in the shell or job script before launching, e.g. "
        f"`{export} && lightning-grpo fit --config ...`; or set rl.deterministic=false."
    )


@dataclass(frozen=True)
class RunSeed:
    """The seed a run's own random streams derive from, and where it came from."""

    value: int
    source: str
    """``model.seed`` (set explicitly), ``seed_everything`` (Lightning's, via ``PL_GLOBAL_SEED``) or ``default`` (0)."""


def run_seed(explicit: int | None, env: Mapping[str, str] | None = None) -> RunSeed:
    """``explicit`` when given (logged when it overrides ``seed_everything``), else Lightning's seed, else 0."""
    env = os.environ if env is None else env
    applied = env.get(SEED_ENV)
    if explicit is not None:
        if applied is not None and int(applied) != explicit:
            from lightning.pytorch.utilities import rank_zero_info

            rank_zero_info(
                f"model.seed={explicit} overrides seed_everything={applied} for the module's random streams"
            )
        return RunSeed(int(explicit), "model.seed")
    if applied is not None:
        return RunSeed(int(applied), "seed_everything")
    return RunSeed(0, "default")


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (every CUDA device too) with one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    # also seeds every CUDA device (lazily if CUDA is not up yet)
    torch.manual_seed(seed)


def enable_determinism(
    seed: int, cuda: CudaState | None = None, env: Mapping[str, str] | None = None
) -> None:
    """Seed everything and switch to deterministic kernels; raise ``DeterminismError`` if cuBLAS cannot comply.

    Process-global and not undone at the end of a fit (torch has no scoped form of these switches).

    Args:
        seed: the seed for python/numpy/torch.
        cuda: the CUDA state to decide on (default: this process's).
        env: the environment to read ``CUBLAS_WORKSPACE_CONFIG`` from (default: ``os.environ``).
    """
    problem = cublas_problem(
        cuda or CudaState.current(), os.environ if env is None else env
    )
    if problem:
        raise DeterminismError(problem)
    seed_all(seed)
    # warn_only=False: an op without a deterministic kernel raises instead of quietly breaking reproducibility.
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    # autotuning may pick a different algorithm run to run
    torch.backends.cudnn.benchmark = False
    # Fused attention kernels: flash/mem-efficient backward use atomics; attention falls back to the math path.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)
