"""What the current JAX device can run: platform, device, compute capability, kernels."""

from __future__ import annotations

import dataclasses
import importlib.util

import jax

from mxjax.kernels import triton_gemm
from mxjax.recipes import BACKENDS

__all__ = ["KERNEL_BACKENDS", "Capabilities", "capabilities"]

# Every concrete backend (all of mxjax.recipes.BACKENDS but 'auto').
KERNEL_BACKENDS = tuple(b for b in BACKENDS if b != "auto")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
    """A snapshot of the default JAX device's kernel support.

    Attributes:
      platform: 'cpu', 'gpu' or 'tpu' (jax.default_backend()).
      device_kind: e.g. 'NVIDIA H200', 'cpu'.
      compute_capability: (major, minor) on NVIDIA GPUs, else None.
      native_fp4: the device has block-scaled FP4 matrix units (Blackwell sm_100+,
        AMD MI355X / gfx950).
      fp8_tensor_cores: FP8 matrix units (sm_89+, or an FP4-capable part).
      pallas_mode: 'triton' (compiled, GPU), 'interpret' (CPU) or None (cannot run).
      jax_triton: jax_triton and triton are importable.
      backends: (name, reason) pairs; reason is '' when the backend can run here.
    """

    platform: str
    device_kind: str
    compute_capability: tuple[int, int] | None
    native_fp4: bool
    fp8_tensor_cores: bool
    pallas_mode: str | None
    jax_triton: bool
    backends: tuple[tuple[str, str], ...]

    def can_run(self, backend: str) -> bool:
        return self.reason(backend) == ""

    def reason(self, backend: str) -> str:
        """'' if `backend` can run here, else why not."""
        for name, why in self.backends:
            if name == backend:
                return why
        raise ValueError(f"backend: unknown {backend!r}; expected one of {KERNEL_BACKENDS}")

    @property
    def runnable(self) -> tuple[str, ...]:
        return tuple(name for name, why in self.backends if not why)


def _compute_capability(dev) -> tuple[int, int] | None:
    cc = getattr(dev, "compute_capability", None)
    if not isinstance(cc, str) or "." not in cc:
        return None
    major, minor = cc.split(".", 1)
    try:
        return int(major), int(minor)
    except ValueError:
        return None


def capabilities() -> Capabilities:
    """Inspects jax.devices()[0] (the default backend) and the installed packages."""
    platform = jax.default_backend()
    dev = jax.devices()[0]
    kind = str(getattr(dev, "device_kind", platform))
    cc = _compute_capability(dev) if platform == "gpu" else None
    is_amd = platform == "gpu" and ("gfx" in kind.lower() or "instinct" in kind.lower()
                                    or "gfx" in str(getattr(dev, "compute_capability", "")))
    native_fp4 = bool(
        (cc is not None and cc[0] >= 10)
        or (is_amd and any(t in kind.lower() for t in ("mi355", "mi350", "gfx950")))
    )
    fp8 = bool(native_fp4 or (cc is not None and cc >= (8, 9))
               or (is_amd and "mi3" in kind.lower()))
    has_jt = all(importlib.util.find_spec(m) is not None for m in ("triton", "jax_triton"))

    if platform == "gpu":
        pallas_mode = "triton"
    elif platform == "cpu":
        pallas_mode = "interpret"
    else:
        pallas_mode = None

    reasons: dict[str, str] = {"xla": ""}
    if pallas_mode is None:
        reasons["pallas"] = ("the Pallas kernels target Triton (GPU) or the interpreter (CPU), "
                             f"not {platform}")
    else:
        reasons["pallas"] = ""
    if pallas_mode == "interpret":
        reasons["pallas_fp8"] = ""  # FP8 dot emulated exactly in f32
    elif pallas_mode == "triton" and fp8 and not is_amd:
        reasons["pallas_fp8"] = ""
    elif pallas_mode == "triton":
        reasons["pallas_fp8"] = (f"needs FP8 tensor cores (NVIDIA sm_89+); device is {kind!r} "
                                 f"cc={cc}")
    else:
        reasons["pallas_fp8"] = reasons["pallas"]
    reasons["triton"] = triton_gemm.unavailable_reason() or ""
    return Capabilities(
        platform=platform,
        device_kind=kind,
        compute_capability=cc,
        native_fp4=native_fp4,
        fp8_tensor_cores=fp8,
        pallas_mode=pallas_mode,
        jax_triton=has_jt,
        backends=tuple((b, reasons[b]) for b in KERNEL_BACKENDS),
    )
