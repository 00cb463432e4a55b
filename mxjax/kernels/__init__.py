"""MXFP4 kernels: fused quantize (Pallas), GEMMs (Pallas bf16, Pallas FP8 re-encode,
Triton tl.dot_scaled) and backend dispatch.

Entry points for the interceptor:
  mx_dot(lhs_q, rhs_q, *, backend) -> f32    contract the block axes of two 2-D MXArrays
  resolve_backend(name) -> str               'auto' -> best here; explicit -> checked
  supports(backend, lhs_fmt, rhs_fmt)        which formats a backend implements
  fused_quantize(x, row=..., col=...)        row- and/or column-wise copies in one pass
  capabilities()                             what this device can run
"""

from mxjax.kernels.capabilities import KERNEL_BACKENDS, Capabilities, capabilities
from mxjax.kernels.dispatch import (
    BACKENDS,
    auto_backend,
    backend_for_formats,
    mx_dot,
    resolve_backend,
    supports,
)
from mxjax.kernels.pallas_gemm import GEMM_TOLERANCE_DOC, gemm_error_bound
from mxjax.kernels.pallas_quantize import QuantSpec, fused_quantize

__all__ = [
    "BACKENDS",
    "GEMM_TOLERANCE_DOC",
    "KERNEL_BACKENDS",
    "Capabilities",
    "QuantSpec",
    "auto_backend",
    "backend_for_formats",
    "capabilities",
    "fused_quantize",
    "gemm_error_bound",
    "mx_dot",
    "resolve_backend",
    "supports",
]
