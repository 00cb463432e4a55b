"""Program shape per lowering platform: what XLA:CPU needs vs what GPUs/TPUs get.

The choice is made with `jax.lax.platform_dependent`, i.e. per *lowering*
platform, not from `jax.default_backend()` at trace time: a program exported on
this CPU machine with ``jax.export(..., platforms=['cuda'])`` gets the
accelerator form. Lowering for a single platform keeps only that platform's
branch (a one-branch ``case`` that XLA inlines).

Three program forms exist: XLA:CPU's, the GPUs' (``cuda``, ``rocm``, and any
platform not named) and the TPUs'. `per_platform` picks among them; the
accelerator forms differ only in how the same values are laid out for each
compiler (docs/NUMERICS.md, "Emulated GEMM").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax import lax

__all__ = ["FORMS", "cpu_barrier", "cpu_or_accelerator", "cuda_or_other", "per_platform"]

# The program forms, one per compiler family (`per_platform`).
FORMS = ("cpu", "gpu", "tpu")


def cpu_barrier(x: Any) -> Any:
    """``lax.optimization_barrier(x)`` when lowered for CPU; the identity on GPU/TPU.

    For materializations that only help XLA:CPU's speed (it recomputes fused
    producers per element instead of writing them once). Never use it for a
    barrier that guards a value: those must hold on every platform.
    """
    return lax.platform_dependent(x, cpu=lax.optimization_barrier, default=lambda v: v)


def cpu_or_accelerator(*args: Any, cpu: Callable[..., Any],
                       accelerator: Callable[..., Any]) -> Any:
    """``cpu(*args)`` when lowered for CPU, ``accelerator(*args)`` for every other platform."""
    return lax.platform_dependent(*args, cpu=cpu, default=accelerator)


def per_platform(*args: Any, cpu: Callable[..., Any], gpu: Callable[..., Any],
                 tpu: Callable[..., Any]) -> Any:
    """``cpu(*args)`` lowered for CPU, ``tpu(*args)`` for TPU, ``gpu(*args)`` for the rest.

    The rest is ``cuda`` and ``rocm`` (and any other platform: they are GPU-like
    compilers, XLA's GPU pipeline).
    """
    return lax.platform_dependent(*args, cpu=cpu, tpu=tpu, default=gpu)


def cuda_or_other(*args: Any, cuda: Callable[..., Any], other: Callable[..., Any]) -> Any:
    """``cuda(*args)`` when lowered for CUDA, ``other(*args)`` for every other platform.

    Inside `per_platform`'s GPU form: what only NVIDIA's compiler gets (the FP8 GEMMs
    of `mxjax.emulation.fp8_units`), ROCm and the rest keep the GPU form.
    """
    return lax.platform_dependent(*args, cuda=cuda, default=other)
