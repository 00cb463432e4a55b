"""mxjax: per-GEMM MXFP4/MXFP8/NVFP4 precision policies for JAX and Flax.

Layers (data flows one way; tests/test_layering.py checks every import):

  formats, layout, dimensions, validation, _platform, measurements, chips -> _bits
  -> elements -> scaling -> operand_recipe -> quantization, rotation -> operands
  -> emulation -> kernels -> routes -> backends -> recipes -> gemm, shard_blocks
  -> interceptor -> policy_type -> presets -> policies -> diagnostics -> nn -> testing

`mxjax.nn` (Flax integration) and `mxjax.kernels` (Pallas/Triton) are imported
on demand (`import mxjax.nn`, `import mxjax.kernels`); the routes import the kernels
only when a GEMM asks for one (`mxjax.backends` chooses the route).

Module layout: the public functions are re-exported here under the names of the
API (`mxjax.quantize`, `mxjax.hadamard`, `mxjax.dot_general`,
`mxjax.PrecisionPolicy`, ...); their modules have other names, so no function
shadows its module: `mxjax.quantization` (quantize, dequantize, fake_quantize,
MXArray, and the recipe forms quantize_with, ...), `mxjax.elements` (element
grids), `mxjax.scaling` (the scaling schemes), `mxjax.operand_recipe`
(OperandRecipe), `mxjax.rotation` (hadamard, signs), `mxjax.recipes` (OperandRecipe,
Hadamard, GemmRecipe), `mxjax.policies` (PrecisionPolicy, presets,
dot_general), `mxjax.dimensions` (dimension numbers), `mxjax.backends` (the routes' registry:
which route runs a GEMM on a chip), `mxjax.gemm` (one GEMM under a recipe),
`mxjax.interceptor` (the custom-VJP engine), `mxjax.shard_blocks` (whether a mesh keeps
every quantization block on one device: check_linear_shards),
`mxjax.diagnostics`
(GEMM statistics and probes). The old module paths `mxjax.quantize`,
`mxjax.hadamard`, `mxjax.dot_general`, `mxjax.policy` no longer exist as
modules (they are the functions), and training dynamics moved from
`mxjax.diagnostics` to `train.diagnostics.dynamics`.
"""

from mxjax import diagnostics, formats, policies
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
from mxjax.shard_blocks import check_linear_shards, linear_shard_problems

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
    "check_linear_shards",
    "dequantize",
    "diagnostics",
    "dot_general",
    "fake_quantize",
    "fixed_signs",
    "formats",
    "hadamard",
    "linear_shard_problems",
    "policies",
    "quantize",
    "random_signs",
]


def __getattr__(name):
    # `mxjax.nn` / `mxjax.kernels` without an explicit import (they pull in flax / Pallas).
    if name in ("nn", "kernels"):
        import importlib

        return importlib.import_module(f"mxjax.{name}")
    raise AttributeError(f"module 'mxjax' has no attribute {name!r}")
