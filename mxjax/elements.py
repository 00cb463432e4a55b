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
    "round_to_grid",
    "round_to_value",
    "signed_value",
]


def _round_integer(y, elem: ElementFormat, mode: Rounding, u):
    """(sign bits uint32, unsaturated integer multiple n f32, exponent E int32) of y."""
    bits = _bits.f32_bits(y)
    a = _bits.bits_f32(bits & _bits.ABS_MASK)
    e = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127
    big_e = jnp.clip(e, elem.emin, elem.emax)
    t = a * _bits.pow2(elem.mbits - big_e)  # exact: power-of-two scaling of a normal
    # floor/compare forms only (t >= 0): lax.round has no Pallas-Triton lowering.
    fl = jnp.floor(t)
    fr = t - fl  # exact
    if mode is Rounding.NEAREST_EVEN:
        odd = (fl - 2.0 * jnp.floor(fl * 0.5)) == 1.0
        n = fl + ((fr > 0.5) | ((fr == 0.5) & odd)).astype(jnp.float32)
    elif mode is Rounding.NEAREST_AWAY:
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
    sign_bits, n, big_e = _round_integer(y, elem, mode, u)
    # Saturate before the int conversion (huge t for values far above max).
    n = jnp.minimum(n, float(2 ** (elem.mbits + 2)))
    code = n.astype(jnp.int32) + ((big_e - elem.emin) << elem.mbits)
    return sign_bits >> 31, jnp.minimum(code, elem.max_code)


def round_to_value(
    y: jnp.ndarray, elem: ElementFormat, mode: Rounding, u: jnp.ndarray | None = None
) -> jnp.ndarray:
    """Like `round_to_grid`, but returns the signed f32 grid value (no codes)."""
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
