"""The devices a ``--check`` reckons memory for: this host's, or a count of a named chip.

``python -m train --check --devices 8 --chip h100`` asks about eight H100s from a machine
that has none: the mesh is resolved for 8 devices, and each holds what `CHIPS` says the
chip has, as JAX would give it (`DeviceTarget.budget`). Without ``--chip`` the devices are
this host's kind (`train.memory.device_memory`), as many as ``--devices`` says.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from train.config import ConfigError
from train.memory import device_memory, gib

__all__ = ["CHIPS", "GPU_MEMORY_FRACTION", "ChipMemory", "DeviceTarget", "target"]

# JAX preallocates this fraction of a GPU's memory for XLA (jax.readthedocs.io, "GPU memory
# allocation"); XLA_PYTHON_CLIENT_MEM_FRACTION changes it.
GPU_MEMORY_FRACTION = 0.75


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChipMemory:
    """One chip's memory: ``bytes`` of HBM per device and where the figure comes from."""

    name: str
    platform: str  # 'gpu' or 'tpu' (mxjax.chips.PLATFORMS)
    device_kind: str
    bytes: int
    source: str


_MIB, _GIB = 2**20, 2**30

# Chips the project knows (mxjax/chips.py, bench/costmodel/aot.py's targets), by --chip name.
CHIPS: dict[str, ChipMemory] = {c.name: c for c in (
    ChipMemory(name="h100", platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
               bytes=81559 * _MIB, source="nvidia-smi total, H100 SXM 80GB"),
    ChipMemory(name="h200", platform="gpu", device_kind="NVIDIA H200",
               bytes=143771 * _MIB, source="nvidia-smi total, H200 141GB"),
    ChipMemory(name="b200", platform="gpu", device_kind="NVIDIA B200",
               bytes=180 * 10**9,
               source="vendor figure, DGX B200: 1,440 GB for 8 GPUs, read as 10^9 bytes"),
    ChipMemory(name="gb200", platform="gpu", device_kind="NVIDIA GB200",
               bytes=186 * 10**9,
               source="vendor figure, GB200 NVL72: 13.4 TB for 72 GPUs, read as 10^9 bytes"),
    ChipMemory(name="v4", platform="tpu", device_kind="TPU v4", bytes=32 * _GIB,
               source="Google Cloud TPU v4 documentation"),
    ChipMemory(name="v5e", platform="tpu", device_kind="TPU v5 lite", bytes=16 * _GIB,
               source="Google Cloud TPU v5e documentation"),
    ChipMemory(name="v5p", platform="tpu", device_kind="TPU v5p", bytes=95 * _GIB,
               source="Google Cloud TPU v5p documentation"),
    ChipMemory(name="v6e", platform="tpu", device_kind="TPU v6 lite", bytes=32 * _GIB,
               source="Google Cloud TPU v6e documentation"),
)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceTarget:
    """The devices a memory estimate is for: ``count`` devices of ``platform``, each able to
    hold ``budget`` bytes (None: unknown), ``source`` saying where that figure comes from,
    ``chip`` the ``--chip`` name (None: this host's devices)."""

    count: int
    platform: str
    budget: int | None
    source: str
    chip: str | None = None


def _gpu_fraction() -> tuple[float, str]:
    raw = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if raw is None:
        return GPU_MEMORY_FRACTION, ("JAX preallocates that fraction by default; "
                                     "XLA_PYTHON_CLIENT_MEM_FRACTION changes it")
    try:
        frac = float(raw)
    except ValueError:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} is not a number; unset it "
                          "or give a fraction such as 0.9") from None
    if not 0 < frac <= 1:  # also NaN
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} is not a fraction of the "
                          "GPU's memory in (0, 1]; unset it or give one such as 0.9")
    return frac, f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw}"


def target(devices: int | None = None, chip: str | None = None) -> DeviceTarget:
    """The `DeviceTarget` of ``--devices`` and ``--chip`` (None: this host's count / kind).
    A ConfigError names an unknown chip (with the known ones) or a count below 1."""
    if devices is not None and devices < 1:
        raise ConfigError(f"--devices {devices}: give a device count of 1 or more")
    if chip is None:
        budget, source = device_memory()
        return DeviceTarget(count=devices or jax.device_count(), platform=jax.default_backend(),
                            budget=budget, source=source)
    spec = CHIPS.get(chip.lower())
    if spec is None:
        raise ConfigError(f"--chip {chip!r}: unknown chip; known: {', '.join(CHIPS)} (their "
                          "memory is in train/devices.py)")
    count = devices or 1
    if spec.platform == "gpu":
        frac, why = _gpu_fraction()
        budget = int(spec.bytes * frac)
        source = (f"{spec.device_kind}: {gib(spec.bytes)} ({spec.source}) x {frac:g} "
                  f"({why}) = {gib(budget)}")
    else:
        budget, source = spec.bytes, f"{spec.device_kind}: {gib(spec.bytes)} ({spec.source})"
    return DeviceTarget(count=count, platform=spec.platform, budget=budget, source=source,
                        chip=spec.name)
