"""One-pass Pallas quantize into an exact FP8 carrier: the 'xla_fp8' route's operand by kernel.

`fp8_operand` runs `fused_quantize` (rotation, amax, scale, rounding and packing in one
read; ``value_dtype=float32``: the GEMMs' f32 canonical values) and decodes its codes and
scale bytes into ``q * 2^(s - t)`` in the carrier: the same values, shift and window flag
as `mxjax.routes.xla_fp8`'s XLA form (tested bit for bit). Not the route's default:
on an H200 (jax 0.11.2, Pallas' Triton backend) the kernel ran at 75 GB/s (row-wise) and
22 GB/s (column-wise) of bf16 input against 224 GB/s for XLA's two passes
(bench/gpu_probe_xla_fp8.py, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxjax import _bits
from mxjax.kernels.pallas_quantize import QuantSpec, fused_quantize
from mxjax.routes import xla_fp8 as M

__all__ = ["fp8_operand"]

MX_BLOCK = 32


def _e2m1_values(codes: jax.Array) -> jax.Array:
    """f32 values of 4-bit E2M1 codes (uint8, one code per element)."""
    mag = (codes & 7).astype(jnp.int32)
    e, m = mag >> 1, (mag & 1).astype(jnp.float32)
    v = jnp.where(e == 0, m * 0.5, (1.0 + m * 0.5) * _bits.pow2(jnp.maximum(e, 1) - 1))
    return jnp.where((codes & 8) != 0, -v, v)


def _unpack(packed: jax.Array, axis: int) -> jax.Array:
    """uint8 codes two per byte along `axis` (the first in the low nibble) -> one per byte."""
    pair = jnp.stack([packed & 15, packed >> 4], axis=axis + 1)
    shape = list(packed.shape)
    shape[axis] *= 2
    return pair.reshape(shape)


def fp8_operand(x2: jax.Array, axis: int, op, *, hadamard_size: int | None, signs, key,
                carrier: M.Carrier, interpret: bool = False):
    """One 2-D operand by the one-pass Pallas quantizer, carried in FP8.

    ``mxjax.kernels.fused_quantize`` (rotation, block amax, scale, rounding and packing in
    one read of ``x2``, the f32 values of the GEMMs' canonical operands) writes the codes
    and scale bytes; one elementwise pass turns them into ``q * 2^(s - t)`` in the
    carrier. The codes and scales are `mxjax.quantize`'s bit for bit (the kernel's
    tests), so the values are the emulation's.

    Args:
      x2: ``[R, K]`` (axis 1) or ``[K, C]`` (axis 0), K a multiple of the Hadamard size.
      axis: the contraction axis (0 or 1).
      op: the OperandRecipe (MXFP4).
      hadamard_size, signs: the rotation, or None.
      key: the rounding key (stochastic rounding) or None.
      carrier: the FP8 format.
      interpret: run the kernel in the Pallas interpreter (CPU tests).
    Returns:
      ``(q, (t, exact))``: q of the carrier's dtype, x2's shape with K padded to 32.
    """
    spec = QuantSpec(recipe=op, hadamard=hadamard_size)
    kw = {"row": spec, "row_signs": signs, "row_key": key} if axis == 1 else {
        "col": spec, "col_signs": signs, "col_key": key}
    row_q, col_q = fused_quantize(x2, interpret=interpret, value_dtype=jnp.float32, **kw)
    q = row_q if axis == 1 else col_q
    codes = _unpack(q.codes, axis)
    scale = q.scales.astype(jnp.int32)
    s = jnp.repeat(scale, MX_BLOCK, axis=axis) - 127
    nonzero = jnp.max((q.codes & 0x77).reshape(_blocks_shape(q.codes.shape, axis)),
                      axis=axis + 1) != 0
    t, exact = M.window_of_exponents(scale - 127, nonzero & (scale != 255), carrier)
    shift = jnp.clip(s - t, -126, 127)
    v = _e2m1_values(codes) * _bits.pow2(shift)
    v = jnp.where(jnp.repeat(scale == 255, MX_BLOCK, axis=axis), jnp.nan, v)
    return v.astype(carrier.dtype), (t, exact)


def _blocks_shape(packed_shape, axis: int):
    """The packed codes' shape with `axis` split into (blocks, 16 bytes)."""
    shape = list(packed_shape)
    nb = shape[axis] // (MX_BLOCK // 2)
    return tuple(shape[:axis]) + (nb, MX_BLOCK // 2) + tuple(shape[axis + 1:])
