"""Element level: rounding an f32 value onto an element grid, and decoding element codes.

Pure, elementwise ``jnp`` built on ``mxjax._bits``; shared by the quantizer's
scaling schemes (``mxjax.scaling``) and by the Pallas kernels, so a kernel
performs exactly the reference's operations. See docs/NUMERICS.md.
"""

from __future__ import annotations

import jax.numpy as jnp

from mxjax import _bits
from mxjax.formats import ElementFormat, Rounding, ScaleRule

__all__ = [
    "decode_magnitude",
    "e8m0_exponent",
    "encode",
    "nearest_even_code",
    "nearest_even_value",
    "round_to_grid",
    "round_to_value",
    "signed_value",
]

_EXP_MASK = 0x7F800000


def _nearest_even_addend(bits, elem: ElementFormat, s):
    """int32 bits of C = 2^(E - mbits + 23), E = clip(floor(log2|y|), emin + s, emax + s).

    The grid step at |y| on `elem`'s grid scaled by 2^s is q = 2^(E - mbits), so C = q *
    2^23 > |y| (below saturation) and the f32 sum ``|y| + C`` rounds |y| to a multiple of
    q, ties to even: the sum's last significand bit is worth q. C's exponent field is y's
    plus 23 - mbits, clipped (int32: Mosaic has signed max/min only); the lower bound never
    below the field of 2^-127 (an f32 subnormal |y|, field 0, rounds as at E = -127).
    """
    offset = 23 - elem.mbits
    if isinstance(s, int):
        lo = (max(s + elem.emin + 127, 0) + offset) << 23
    else:
        lo = (jnp.maximum(s + (elem.emin + 127), 0) + offset) << 23
    hi = (s + (elem.emax + 127 + offset)) << 23
    field = (bits & _EXP_MASK).astype(jnp.int32) + (offset << 23)
    return jnp.clip(field, lo, hi)


def nearest_even_value(y: jnp.ndarray, elem: ElementFormat, s=0) -> jnp.ndarray:
    """`y` rounded to nearest, ties to even, on `elem`'s grid scaled by 2^s, saturated.

    The one round-to-nearest-even of the library's f32 forms: the f32 addition ``(|y| +
    C) - C`` rounds (`_nearest_even_addend`; the subtraction is exact), then a min
    saturates at max_normal * 2^s and y's sign is put back (-0 stays -0). Exact for |y|
    zero or a normal f32; a subnormal |y| is exact too where f32 arithmetic keeps
    subnormals, and on the grid at s = 0 rounds to zero either way. NaN stays NaN.

    Args:
      y: f32 array.
      elem: element format.
      s: int32 scale exponents broadcastable to y (one per block), or a Python int; C must
        stay a normal f32: s <= 104 - emax + mbits.
    Returns:
      f32 like y.
    """
    bits = _bits.f32_bits(y)
    a = bits & _bits.ABS_MASK
    c = _bits.bits_f32(_nearest_even_addend(bits, elem, s).astype(jnp.uint32))
    if isinstance(s, int):
        saturated = jnp.float32(elem.max_normal * 2.0**s)
    else:
        frac = round((elem.max_mantissa - 1.0) * 2**23)
        saturated = _bits.bits_f32(((s + (elem.emax + 127)) << 23) | frac)
    mag = jnp.minimum((_bits.bits_f32(a) + c) - c, saturated)
    return _bits.bits_f32(_bits.f32_bits(mag) | (bits ^ a))


def nearest_even_code(y: jnp.ndarray, elem: ElementFormat) -> tuple[jnp.ndarray, jnp.ndarray]:
    """`round_to_grid(y, elem, NEAREST_EVEN)`: (sign uint32 0/1, magnitude code int32).

    The same f32 addition as `nearest_even_value` (s = 0), read as an integer: the sum's
    bits less C's are the number n of grid steps q (the bits of non-negative floats are
    ordered as their values), and the code is ``n + ((E - emin) << mbits)`` (n counts
    the implicit leading one of a normal), capped at max_code. Past the top, Inf and NaN
    included, n is larger still and the code max_code all the same.
    """
    bits = _bits.f32_bits(y)
    a = bits & _bits.ABS_MASK
    c = _nearest_even_addend(bits, elem, 0)
    total = _bits.bits_f32(a) + _bits.bits_f32(c.astype(jnp.uint32))
    n = _bits.f32_bits(total).astype(jnp.int32) - c
    # C's bits shifted by 23 - mbits are E's biased field << mbits (its low bits are 0).
    code = n + (c >> (23 - elem.mbits)) - ((elem.emin + 150 - elem.mbits) << elem.mbits)
    return bits >> 31, jnp.minimum(code, elem.max_code)


def _round_integer(y, elem: ElementFormat, mode: Rounding, u):
    """(sign bits uint32, unsaturated integer multiple n f32, exponent E int32) of y, for
    every rounding except to nearest even (that one is `nearest_even_code` and
    `nearest_even_value`)."""
    bits = _bits.f32_bits(y)
    a = _bits.bits_f32(bits & _bits.ABS_MASK)
    e = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127
    big_e = jnp.clip(e, elem.emin, elem.emax)
    t = a * _bits.pow2(elem.mbits - big_e)  # exact: power-of-two scaling of a normal
    # floor/compare forms only (t >= 0): lax.round has no Pallas-Triton lowering.
    fl = jnp.floor(t)
    fr = t - fl  # exact
    if mode is Rounding.NEAREST_AWAY:
        n = fl + (fr >= 0.5).astype(jnp.float32)
    elif mode is Rounding.TOWARD_ZERO:
        n = fl
    elif mode is Rounding.STOCHASTIC:
        if u is None:
            raise ValueError("u: STOCHASTIC rounding needs uniform random numbers")
        n = fl + (u < fr).astype(jnp.float32)
    else:  # pragma: no cover - enum is closed
        raise ValueError(f"rounding: unsupported {mode!r}")
    return (bits >> 31) << 31, n, big_e


def round_to_grid(
    y: jnp.ndarray, elem: ElementFormat, mode: Rounding, u: jnp.ndarray | None = None
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Rounds finite f32 `y` onto `elem`'s grid, saturating.

    Args:
      y: f32 array, finite; |y| is a normal f32 or zero (smaller values are zero
        after XLA's flush, and would round to zero on every grid anyway).
      elem: element format.
      mode: rounding mode.
      u: f32 uniforms in [0, 1), same shape as y, for STOCHASTIC.
    Returns:
      (sign uint32 0/1, magnitude code int32 in [0, elem.max_code]).
    """
    if mode is Rounding.NEAREST_EVEN:
        return nearest_even_code(y, elem)
    sign_bits, n, big_e = _round_integer(y, elem, mode, u)
    # Saturate before the int conversion (huge t for values far above max).
    n = jnp.minimum(n, float(2 ** (elem.mbits + 2)))
    code = n.astype(jnp.int32) + ((big_e - elem.emin) << elem.mbits)
    return sign_bits >> 31, jnp.minimum(code, elem.max_code)


def round_to_value(
    y: jnp.ndarray, elem: ElementFormat, mode: Rounding, u: jnp.ndarray | None = None
) -> jnp.ndarray:
    """Like `round_to_grid`, but returns the signed f32 grid value (no codes)."""
    if mode is Rounding.NEAREST_EVEN:
        return nearest_even_value(y, elem)
    sign_bits, n, big_e = _round_integer(y, elem, mode, u)
    mag = jnp.minimum(n * _bits.pow2(big_e - elem.mbits), jnp.float32(elem.max_normal))
    return _bits.bits_f32(_bits.f32_bits(mag) | sign_bits)


def decode_magnitude(code: jnp.ndarray, elem: ElementFormat) -> jnp.ndarray:
    """f32 magnitude of an element code (sign bit ignored); exact."""
    mag = code.astype(jnp.int32) & (elem.sign_bit - 1)
    field = mag >> elem.mbits
    mant = mag & ((1 << elem.mbits) - 1)
    is_sub = field == 0
    n = jnp.where(is_sub, mant, mant + (1 << elem.mbits)).astype(jnp.float32)
    exp = jnp.where(is_sub, elem.emin, field - 1 + elem.emin) - elem.mbits
    return n * _bits.pow2(exp)


def e8m0_exponent(amax_bits: jnp.ndarray, elem: ElementFormat, rule: ScaleRule) -> jnp.ndarray:
    """Unclamped-then-clamped E8M0 scale exponent from the block amax's abs bits.

    Args:
      amax_bits: uint32 abs bits of the (finite, nonzero) block amax.
    Returns:
      int32 exponent s in [-127, 127]; scale = 2^s.
    """
    exp, frac = _bits.normalize(amax_bits)
    e = exp - 127
    if rule is ScaleRule.FLOOR:
        bump = jnp.zeros_like(e)
    elif rule is ScaleRule.EVEN:
        # m rounded (ties away) to mbits reaches 2  <=>  m >= 2 - 2^-(mbits+1)
        threshold = (1 << 23) - (1 << (23 - elem.mbits - 1))
        bump = (frac >= threshold).astype(jnp.int32)
    elif rule is ScaleRule.CEIL:
        bump = (frac > 0).astype(jnp.int32)
    elif rule is ScaleRule.RCEIL:
        threshold = elem.max_mantissa_code << (23 - elem.mbits)
        bump = (frac > threshold).astype(jnp.int32)
    else:  # pragma: no cover
        raise ValueError(f"scale_rule: unsupported {rule!r}")
    return jnp.clip(e - elem.emax + bump, -127, 127)


def encode(sign: jnp.ndarray, code: jnp.ndarray, elem: ElementFormat) -> jnp.ndarray:
    """uint8 element code from a sign (0/1) and a magnitude code (`round_to_grid`)."""
    return (code | (sign.astype(jnp.int32) * elem.sign_bit)).astype(jnp.uint8)


def signed_value(code: jnp.ndarray, elem: ElementFormat) -> jnp.ndarray:
    """Signed f32 value of element codes (sign bit included); exact."""
    mag = decode_magnitude(code, elem)
    neg = (code.astype(jnp.int32) & elem.sign_bit) != 0
    return jnp.where(neg, -mag, mag)
