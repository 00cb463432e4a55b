"""Exact fp32 helpers built from integer bit operations.

XLA:CPU flushes fp32 subnormals to zero in float arithmetic (inputs and
outputs). The quantizer must not, so every step whose operands or results can
be subnormal is done here with integer ops. All functions are pure `jnp` and
elementwise, so they also run inside Pallas kernel bodies.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

SIGN_MASK = 0x80000000  # use `(bits >> 31) << 31`: a uint32 array constant breaks Pallas
ABS_MASK = 0x7FFFFFFF
EXP_INF = 0x7F800000  # abs bits >= this: Inf or NaN


def f32_bits(x: jnp.ndarray) -> jnp.ndarray:
    """uint32 bit pattern of an f32 array."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def bits_f32(b: jnp.ndarray) -> jnp.ndarray:
    """f32 array with bit pattern `b` (uint32)."""
    return lax.bitcast_convert_type(b.astype(jnp.uint32), jnp.float32)


def nonzero(x: jnp.ndarray) -> jnp.ndarray:
    """|x| != 0 on the f32 bit pattern (subnormals count as nonzero, NaN too)."""
    return (f32_bits(x) & ABS_MASK) != 0


def pow2(e: jnp.ndarray) -> jnp.ndarray:
    """2.0**e as f32 for integer e in [-126, 127] (normal range), exactly."""
    return bits_f32(((e.astype(jnp.int32) + 127) << 23).astype(jnp.uint32))


def normalize(abs_bits: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Splits |x| (abs bits) into (biased exponent, 23-bit fraction), normalizing subnormals.

    For a subnormal the biased exponent is <= 0 (as if the exponent field could go
    negative), so |x| = 2^(exp-127) * (1 + frac/2^23) holds for every nonzero finite x.
    Zero gives exponent -200 (below anything that matters) and fraction 0.
    """
    abs_bits = abs_bits.astype(jnp.uint32)
    exp = (abs_bits >> 23).astype(jnp.int32)
    frac = abs_bits & 0x7FFFFF
    # Subnormal: value = frac * 2^-149; its leading one is at bit p = floor(log2(frac)),
    # the exponent of float(frac) (exact: frac < 2^23). Not lax.clz: Pallas' GPU (Triton)
    # lowering has no count-leading-zeros.
    p = (f32_bits(frac.astype(jnp.int32).astype(jnp.float32)) >> 23).astype(jnp.int32) - 127
    shift = jnp.clip(23 - p, 0, 31).astype(jnp.uint32)
    sub_frac = (frac << shift) & 0x7FFFFF
    sub_exp = p - 22
    is_sub = exp == 0
    exp = jnp.where(is_sub, jnp.where(frac == 0, -200, sub_exp), exp)
    frac = jnp.where(is_sub, sub_frac, frac)
    return exp, frac


def assemble(sign: jnp.ndarray, exp: jnp.ndarray, frac: jnp.ndarray) -> jnp.ndarray:
    """f32 from sign bit (0/1), biased exponent (may be <= 0) and 23-bit fraction.

    Exponents <= 0 produce the subnormal by a right shift of (1 << 23 | frac); the
    bits shifted out must be zero (true for every use in mxjax: dequantized values
    have at most 4 significant bits and are never below 2^-149). Exponents >= 255
    give Inf. Exponents below -23 give zero.
    """
    sign_bits = sign.astype(jnp.uint32) << 31
    exp = exp.astype(jnp.int32)
    frac = frac.astype(jnp.uint32)
    normal = (jnp.clip(exp, 1, 254).astype(jnp.uint32) << 23) | frac
    sub_shift = jnp.clip(1 - exp, 0, 31).astype(jnp.uint32)
    sub = ((frac | 0x800000) >> sub_shift) & 0x7FFFFF
    sub = jnp.where(exp < -23, jnp.uint32(0), sub)
    out = jnp.where(exp >= 1, normal, sub)
    out = jnp.where(exp >= 255, jnp.uint32(EXP_INF), out)
    return bits_f32(out | sign_bits)


def ldexp(x: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
    """x * 2^k for f32 x (subnormals included) and int32 k, without float ops.

    Exact whenever the result is a normal f32 or the shifted-out bits are zero;
    results below the subnormal range become (signed) zero, results above the
    normal range become Inf. NaN/Inf inputs are returned unchanged.
    """
    bits = f32_bits(x)
    sign = bits >> 31
    abs_bits = bits & ABS_MASK
    exp, frac = normalize(abs_bits)
    out = assemble(sign, exp + k.astype(jnp.int32), frac)
    out = jnp.where(abs_bits == 0, x.astype(jnp.float32), out)
    return jnp.where(abs_bits >= EXP_INF, x.astype(jnp.float32), out)


def ldexp_normal(v: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
    """v * 2^k for f32 v that is a normal number or zero (no NaN/Inf), int32 k.

    The cheap path of `ldexp` (no subnormal normalization of the input); the result
    may be subnormal (exact when the shifted-out bits are zero) or Inf.
    """
    bits = f32_bits(v)
    sign = (bits >> 31) << 31
    exp = ((bits >> 23) & 0xFF).astype(jnp.int32)
    new = exp + k.astype(jnp.int32)
    normal = (bits.astype(jnp.int32) + (k.astype(jnp.int32) << 23)).astype(jnp.uint32)
    sub_shift = jnp.clip(1 - new, 0, 31).astype(jnp.uint32)
    sub = (((bits & 0x7FFFFF) | 0x800000) >> sub_shift) | sign
    out = jnp.where(new >= 1, normal, jnp.where(new >= -23, sub, sign))
    out = jnp.where(new >= 255, sign | EXP_INF, out)
    return bits_f32(jnp.where(exp == 0, bits, out))


def exact_div(x: jnp.ndarray, d: jnp.ndarray) -> jnp.ndarray:
    """Correctly rounded x / d for f32 x (subnormals included) and normal positive d.

    A subnormal x is first scaled by 2^64 (exactly, with bit ops) so XLA's
    denormals-are-zero cannot lose it; the quotient is scaled back by 2^-64,
    which is exact whenever the true quotient is a normal f32. (Results in the
    subnormal range are only ever rounded to zero by the element grids.)
    """
    x = x.astype(jnp.float32)
    bits = f32_bits(x)
    is_sub = ((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFF) != 0)
    # XLA rewrites `x / broadcast(d)` as `x * (1 / d)` (two roundings). A divisor that
    # depends on x elementwise keeps the division a division without materializing a
    # full-shape copy of d (an optimization barrier on the broadcast did, 3x slower on
    # CPU): min(|x|, 0) is 0 for every x but NaN, whose quotient is NaN anyway.
    d = jnp.asarray(d, jnp.float32) + jnp.minimum(jnp.abs(x), jnp.float32(0.0))
    up = ldexp(x, jnp.full(x.shape, 64, jnp.int32))
    q_sub = ldexp(up / d, jnp.full(x.shape, -64, jnp.int32))
    return jnp.where(is_sub, q_sub, x / d)
