"""mxjax: per-GEMM MXFP4/MXFP8/NVFP4 precision policies for JAX and Flax."""

from mxjax import formats
from mxjax.formats import (
    BF16,
    E2M1,
    E4M3,
    E5M2,
    FP8_E4M3,
    FP8_E5M2,
    MXFP4,
    MXFP8_E4M3,
    MXFP8_E5M2,
    NVFP4,
    Format,
    Rounding,
    ScaleRule,
)
from mxjax.hadamard import fixed_signs, hadamard, random_signs
from mxjax.quantize import MXArray, dequantize, fake_quantize, quantize

__version__ = "0.1.0"
