"""MXFP4 (E2M1 x E8M0) values by integer rounding of the f32 bit pattern.

`fake_quantize` of an E2M1 block with scale 2^s is ``round(x / 2^s) * 2^s``: x
rounded onto the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} * 2^s, saturated at 6 * 2^s.
The generic path (`mxjax.scaling.E8M0Blocks`) scales, rounds and scales back
with integer ``ldexp`` so that XLA:CPU's denormals-are-zero cannot lose a
subnormal; this module rounds x where it is instead, as an integer:

* the grid step at x is 2^g with g = max(e, s) - 1 (e = floor(log2 |x|); below 2^s
  the E2M1 subnormals' step 2^(s-1)), and x's last significand bit is worth
  2^(max(f, 1) - 150) (f the biased exponent field, 0 for f32 subnormals), so
  rounding x to the grid drops ``shift = max(f - 127, s) + 149 - max(f, 1)`` low
  bits of its bit pattern (at least 21);
* with ``shift <= 23`` the dropped bits lie in the significand field, and adding
  half a step (minus one, plus the lowest kept significand bit, for ties to even)
  before masking rounds the bit pattern as the value: a carry into the exponent
  field is the value reaching the next binade, and f32 subnormals round the same way;
* ``shift == 24`` is |x| in [2^(g-1), 2^g): 0 or 2^g (ties to even: 0);
  ``shift > 24`` is |x| below half a step: 0;
* saturation is a min on the bits (magnitudes order like their bit patterns).

Integer operations only: the same values on every platform, whatever it does
with subnormals, and about half the operations of the generic path on XLA:CPU. This is
the library's second round to nearest even, kept because the first
(`mxjax.elements.nearest_even_value`, an f32 addition) cannot round an x that is itself
an f32 subnormal where arithmetic flushes subnormals (XLA:CPU), and this path must be
exact there; tests/mxjax/test_nearest_even.py holds the two to each other and to ml_dtypes.
Deterministic roundings only (stochastic rounding draws against the scaled
element, `mxjax.elements`); tested bit for bit against the generic path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxjax import _bits
from mxjax.formats import Rounding

__all__ = ["ROUNDINGS", "applies", "e2m1_values"]

# The roundings this path implements (the deterministic ones).
ROUNDINGS = (Rounding.NEAREST_EVEN, Rounding.NEAREST_AWAY, Rounding.TOWARD_ZERO)
_FRAC_MASK = 0x7FFFFF


def applies(recipe) -> bool:
    """Whether `e2m1_values` computes `recipe`'s values (E2M1 elements, E8M0 scales,
    a deterministic rounding)."""
    fmt = recipe.fmt
    return (not fmt.is_passthrough and fmt.scale == "e8m0" and fmt.element.name == "e2m1"
            and recipe.rounding in ROUNDINGS)


def e2m1_values(x: jax.Array, s: jax.Array, nonfinite: jax.Array,
                rounding: Rounding) -> jax.Array:
    """f32 ``fake_quantize`` values of E2M1 blocks with E8M0 scales 2^s.

    Args:
      x: f32 elements, any shape.
      s: int32 scale exponents in [-127, 125], broadcastable to x (one per block).
      nonfinite: bool like s: the block held NaN or Inf (its values become NaN).
      rounding: one of `ROUNDINGS`.
    Returns:
      f32 like x: x rounded onto {0, 0.5, 1, 1.5, 2, 3, 4, 6} * 2^s (sign kept,
      -0 stays -0), saturated at 6 * 2^s; NaN where `nonfinite`.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding: expected one of {[r.name for r in ROUNDINGS]}, "
                         f"got {rounding!r}")
    bits = _bits.f32_bits(x)
    a = bits & _bits.ABS_MASK
    f = (a >> 23).astype(jnp.int32)
    s = jnp.asarray(s, jnp.int32)
    shift = jnp.maximum(f - 127, s) + 149 - jnp.maximum(f, 1)
    sh = jnp.minimum(shift, 23).astype(jnp.uint32)
    mask = (jnp.uint32(1) << sh) - 1
    if rounding is Rounding.NEAREST_EVEN:
        # Ties to even: the parity of the lowest kept significand bit (at shift 23 that is
        # the implicit leading one of a normal x, not the exponent field's lowest bit).
        significand = (a & _FRAC_MASK) | (jnp.minimum(f, 1).astype(jnp.uint32) << 23)
        rounded = (a + (mask >> 1) + ((significand >> sh) & 1)) & ~mask
        up = (f != 0) & ((a & _FRAC_MASK) != 0)  # shift 24: above the midpoint 2^(g-1)
    elif rounding is Rounding.NEAREST_AWAY:
        rounded = (a + (mask >> 1) + 1) & ~mask
        up = f != 0  # shift 24: at or above the midpoint
    else:
        rounded = a & ~mask
        up = jnp.zeros(f.shape, bool)
    step = ((f + 1) << 23).astype(jnp.uint32)  # 2^g for shift 24 (f = g + 126)
    rounded = jnp.where(shift <= 23, rounded,
                        jnp.where((shift == 24) & up, step, jnp.uint32(0)))
    saturated = (((s + 129) << 23) | 0x400000).astype(jnp.uint32)  # 6 * 2^s = 1.5 * 2^(s+2)
    out = jnp.minimum(rounded, saturated) | ((bits >> 31) << 31)
    return jnp.where(nonfinite, jnp.float32(jnp.nan), _bits.bits_f32(out))
