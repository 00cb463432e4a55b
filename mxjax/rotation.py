"""Block-diagonal Walsh–Hadamard rotations (fast transform, log2(h) butterfly stages)."""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

from mxjax._platform import cpu_barrier

__all__ = ["HADAMARD_SIZES", "fixed_signs", "hadamard", "random_signs"]

HADAMARD_SIZES = (16, 32, 64, 128)


def _check_block_size(block_size) -> int:
    try:
        h = operator.index(block_size)
    except TypeError:
        raise TypeError(f"block_size: expected an int, got {block_size!r}") from None
    if isinstance(block_size, bool) or h not in HADAMARD_SIZES:
        # Smaller powers of two would compute a valid transform, but the contract
        # (docs/NUMERICS.md) and every recipe are 16..128; refusing them keeps a typo
        # (2, 4, 8) from silently running a much weaker rotation.
        raise ValueError(f"block_size: must be one of {HADAMARD_SIZES}, got {block_size!r}")
    return h


def _fwht_last(xb: jnp.ndarray) -> jnp.ndarray:
    """Unnormalized Sylvester-ordered transform of the last axis (length h).

    Stage with stride s pairs element i with i ^ s: the lower one becomes a + b,
    the upper one a - b, written as a reversal of each (a, b) pair plus a select.
    """
    h = xb.shape[-1]
    lead = xb.shape[:-1]
    idx = np.arange(h)
    stride = 1
    while stride < h:
        pairs = xb.reshape(lead + (h // (2 * stride), 2, stride))
        partner = pairs[..., ::-1, :].reshape(xb.shape)
        upper = jnp.asarray((idx // stride) % 2 == 1)
        xb = jnp.where(upper, partner - xb, xb + partner)
        # On CPU, materialize each stage: fused, XLA:CPU recomputes every earlier
        # stage per element (2^stages work), ~4x slower than one pass per stage.
        # GPUs/TPUs fuse the stages (and the quantizer) into one pass instead.
        # Values do not depend on it: adds/subs of the same operands either way.
        xb = cpu_barrier(xb)
        stride *= 2
    return xb


def hadamard(
    x: jnp.ndarray, block_size: int = 16, axis: int = -1, signs: jnp.ndarray | None = None
) -> jnp.ndarray:
    """Applies the normalized Sylvester Hadamard H_h block-diagonally along `axis`.

    Each consecutive block of `block_size` elements along `axis` becomes
    `H @ (signs * block) / sqrt(block_size)`. Math is f32; the result has x's dtype.

    Args:
      x: float array; `x.shape[axis]` must be a multiple of `block_size`.
      block_size: 16, 32, 64 or 128.
      axis: the axis to rotate along.
      signs: optional ±1 vector of shape (block_size,) (a random-sign diagonal).
    Returns:
      Array of x's shape and dtype.
    """
    h = _check_block_size(block_size)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x: expected a float array, got dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError("x: expected an array with at least one dimension, got a scalar")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis: {axis} is out of range for an array of rank {x.ndim}")
    n = x.shape[axis]
    if n % h:
        raise ValueError(
            f"x: length {n} along axis {axis} is not a multiple of block_size={h} "
            "(pad with zeros first; mxjax.dot_general does this for GEMMs)"
        )
    xm = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    lead = xm.shape[:-1]
    xb = xm.reshape(lead + (n // h, h))
    if signs is not None:
        signs = jnp.asarray(signs, jnp.float32)
        if signs.shape != (h,):
            raise ValueError(f"signs: expected shape ({h},), got {signs.shape}")
        xb = xb * signs
    yb = _fwht_last(xb) * jnp.float32(1.0 / math.sqrt(h))
    return jnp.moveaxis(yb.reshape(lead + (n,)), -1, axis).astype(x.dtype)


def fixed_signs(seed: int, block_size: int = 16) -> jnp.ndarray:
    """A deterministic ±1 f32 vector of length block_size from an integer seed."""
    h = _check_block_size(block_size)
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 2, size=h) * 2 - 1, jnp.float32)


def random_signs(key: jax.Array, block_size: int = 16) -> jnp.ndarray:
    """A fresh ±1 f32 vector of length block_size drawn from a (traced) PRNG key."""
    h = _check_block_size(block_size)
    return jnp.where(jax.random.bernoulli(key, 0.5, (h,)), 1.0, -1.0).astype(jnp.float32)
