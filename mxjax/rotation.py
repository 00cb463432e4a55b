"""Block-diagonal Walsh–Hadamard rotations (fast transform, log2(h) butterfly stages).

The butterflies work on the block index's bits as axes of size 2 (`bit_view`): one
stage per bit axis, ``a + sign * b`` of its two halves (`hadamard_bit_view`), no
reversal. The program depends on the lowering platform, not the values (the same
f32 adds and subtracts, the same values bit for bit):

* XLA:CPU: the stages are materialized two at a time (a barrier after every second
  stage). Fused, XLA:CPU recomputes every earlier stage per element; one barrier per
  stage makes twice the passes over memory (the tiny config's train step under
  `mxfp4_all_h16` is faster this way, bench/train_step.py; the figures are in
  docs/CHANGELOG.md), and the fwd+bwd programs have a third fewer fusions;
* GPUs and TPUs: no barrier, so that the compiler fuses all stages with the
  quantizer that follows.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mxjax._platform import cpu_or_accelerator

__all__ = ["HADAMARD_SIZES", "bit_view", "butterfly_stage", "fixed_signs", "hadamard",
           "hadamard_bit_view", "random_signs"]

HADAMARD_SIZES = (16, 32, 64, 128)
# XLA:CPU's form materializes the butterflies after every this many stages (module docstring).
CPU_STAGES_PER_PASS = 2


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



def bit_view(x: jnp.ndarray, axis: int, n_bits: int) -> jnp.ndarray:
    """`x` with `axis` (length n, a multiple of 2**n_bits) split into (n >> n_bits, 2, ..., 2).

    The n_bits axes of size 2 are the low bits of the index along `axis`, the
    highest first (a row-major reshape, free in XLA). Element j of a block of
    2**n_bits is at bits (j >> (n_bits - 1) & 1, ..., j & 1).
    """
    n = x.shape[axis]
    if n % (1 << n_bits):
        raise ValueError(f"x: length {n} along axis {axis} is not a multiple of 2**{n_bits}")
    return x.reshape(x.shape[:axis] + (n >> n_bits,) + (2,) * n_bits + x.shape[axis + 1:])


def hadamard_bit_view(z: jnp.ndarray, block_size: int, low_bit_axis: int,
                      signs: jnp.ndarray | None = None,
                      stages_per_pass: int | None = None,
                      normalize: bool = True, last_stage: bool = True) -> jnp.ndarray:
    """The normalized H_h of `hadamard` on blocks laid out as bit axes (`bit_view`), f32.

    Args:
      z: float array whose block index bits are the log2(h) axes of size 2 ending
        at `low_bit_axis` (the lowest bit; higher bits before it).
      block_size: h, one of HADAMARD_SIZES.
      low_bit_axis: non-negative axis of the lowest bit.
      signs: optional ±1 vector of length h (applied before the transform).
      stages_per_pass: None (every stage in one expression), or materialize the
        butterflies (``lax.optimization_barrier``) after every this many stages
        (XLA:CPU's form; the values do not depend on it).
      normalize: False leaves out the final multiply by 1/sqrt(h) (the caller applies
        it: `mxjax.emulation.in_place_values.nearest_even_values`' prescale).
      last_stage: False stops before the last stage (on axis ``low_bit_axis - log2(h)
        + 1``, the highest bit) and leaves out the 1/sqrt(h): `butterfly_stage` on that
        axis completes the unnormalized transform.
    Returns:
      f32 array of z's shape: the same values as `hadamard` on the flat layout.
      Stage t (stride 2^t) combines the two halves a, b of bit axis
      ``low_bit_axis - t`` into ``a + b`` (bit 0) and ``a + (-1) * b == a - b``
      (bit 1): the butterfly's adds and subtracts in the butterfly's order.
    """
    h = _check_block_size(block_size)
    k = h.bit_length() - 1
    first = low_bit_axis - k + 1
    if first < 0 or z.shape[first: low_bit_axis + 1] != (2,) * k:
        raise ValueError(f"z: expected {k} bit axes of size 2 ending at axis {low_bit_axis}, "
                         f"got shape {z.shape}")
    z = z.astype(jnp.float32)
    trailing = (1,) * (z.ndim - low_bit_axis - 1)
    if signs is not None:
        signs = jnp.asarray(signs, jnp.float32)
        if signs.shape != (h,):
            raise ValueError(f"signs: expected shape ({h},), got {signs.shape}")
        z = z * signs.reshape((2,) * k + trailing)
    for t in range(k if last_stage else k - 1):
        z = butterfly_stage(z, low_bit_axis - t)
        if stages_per_pass and (t + 1) % stages_per_pass == 0 and t + 1 < k:
            z = lax.optimization_barrier(z)
    if not last_stage:
        return z
    return z * jnp.float32(1.0 / math.sqrt(h)) if normalize else z


def butterfly_stage(z: jnp.ndarray, axis: int) -> jnp.ndarray:
    """One butterfly stage on bit axis `axis` (size 2) of f32 `z`: halves a, b become
    ``a + b`` (bit 0) and ``a + (-1) * b`` (bit 1)."""
    plus_minus = jnp.asarray([1.0, -1.0], jnp.float32)
    a = lax.index_in_dim(z, 0, axis, keepdims=True)
    b = lax.index_in_dim(z, 1, axis, keepdims=True)
    return a + plus_minus.reshape((2,) + (1,) * (z.ndim - axis - 1)) * b


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
    if signs is not None:
        signs = jnp.asarray(signs, jnp.float32)
        if signs.shape != (h,):
            raise ValueError(f"signs: expected shape ({h},), got {signs.shape}")
    args = (xm,) if signs is None else (xm, signs)
    ym = cpu_or_accelerator(
        *args, cpu=functools.partial(_hadamard_last, h=h, stages_per_pass=CPU_STAGES_PER_PASS),
        accelerator=functools.partial(_hadamard_last, h=h))
    return jnp.moveaxis(ym, -1, axis).astype(x.dtype)


def _hadamard_last(xm: jnp.ndarray, signs: jnp.ndarray | None = None, *, h: int,
                   stages_per_pass: int | None = None) -> jnp.ndarray:
    """`hadamard` on the last axis of f32 `xm` (a multiple of h long), by the bit view."""
    z = bit_view(xm, xm.ndim - 1, h.bit_length() - 1)
    return hadamard_bit_view(z, h, z.ndim - 1, signs, stages_per_pass).reshape(xm.shape)


def fixed_signs(seed: int, block_size: int = 16) -> jnp.ndarray:
    """A deterministic ±1 f32 vector of length block_size from an integer seed."""
    h = _check_block_size(block_size)
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 2, size=h) * 2 - 1, jnp.float32)


def random_signs(key: jax.Array, block_size: int = 16) -> jnp.ndarray:
    """A fresh ±1 f32 vector of length block_size drawn from a (traced) PRNG key."""
    h = _check_block_size(block_size)
    return jnp.where(jax.random.bernoulli(key, 0.5, (h,)), 1.0, -1.0).astype(jnp.float32)
