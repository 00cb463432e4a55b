"""Backend 'xla': the emulation (`mxjax.emulation`), on every chip and every format.

Quantize, dequantize, one ``dot_general`` with f32 accumulation, in the form of the
platform lowered for (`mxjax.emulation.forms`). The reference every other route is
tested against, and 'auto''s choice wherever no route is faster.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mxjax.chips import Chip
from mxjax.emulation.forms import emulated_gemm, emulated_packed_rhs_gemm, emulation_packs_rhs
from mxjax.layout import canonical_dimension_numbers
from mxjax.quantization import MXArray, dequantize
from mxjax.routes.spec import Route

__all__ = ["ROUTE", "packed_dot"]


def _gemm(a, b, *, dims, recipe, key, gemm_name, operand_dtypes=None, out_dtype=None,
          platform=None) -> jax.Array:
    del platform  # one program for every platform: lax.platform_dependent inside
    return emulated_gemm(a, b, dims, recipe, key, gemm_name, operand_dtypes, out_dtype)


def _packed_rhs_gemm(a, packed_q, *, b_shape, dims, recipe, key, gemm_name,
                     operand_dtypes=None, out_dtype=None, platform=None) -> jax.Array:
    del gemm_name  # the emulation's form does not depend on it (its CUDA FP8 form packs none)
    return emulated_packed_rhs_gemm(a, packed_q, tuple(b_shape), dims, recipe, key,
                                    operand_dtypes, out_dtype, platform)


def packed_dot(lhs_q: MXArray, rhs_q: MXArray, *, platform=None, **tiles) -> jax.Array:
    """The exact dot of the dequantized operands at HIGHEST, f32 accumulation (any
    quantized format; 2-D, or batched ``[batch..., F, K]`` blocked along K)."""
    del platform, tiles
    if len(lhs_q.shape) > 2:
        nbatch = len(lhs_q.shape) - 2
        return lax.dot_general(dequantize(lhs_q, jnp.float32), dequantize(rhs_q, jnp.float32),
                               canonical_dimension_numbers(nbatch),
                               precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    from mxjax.kernels.reference import mx_dot_reference  # the kernels load on first use

    return mx_dot_reference(lhs_q, rhs_q)


def _runs_on(chip: Chip) -> str:
    del chip
    return ""


ROUTE = Route(
    name="xla",
    summary="the emulation: quantize, dequantize, dot_general with f32 accumulation",
    formats=None,
    runs_on=_runs_on,
    gemm=_gemm,
    packed_dot=packed_dot,
    evidence=("layer_8b.h200.measured", "layer_8b.h200.rates_roofline",
              "layer_8b.b200.rates_roofline", "gemm_8192.h200.measured"),
    packed_rhs_gemm=_packed_rhs_gemm,
    packs_rhs=emulation_packs_rhs,
)
