"""Backend 'triton': MXFP4 x MXFP4 on Triton's ``tl.dot_scaled`` through jax-triton.

The operands are quantized canonically (`mxjax.quantize`: packed E2M1 codes, E8M0
scales) and contracted by the Triton kernel (`mxjax.kernels.triton_gemm`): native
block-scaled FP4 MMA on Blackwell (``tcgen05.mma ... kind::mxf4``). The route of the
``gpu`` extra (jax-triton pins jax 0.11.x); never 'auto''s choice. The kernels load on
first use.
"""

from __future__ import annotations

import jax
from jax import lax

from mxjax.chips import Chip
from mxjax.emulation.in_place import cast_operands
from mxjax.operands import canonical_operands, quantizer_operands
from mxjax.quantization import MXArray, quantize_with
from mxjax.routes.spec import NO_GPU_TARGET, Route

__all__ = ["ROUTE", "packed_dot"]


def packed_dot(lhs_q: MXArray, rhs_q: MXArray, *, platform=None, **tiles) -> jax.Array:
    """f32 dot of two MXFP4 MXArrays by the Triton kernel; batched ``[batch..., F, K]``
    operands run one GEMM per batch element (``lax.map``: jax-triton has no batching
    rule). ``tiles``: block_m / block_n / block_k overrides."""
    del platform
    from mxjax.kernels.triton_gemm import (  # the kernels load on first use
        mxfp4_dot_triton,
        mxfp4_matmul_triton,
    )

    if len(lhs_q.shape) == 2:
        return mxfp4_dot_triton(lhs_q, rhs_q, **tiles)
    batch = lhs_q.shape[:-2]
    m, n = lhs_q.shape[-2], rhs_q.shape[-2]

    def flat(x):
        return x.reshape((-1,) + x.shape[-2:])

    def one(t):
        ac, asc, bc, bsc = t
        return mxfp4_matmul_triton(ac, asc, bc.T, bsc.T, m=m, n=n, **tiles)

    args = (flat(lhs_q.codes), flat(lhs_q.scales), flat(rhs_q.codes), flat(rhs_q.scales))
    return lax.map(one, args).reshape(batch + (m, n))


def _gemm(a, b, *, dims, recipe, key, gemm_name, operand_dtypes=None, out_dtype=None,
          platform=None) -> jax.Array:
    del gemm_name
    a, b = cast_operands(a, b, operand_dtypes)
    a3, b3, k_lhs, k_rhs = quantizer_operands(*canonical_operands(a, b, dims), recipe, key)
    out = packed_dot(quantize_with(a3, recipe.lhs, -1, key=k_lhs),
                     quantize_with(b3, recipe.rhs, -1, key=k_rhs), platform=platform)
    return out if out_dtype is None else out.astype(out_dtype)


def _runs_on(chip: Chip) -> str:
    if chip.platform != "gpu":
        return f"needs a GPU target (compiling for {chip.platform!r})"
    if not chip.device_kind:
        return NO_GPU_TARGET
    if chip.is_amd:
        return f"the Triton GEMM kernel is built for NVIDIA GPUs, not {chip.device_kind!r}"
    from mxjax.kernels.triton_gemm import unavailable_reason  # the kernels: on first use

    return unavailable_reason(chip.platform) or ""


ROUTE = Route(
    name="triton",
    summary="MXFP4 on Triton's tl.dot_scaled (native FP4 MMA on Blackwell), jax-triton",
    formats=("mxfp4",),
    runs_on=_runs_on,
    gemm=_gemm,
    packed_dot=packed_dot,
    evidence=("layer_8b.b200.triton_rates_roofline",),
)
