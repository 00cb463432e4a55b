"""Quantization statistics of one GEMM's operands (pure ``jnp``, jit-friendly).

For one operand ``x`` and its quantization ``q`` (an :class:`mxjax.MXArray`), see
:func:`operand_stats`:

``rel_err``
    ``‖Q(x) − x‖₂ / ‖x‖₂`` over all elements (0 when ``x`` is all zero).
``underflow``
    fraction of the nonzero elements of ``x`` whose quantized value is zero
    (±0). "Nonzero" is decided on the bit pattern, so fp32 subnormals count.
``saturation``
    fraction of the nonzero elements of ``x`` that are *clipped*: the scaled
    value the element rounding sees, ``|y| = |x| / d`` (times 3/4 with the SR
    pre-scale), lies strictly above the element format's max normal (6 for
    E2M1), so the quantizer returns ±max_normal·d instead of rounding. ``d``
    is the block's decode scale (``2^s`` for E8M0 scales, ``block_scale ·
    tensor_scale`` for NVFP4, ``tensor_scale`` for per-tensor FP8). A value
    that merely rounds *to* max_normal (E2M1: 5 < |y| ≤ 6) is not saturated.
    With the FLOOR scale rule |y| < 8, so the values in (6, 8) of a block
    clip; EVEN clips (6, 7); CEIL and RCEIL never clip.
``scale_log2_min/max/mean/std``
    statistics of ``log2 d`` over the blocks that hold a nonzero value and
    have a finite nonzero ``d`` (for E8M0: the exact integer exponent
    ``byte − 127``; a per-tensor format has one block, std 0).

Denominators that would be zero give 0. NaN/Inf inputs propagate into
``rel_err`` and the scale statistics (a NaN block's scale is NaN).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mxjax import _bits
from mxjax.layout import canonical_dimension_numbers
from mxjax.quantization import MXArray, dequantize, quantize_with
from mxjax.recipes import OperandRecipe
from mxjax.scaling import SR_PRESCALE, scheme_for, to_blocks

__all__ = [
    "GEMM_FIELDS",
    "N_GEMM_FIELDS",
    "OPERAND_STATS",
    "block_mean_share",
    "cosine_similarity",
    "gemm_stats",
    "operand_stats",
    "operand_stats_vector",
    "quantized_operand_stats",
    "safe_ratio",
]

OPERAND_STATS: tuple[str, ...] = (
    "rel_err",
    "underflow",
    "saturation",
    "scale_log2_min",
    "scale_log2_max",
    "scale_log2_mean",
    "scale_log2_std",
)
# One row per GEMM: a call count, the lhs and rhs operand stats, the output cosine.
GEMM_FIELDS: tuple[str, ...] = (
    ("count",)
    + tuple(f"lhs_{s}" for s in OPERAND_STATS)
    + tuple(f"rhs_{s}" for s in OPERAND_STATS)
    + ("cosine",)
)
N_GEMM_FIELDS = len(GEMM_FIELDS)


def safe_ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, 0 where den == 0; NaN propagates."""
    zero = den == 0
    return jnp.where(zero, 0.0, num / jnp.where(zero, 1.0, den)).astype(jnp.float32)


def _scale_summary(log2d: jax.Array, valid: jax.Array) -> list[jax.Array]:
    """min/max/mean/std of log2d over `valid` entries (0s when there are none)."""
    # One materialized value for every consumer (XLA may otherwise evaluate log2 once
    # per fusion, with slightly different approximations).
    log2d, valid = jax.lax.optimization_barrier((log2d.astype(jnp.float32), valid))
    n = jnp.sum(valid.astype(jnp.float32))
    big = jnp.float32(3.0e38)
    lo = jnp.min(jnp.where(valid, log2d, big))
    hi = jnp.max(jnp.where(valid, log2d, -big))
    v = jnp.where(valid, log2d, 0.0)
    mean = safe_ratio(jnp.sum(v), n)
    var = safe_ratio(jnp.sum(jnp.where(valid, jnp.square(log2d - mean), 0.0)), n)
    has = n > 0
    return [jnp.where(has, lo, 0.0), jnp.where(has, hi, 0.0), mean, jnp.sqrt(var)]


def operand_stats(x: jax.Array, q: MXArray, xq: jax.Array | None = None) -> dict[str, jax.Array]:
    """Quantization statistics of one operand (definitions in the module docstring).

    Args:
      x: f32/bf16/f16 array, the values that were quantized (any shape).
      q: ``mxjax.quantize(x, ...)``: its codes, scales and tensor scale.
      xq: ``dequantize(q)`` if already at hand (f32, x's shape); computed otherwise.
    Returns:
      dict name -> f32 scalar, keys :data:`OPERAND_STATS`.
    """
    if not isinstance(q, MXArray):
        raise TypeError(f"q: expected an MXArray, got {type(q).__name__}")
    if tuple(x.shape) != tuple(q.shape):
        raise ValueError(f"x: shape {tuple(x.shape)} differs from the quantized shape {q.shape}")
    elem = q.fmt.element
    xf = x.astype(jnp.float32)
    if xq is None:
        xq = dequantize(q, jnp.float32)
    xq = xq.astype(jnp.float32)
    nz = _bits.nonzero(xf)
    n_nz = jnp.sum(nz.astype(jnp.float32))
    rel_err = safe_ratio(jnp.sqrt(jnp.sum(jnp.square(xq - xf))), jnp.sqrt(jnp.sum(jnp.square(xf))))
    underflow = safe_ratio(jnp.sum((nz & ~_bits.nonzero(xq)).astype(jnp.float32)), n_nz)
    # The scheme's view of x (blocks along q.axis, or the whole tensor), |x| / d per
    # element with d the decode scale of its block, log2 d per block, and the blocks
    # that count (a nonzero value and a usable d).
    xv, y, log2d, valid = scheme_for(q.fmt).decode_view(xf, q.axis, q.scales, q.tensor_scale)
    if q.sr_prescale:
        y = y * jnp.float32(SR_PRESCALE)
    clipped = _bits.nonzero(xv) & (y > jnp.float32(elem.max_normal))
    saturation = safe_ratio(jnp.sum(clipped.astype(jnp.float32)), n_nz)
    lo, hi, mean, std = _scale_summary(log2d, valid)
    return dict(zip(OPERAND_STATS, (rel_err, underflow, saturation, lo, hi, mean, std)))


def operand_stats_vector(x: jax.Array, q: MXArray, xq: jax.Array | None = None) -> jax.Array:
    """:func:`operand_stats` as f32[len(OPERAND_STATS)] in that order."""
    d = operand_stats(x, q, xq)
    return jnp.stack([d[k] for k in OPERAND_STATS]).astype(jnp.float32)


def _requantize(x: jax.Array, recipe: OperandRecipe, axis: int, key: jax.Array | None):
    """(MXArray | None, dequantized f32) of ``x`` under an OperandRecipe (None: pass-through)."""
    if recipe.is_passthrough:
        return None, x.astype(jnp.float32)
    q = quantize_with(x, recipe, axis, key=key)
    return q, dequantize(q, jnp.float32)


def quantized_operand_stats(x: jax.Array, recipe: Any, axis: int, key: jax.Array | None = None
                            ) -> jax.Array:
    """Stats vector of ``x`` quantized under an operand recipe (re-quantizes ``x``).

    Args:
      x: the operand exactly as the GEMM hands it to the quantizer (after any
        Hadamard rotation; padding with zeros does not change the stats).
      recipe: an ``mxjax.OperandRecipe`` (fmt, scale_rule, rounding,
        sr_prescale). A pass-through (BF16) recipe gives all zeros.
      axis: the block axis used by the GEMM.
      key: the same PRNG key the GEMM used (STOCHASTIC rounding), so the
        re-quantization reproduces the GEMM's values bit for bit.
    Returns:
      f32[len(OPERAND_STATS)].
    """
    q, xq = _requantize(x, recipe, axis, key)
    if q is None:
        return jnp.zeros((len(OPERAND_STATS),), jnp.float32)
    return operand_stats_vector(x, q, xq)


def block_mean_share(x: jax.Array, axis: int = -1, block: int = 16) -> jax.Array:
    """Fraction of ``x``'s energy in its per-block means along ``axis`` (f32 scalar).

    ``x`` is split into consecutive blocks of ``block`` elements along ``axis``
    (the last one zero-padded, as a GEMM pads its contraction for a Hadamard);
    each block's mean ``m = sum(block) / block`` carries energy ``block * m**2``,
    which is the energy a normalized Sylvester Hadamard of size ``block`` puts
    into the block's first coefficient. Returns ``sum(block * m**2) /
    sum(x**2)``, in [0, 1]; 0 for an all-zero ``x``; NaN/Inf propagate. Along a
    GEMM's contraction this is the share of an operand that is common to the
    elements one rotated block mixes (for wgrad, a feature's mean over the
    tokens the block sums).

    Args:
      x: float array, any shape with at least one axis.
      axis: the axis the blocks run along.
      block: block length (a positive int).
    """
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block: expected a positive int, got {block!r}")
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("x: expected an array with at least one axis, got a scalar")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis: {axis} is out of range for an array of rank {x.ndim}")
    xm, _ = to_blocks(x.astype(jnp.float32), axis, block)
    xb = xm.reshape(xm.shape[:-1] + (xm.shape[-1] // block, block))
    sums = jnp.sum(xb, axis=-1)
    common = jnp.sum(jnp.square(sums)) / jnp.float32(block)
    return safe_ratio(common, jnp.sum(jnp.square(xb)))


def cosine_similarity(a: jax.Array, b: jax.Array) -> jax.Array:
    """Cosine of the angle between flattened ``a`` and ``b`` (f32 scalar).

    1 when both are all zero, 0 when exactly one is.
    """
    af = a.astype(jnp.float32).ravel()
    bf = b.astype(jnp.float32).ravel()
    na = jnp.sqrt(jnp.sum(af * af))
    nb = jnp.sqrt(jnp.sum(bf * bf))
    both_zero = (na == 0) & (nb == 0)
    cos = safe_ratio(jnp.sum(af * bf), na * nb)
    return jnp.where(both_zero, jnp.float32(1.0), cos)


def _gemm_last(a: jax.Array, b: jax.Array) -> jax.Array:
    """[batch..., Fa, K] x [batch..., Fb, K] -> [batch..., Fa, Fb], f32, HIGHEST."""
    return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32),
                               canonical_dimension_numbers(a.ndim - 2),
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


def gemm_stats(
    *,
    lhs: jax.Array,
    rhs: jax.Array,
    lhs_recipe: Any,
    rhs_recipe: Any,
    lhs_key: jax.Array | None = None,
    rhs_key: jax.Array | None = None,
    cosine: bool = True,
) -> jax.Array:
    """One GEMM's row of stats, f32[N_GEMM_FIELDS] (layout :data:`GEMM_FIELDS`).

    Args:
      lhs, rhs: the operands as handed to the quantizer, in the canonical GEMM
        layout ``[batch..., F, K]`` (same batch dims, contraction K last, after
        any Hadamard rotation); blocks run along K.
      lhs_recipe, rhs_recipe: their ``OperandRecipe``.
      lhs_key, rhs_key: the PRNG keys the GEMM used for their rounding (or None).
      cosine: also compute the cosine between the quantized product and the
        exact one (two extra GEMMs at HIGHEST precision, computed from this
        function's own bit-identical re-quantization so the GEMM's own output is
        never touched). The exact product of rotated operands equals that of the
        unrotated ones (the rotation is orthogonal). 0 when not computed.
    """
    if lhs.ndim < 2 or lhs.ndim != rhs.ndim or lhs.shape[-1] != rhs.shape[-1] \
            or lhs.shape[:-2] != rhs.shape[:-2]:
        raise ValueError(f"lhs, rhs: expected [batch..., F, K] operands with the same batch "
                         f"dims and K, got {tuple(lhs.shape)} and {tuple(rhs.shape)}")
    lq, lxq = _requantize(lhs, lhs_recipe, -1, lhs_key)
    rq, rxq = _requantize(rhs, rhs_recipe, -1, rhs_key)
    zeros = jnp.zeros((len(OPERAND_STATS),), jnp.float32)
    ls = zeros if lq is None else operand_stats_vector(lhs, lq, lxq)
    rs = zeros if rq is None else operand_stats_vector(rhs, rq, rxq)
    if cosine:
        cos = cosine_similarity(_gemm_last(lxq, rxq), _gemm_last(lhs, rhs))
    else:
        cos = jnp.float32(0.0)
    return jnp.concatenate([jnp.ones((1,), jnp.float32), ls, rs, cos[None]])
