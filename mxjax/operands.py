"""One GEMM's operands: the canonical layout, the Hadamard rotation and the keys.

Every route of a quantized GEMM (`mxjax.routes`) starts from the same operands: each
transposed to ``(batch..., free, contraction)`` with its free axes and its contracting
axes flattened (``ca[i]`` pairs with ``cb[i]``; the flattened contraction is row-major in
that order), upcast to f32, zero-padded along the contraction to a multiple of the
Hadamard size and rotated (if the recipe has a Hadamard). Keys: each GEMM's key is split
into three (lhs rounding, rhs rounding, Hadamard signs) by :func:`split_key`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from mxjax._platform import cpu_barrier
from mxjax.dimensions import Dims, free_axes
from mxjax.rotation import fixed_signs, hadamard, random_signs

__all__ = ["canonical_operand", "canonical_operands", "free_size", "quantizer_operands", "rotate",
           "rotate_operand", "rotation_signs", "split_key"]


def _to_canonical(x: jax.Array, batch: Sequence[int], contract: Sequence[int]) -> jax.Array:
    """x -> (batch..., prod(free), prod(contract)), f32."""
    free = free_axes(x.ndim, batch, contract)
    perm = tuple(batch) + tuple(free) + tuple(contract)
    if perm != tuple(range(x.ndim)):
        x = jnp.transpose(x, perm)
    bshape = tuple(x.shape[: len(batch)])
    f = math.prod(x.shape[len(batch): len(batch) + len(free)])
    k = math.prod(x.shape[len(batch) + len(free):])
    return x.reshape(bshape + (f, k)).astype(jnp.float32)


def canonical_operand(x: jax.Array, batch: Sequence[int], contract: Sequence[int]) -> jax.Array:
    """One operand in the canonical layout: f32 ``[batch..., F, K]`` (its free axes and its
    contracting axes, in the order given, flattened)."""
    return _to_canonical(x, batch, contract)


def canonical_operands(a: jax.Array, b: jax.Array, dims: Dims) -> tuple[jax.Array, jax.Array]:
    """Both operands of ``dot_general(a, b, dims)`` in the canonical layout, f32.

    Returns ``(a3, b3)``: f32 ``[batch..., Fa, K]`` and ``[batch..., Fb, K]``
    (``mxjax.layout``), free and contracting axes flattened in order.
    """
    (ca, cb), (ba, bb) = dims
    return _to_canonical(a, ba, ca), _to_canonical(b, bb, cb)


def rotate(a3: jax.Array, b3: jax.Array, recipe, k_had):
    """Applies the recipe's Hadamard to both canonical operands along K (if any)."""
    # One barrier per operand (`rotate_operand`), so neither operand's program depends
    # on the other.
    return rotate_operand(a3, recipe, k_had), rotate_operand(b3, recipe, k_had)


def rotate_operand(x3: jax.Array, recipe, k_had) -> jax.Array:
    """Applies the recipe's Hadamard to one canonical operand along K (if any), as
    `rotate` does to each: the same signs from ``k_had``, the same zero padding."""
    had = recipe.hadamard
    if had is None:
        return x3
    h = had.block_size
    # A contraction shorter than h (or not a multiple of it) is zero-padded:
    # both operands get the same zeros, so the rotation still cancels exactly.
    pad = (-x3.shape[-1]) % h
    if pad:
        x3 = jnp.pad(x3, [(0, 0)] * (x3.ndim - 1) + [(0, pad)])
    # On CPU the barrier keeps XLA from fusing the butterflies into the
    # quantizer's block reductions, which recomputes them (measured 4x slower).
    return cpu_barrier(hadamard(x3, h, axis=-1, signs=rotation_signs(had, k_had)))


def rotation_signs(had, k_had):
    """The ±1 f32[h] sign vector a GEMM's Hadamard uses, or None (plain H).

    Randomized: drawn from ``k_had`` (the GEMM key's third split); a fixed seed:
    ``mxjax.rotation.fixed_signs``; otherwise None.
    """
    if had.randomized:
        return random_signs(k_had, had.block_size)
    if had.seed is not None:
        return fixed_signs(had.seed, had.block_size)
    return None


def split_key(key):
    """Three keys from one, or three Nones for None.

    The call's key gives (fprop, dgrad, wgrad); each GEMM's key gives (lhs
    rounding, rhs rounding, Hadamard signs).
    """
    if key is None:
        return None, None, None
    k0, k1, k2 = jax.random.split(key, 3)
    return k0, k1, k2


def quantizer_operands(a3: jax.Array, b3: jax.Array, recipe, key):
    """One GEMM's operands as its backend hands them to the quantizer.

    Args:
      a3, b3: the canonical operands (:func:`canonical_operands`).
      recipe: the GEMM's recipe.
      key: the GEMM's key (ignored unless the recipe needs one).
    Returns:
      ``(a3, b3, lhs_key, rhs_key)``: the operands rotated by the recipe's
      Hadamard along K (zero-padded to its size) when it has one, and the keys
      of the two roundings (None unless needed).
    """
    k_lhs, k_rhs, k_had = split_key(key if recipe.needs_key else None)
    a3, b3 = rotate(a3, b3, recipe, k_had)
    return a3, b3, k_lhs, k_rhs


def free_size(x: jax.Array, batch, contract) -> int:
    """The product of `x`'s free (neither batch nor contracting) axes."""
    return math.prod(x.shape[i] for i in free_axes(x.ndim, batch, contract))
