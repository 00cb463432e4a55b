"""mxjax's own kernels, loaded on first use: the fused quantizer (Pallas), the Triton
MXFP4 GEMM (the 'triton' route's) and the exact reference they are tested against.

  fused_quantize(x, row=..., col=...)   row- and/or column-wise copies in one pass
  mx_dot_reference(lhs_q, rhs_q)        the exact dot of two quantized operands
  GEMM_TOLERANCE_DOC, gemm_error_bound  how far a correct MXFP4 GEMM may differ from it

Choosing and running a route is `mxjax.backends` (``mx_dot``, ``capabilities``).
"""

from mxjax.kernels.pallas_quantize import QuantSpec, fused_quantize
from mxjax.kernels.reference import GEMM_TOLERANCE_DOC, gemm_error_bound, mx_dot_reference

__all__ = [
    "GEMM_TOLERANCE_DOC",
    "QuantSpec",
    "fused_quantize",
    "gemm_error_bound",
    "mx_dot_reference",
]
