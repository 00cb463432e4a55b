"""mxjax: per-GEMM MXFP4/MXFP8/NVFP4 precision policies for JAX and Flax.

Layers (data flows one way): formats -> quantize/hadamard -> policy -> dot_general
-> nn. `mxjax.nn` (Flax integration) and `mxjax.kernels` (Pallas/Triton) are
imported on demand: `import mxjax.nn`, `import mxjax.kernels`.

Note: `mxjax.quantize`, `mxjax.hadamard` and `mxjax.dot_general` are the
functions; their modules are importable as `mxjax.quantize` etc. with
`import mxjax.quantize as m` / `from mxjax.quantize import MXArray`.
"""

from mxjax import formats, policies
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
from mxjax.policies import PrecisionPolicy, dot_general
from mxjax.quantization import MXArray, dequantize, fake_quantize, quantize
from mxjax.recipes import GemmRecipe, Hadamard, OperandRecipe
from mxjax.rotation import fixed_signs, hadamard, random_signs

__version__ = "0.1.0"

__all__ = [
    "BF16",
    "E2M1",
    "E4M3",
    "E5M2",
    "FP8_E4M3",
    "FP8_E5M2",
    "MXFP4",
    "MXFP8_E4M3",
    "MXFP8_E5M2",
    "NVFP4",
    "Format",
    "GemmRecipe",
    "Hadamard",
    "MXArray",
    "OperandRecipe",
    "PrecisionPolicy",
    "Rounding",
    "ScaleRule",
    "dequantize",
    "dot_general",
    "fake_quantize",
    "fixed_signs",
    "formats",
    "hadamard",
    "policies",
    "quantize",
    "random_signs",
]


def __getattr__(name):
    # `mxjax.nn` / `mxjax.kernels` without an explicit import (they pull in flax / Pallas).
    if name in ("nn", "kernels", "diagnostics"):
        import importlib

        return importlib.import_module(f"mxjax.{name}")
    raise AttributeError(f"module 'mxjax' has no attribute {name!r}")
