"""MX (E8M0) block values with f32 power-of-two scalings: the arithmetic of the accelerator forms.

`mxjax.scaling.E8M0Blocks` scales by integer ``ldexp`` so that XLA:CPU's
denormals-are-zero cannot lose a subnormal. On GPUs and TPUs the emulated GEMM
(`mxjax.emulation.in_place`) scales with f32 multiplies by 2^-s and 2^s instead: far
fewer operations, which lets XLA fuse the rotation, the amax and the rounding
into two passes, and the same values wherever f32 arithmetic keeps subnormals
(GPUs; tested against exact ``ldexp`` in numpy). Where it flushes them (TPUs,
XLA:CPU) only blocks whose values are f32 subnormals differ (block amax below
2^-121, docs/NUMERICS.md). The scales themselves are the scheme's
(`E8M0Blocks.exponents`), for blocks in any layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxjax import _bits
from mxjax.elements import nearest_even_value, round_to_value
from mxjax.formats import Rounding
from mxjax.scaling import SR_PRESCALE

__all__ = ["nearest_even_values", "values_from_amax"]

_MIN_NORMAL = 2.0 ** -126
# Blocks with a scale exponent above this are rounded at 2^-_BIG_SHIFT times their
# size (`nearest_even_values`' constant C would overflow f32 above about 2^104).
_BIG_SHIFT = 64


def values_from_amax(r: jax.Array, amax_bits: jax.Array, op, u: jax.Array | None) -> jax.Array:
    """f32 MX values (per-tensor factors left out) of f32 elements `r` of blocks.

    Args:
      r: f32 elements (rotated, if the GEMM rotates), any layout.
      amax_bits: uint32 abs bits of each element's block amax, broadcastable to r.
      op: the OperandRecipe (an E8M0 format).
      u: f32 uniforms like r for stochastic rounding, else None.
    Returns:
      f32 like r: ``fake_quantize_parts``' values of these blocks (dtype f32).
    """
    elem = op.fmt.element
    s, nonfinite = op.scheme.exponents(amax_bits, op.scale_rule, op.sr_prescale)
    # r * 2^-s: exact (2^-s is normal for s in [-127, 125]) wherever the result is
    # normal. A smaller result rounds to zero on every element grid, except under
    # stochastic rounding (a draw of exactly 0 rounds it up): there it is made zero,
    # as XLA:CPU's denormals-are-zero makes the integer ldexp's subnormal result.
    # A non-finite block's elements are rounded too (no trap) and replaced by NaN.
    y = r * _bits.pow2(-s)
    if op.sr_prescale:
        y = y * jnp.float32(SR_PRESCALE)
    if op.rounding is Rounding.STOCHASTIC:
        tiny = jnp.abs(y) < jnp.float32(_MIN_NORMAL)
        y = jnp.where(tiny | nonfinite, jnp.copysign(jnp.float32(0.0), y), y)
        q = round_to_value(y, elem, op.rounding, u)
    else:
        q = round_to_value(y, elem, op.rounding, None)
    # q * 2^s: exact wherever representable (q has at most 4 significant bits); 2^-127
    # is not a normal f32, so s = -127 is a halving of q and then 2^-126.
    half = jnp.where(s < -126, jnp.float32(0.5), jnp.float32(1.0))
    v = (q * half) * _bits.pow2(jnp.maximum(s, -126))
    return jnp.where(nonfinite, jnp.float32(jnp.nan), v)


def nearest_even_values(x: jax.Array, amax_bits: jax.Array, op, *,
                        prescale: float = 1.0) -> jax.Array:
    """`values_from_amax(x * prescale, amax_bits, op, None)` for round-to-nearest-even.

    The same values in fewer elementwise operations (the TPU kernel's form): x is
    rounded where it is, on the grid scaled by 2^s (`mxjax.elements.nearest_even_value`),
    not scaled by 2^-s and back; E's bounds and the saturation are per block (computed
    once per block, not per element). C stays a normal f32 for s <= 104 - emax + mbits;
    blocks of a larger scale are rounded at 2^-64 times their size and multiplied back
    (exact: powers of two, the results normal).

    ``prescale``: a positive factor applied to x first (the Hadamard's 1/sqrt(h), in
    the same multiply); ``amax_bits`` must be the abs bits of the block amax of ``x *
    prescale`` (e.g. ``f32(amax |x|) * prescale``: f32 rounding is monotone). Where f32
    arithmetic flushes subnormals (TPUs, XLA:CPU), blocks whose values are f32
    subnormals may differ, as for `values_from_amax`.
    """
    if op.rounding is not Rounding.NEAREST_EVEN or op.sr_prescale:
        raise ValueError(f"op: expected round-to-nearest-even without the SR pre-scale, "
                         f"got {op!r}")
    s, nonfinite = op.scheme.exponents(amax_bits, op.scale_rule, op.sr_prescale)
    shift = jnp.where(s > _BIG_SHIFT, _BIG_SHIFT, 0)
    s_in = s - shift  # the scale exponent the block is rounded at, in [-127, 64]
    factor = _bits.pow2(-shift) * jnp.float32(prescale)
    v = nearest_even_value(x * factor, op.fmt.element, s_in) * _bits.pow2(shift)
    return jnp.where(nonfinite, jnp.float32(jnp.nan), v)
