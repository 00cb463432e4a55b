"""MXFP4 kernels: fused quantize (Pallas), GEMMs (Pallas bf16, Pallas FP8 re-encode,
Triton tl.dot_scaled) and backend dispatch.

Entry points for the interceptor:
  mx_dot(lhs_q, rhs_q, *, backend) -> f32    contract the block axes of two 2-D MXArrays
  resolve_backend(name) -> str               'auto' -> best for the chip compiled for;
                                             explicit -> checked
  backends_per_platform(name, fmts)          the same per lowering platform (cpu/gpu/tpu)
  supports(backend, lhs_fmt, rhs_fmt)        which formats a backend implements
  fused_quantize(x, row=..., col=...)        row- and/or column-wise copies in one pass
  capabilities(platform=None)                what the chip compiled for can run
  AUTO_CHOICES                               what 'auto' picks per chip, with the evidence
"""

from mxjax.kernels.capabilities import (
    KERNEL_BACKENDS,
    Capabilities,
    Chip,
    capabilities,
    capabilities_for,
    compute_capability_of,
    target_chip,
)
from mxjax.kernels.dispatch import (
    AUTO_CHOICES,
    BACKENDS,
    AutoChoice,
    BackendUnavailableError,
    auto_backend,
    auto_choice,
    backend_for_formats,
    backends_per_platform,
    mx_dot,
    resolve_backend,
    supports,
    unavailable,
)
from mxjax.kernels.pallas_gemm import GEMM_TOLERANCE_DOC, gemm_error_bound
from mxjax.kernels.pallas_quantize import QuantSpec, fused_quantize

__all__ = [
    "AUTO_CHOICES",
    "BACKENDS",
    "GEMM_TOLERANCE_DOC",
    "KERNEL_BACKENDS",
    "AutoChoice",
    "BackendUnavailableError",
    "Capabilities",
    "Chip",
    "QuantSpec",
    "auto_backend",
    "auto_choice",
    "backend_for_formats",
    "backends_per_platform",
    "capabilities",
    "capabilities_for",
    "compute_capability_of",
    "fused_quantize",
    "gemm_error_bound",
    "mx_dot",
    "resolve_backend",
    "supports",
    "target_chip",
    "unavailable",
]
