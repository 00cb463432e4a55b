"""FP8 GEMMs on FP8 tensor cores: the CUDA form of the emulated GEMM for FP8 recipes.

Two recipes run with f8 operands when lowered for ``cuda`` (`mxjax.gemm` decides, per
lowering platform, with ``jax.lax.platform_dependent``; nothing is read from the
tracing host):

* **per-tensor FP8** (the ``fp8`` preset: E4M3 / E5M2, current scaling): each operand's
  values on the element grid (``fake_quantize_parts``, per-tensor factor left out) are
  cast to ``float8_e4m3fn`` / ``float8_e5m2`` (exact: they are on that grid), one
  ``dot_general`` f8 x f8 with ``preferred_element_type=f32``, and the two tensor
  scales applied to the f32 result. This is the pattern XLA rewrites into an FP8 GEMM
  under both of its GEMM paths (a Triton f8 fusion, or ``__cublas$lt$matmul$f8`` with
  ``xla_gpu_enable_triton_gemm=false``), GEMMs it merges (q|k|v, gate|up) included.
  The rounding is done by mxjax's arithmetic, before the cast; the cast only changes
  the type, so no f32 -> f8 -> bf16 round trip exists for XLA to fold. Per-tensor
  scaling does not depend on the layout, so operands are quantized where they are
  (no transpose into the canonical layout) unless the recipe rotates or rounds
  stochastically (then the canonical operands, as every other form).
* **MXFP8** (E4M3 / E5M2 elements, E8M0 scales per 32): the canonical operands are
  quantized by mxjax's own quantizer and handed, bit for bit, to
  ``jax.nn.scaled_matmul`` as f8 elements and ``float8_e8m0fnu`` scales. XLA lowers
  that call per chip at compile time: on Blackwell (B200) to cuDNN's block-scaled
  MMA (``__cudnn$blockScaledDot``); on Hopper (H100/H200), which has no block-scaled
  MMA, XLA expands it into a dequantize and an f32 GEMM (docs/NUMERICS.md).

Values: the operands are bit-identical to `mxjax.quantize`'s (tested against
ml_dtypes); the GEMM's result differs from the CPU emulation by summation order and,
on Hopper tensor cores, by the MMA's reduced-precision accumulation
(docs/NUMERICS.md, "FP8 GEMMs on FP8 tensor cores", states the bound).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mxjax.quantization import fake_quantize_parts_with, quantize_with
from mxjax.scaling import SR_UNSCALE

__all__ = [
    "F8_DTYPES",
    "block_scaled_dot",
    "block_scaled_operand",
    "f8_dot",
    "f8_operand",
    "takes_block_scaled",
    "takes_f8_operands",
]

# Element format name -> the f8 dtype whose values are exactly that grid (OCP FP8).
F8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
_MX_BLOCK = 32


def _per_tensor_f8(op) -> bool:
    return op.fmt.is_per_tensor and op.fmt.element.name in F8_DTYPES


def _mx_f8(op) -> bool:
    return (op.fmt.scale == "e8m0" and op.fmt.block_size == _MX_BLOCK
            and op.fmt.element.name in F8_DTYPES)


def takes_f8_operands(recipe) -> bool:
    """Whether both operands of the GEMM recipe are per-tensor FP8 (E4M3 / E5M2)."""
    return _per_tensor_f8(recipe.lhs) and _per_tensor_f8(recipe.rhs)


def takes_block_scaled(recipe) -> bool:
    """Whether both operands are MXFP8 (E4M3 / E5M2 elements, E8M0 scales per 32)."""
    return _mx_f8(recipe.lhs) and _mx_f8(recipe.rhs)


def f8_operand(x: jax.Array, op, key) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """One per-tensor FP8 operand as f8 values and its f32 factors.

    Args:
      x: the operand (any layout: the tensor scale is the amax of all of it).
      op: its OperandRecipe (per-tensor FP8).
      key: the rounding key (stochastic rounding) or None.
    Returns:
      ``(q, factors)``: ``q`` of dtype ``F8_DTYPES[element]`` holding
      ``fake_quantize_parts``' values exactly, and the factors (tensor scale, then the
      SR 4/3 unscale if any) whose product with ``q`` is ``fake_quantize``'s value.
    """
    if not _per_tensor_f8(op):
        raise ValueError(f"op: expected a per-tensor FP8 operand recipe, got {op!r}")
    values, tensor_scale = fake_quantize_parts_with(x, op, -1, key=key)
    factors = (tensor_scale,)
    if op.sr_prescale:
        factors += (jnp.float32(SR_UNSCALE),)
    return values.astype(F8_DTYPES[op.fmt.element.name]), factors


def f8_dot(a: jax.Array, b: jax.Array, dimension_numbers, a_factors, b_factors) -> jax.Array:
    """``dot_general(a, b)`` of f8 operands accumulated in f32, times the factors.

    The factors are applied to the f32 result one multiply each, lhs's then rhs's (as
    the bf16 accelerator form does). Precision HIGHEST asks XLA for its most precise f8
    accumulation (it stays an FP8 GEMM under both GEMM paths; what the tensor cores then
    accumulate in is docs/NUMERICS.md's device bound).
    """
    out = lax.dot_general(a, b, dimension_numbers, precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
    for factor in tuple(a_factors) + tuple(b_factors):
        out = out * factor
    return out


def block_scaled_operand(x3: jax.Array, op, key) -> tuple[jax.Array, jax.Array]:
    """A canonical operand quantized to MXFP8 by `mxjax.quantize`, as scaled_matmul takes it.

    Args:
      x3: f32 ``[batch..., F, K]`` (the canonical layout, contraction last).
      op: its OperandRecipe (MXFP8).
      key: the rounding key (stochastic rounding) or None.
    Returns:
      ``(elements, scales)``: ``[B, F, Kp]`` of the f8 dtype whose bits are mxjax's
      element codes and ``[B, F, Kp / 32]`` ``float8_e8m0fnu`` whose bits are mxjax's
      scale bytes (B the product of the batch axes, Kp K padded to 32 with zeros).
    """
    if not _mx_f8(op):
        raise ValueError(f"op: expected an MXFP8 operand recipe, got {op!r}")
    q = quantize_with(x3, op, -1, key=key)
    f, kp = q.codes.shape[-2:]
    codes = q.codes.reshape(-1, f, kp)
    scales = q.scales.reshape(-1, f, kp // _MX_BLOCK)
    return (lax.bitcast_convert_type(codes, F8_DTYPES[op.fmt.element.name]),
            lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu))


def block_scaled_dot(a3: jax.Array, b3: jax.Array, recipe, k_lhs, k_rhs) -> jax.Array:
    """The MXFP8 GEMM of canonical operands by ``jax.nn.scaled_matmul``: f32 ``[batch..., Fa, Fb]``.

    Times the SR 4/3 unscale of each operand that has it.
    """
    if not takes_block_scaled(recipe):
        raise ValueError(f"recipe: expected MXFP8 operands, got {recipe!r}")
    ae, asc = block_scaled_operand(a3, recipe.lhs, k_lhs)
    be, bsc = block_scaled_operand(b3, recipe.rhs, k_rhs)
    out = jax.nn.scaled_matmul(ae, be, asc, bsc, preferred_element_type=jnp.float32)
    for op in (recipe.lhs, recipe.rhs):
        if op.sr_prescale:
            out = out * jnp.float32(SR_UNSCALE)
    return out.reshape(a3.shape[:-2] + (a3.shape[-2], b3.shape[-2]))
