"""`jax.random.uniform`'s f32 draws at given positions, for kernels that draw their own.

A kernel that rounds stochastically inside (the NVFP4 operand kernel,
`mxjax.routes.xla_nvfp4_kernel`) must use the uniforms the emulation draws:
``jax.random.uniform(key, shape, float32)`` of the canonical operand. With JAX's
default generator (threefry2x32, ``jax_threefry_partitionable``, on by default since
JAX 0.5) the draw at flat index ``i`` of ``shape`` depends on the key and ``i`` alone:

* the 64-bit index split into 32-bit words ``(hi, lo)`` is the counter, and the
  threefry2x32 block cipher (20 rounds, Salmon et al. 2011) encrypts it under the key's
  two words;
* the two output words are xor-ed into 32 random bits;
* those bits become an f32 in [0, 1): by default (``jax_legacy_random_uniform``) the top 23
  bits as the mantissa of a float in [1, 2), minus 1; otherwise the top 24 bits times
  2^-24.

So each element's uniform is a pure function of (key, flat index), which a kernel computes
from the element's position: 32-bit integer adds, shifts and xors, in the interpreter as
on a GPU. `reproduces` says whether the configuration is one these functions reproduce
(tests compare them with ``jax.random.uniform`` bit for bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["flat_index", "key_words", "reproduces", "uniform_at", "uniforms_legacy"]

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def uniforms_legacy() -> bool:
    """Whether ``jax.random.uniform`` takes the legacy 23-bit conversion (the
    ``jax_legacy_random_uniform`` flag; JAX versions without it always do)."""
    return bool(getattr(jax.config, "jax_legacy_random_uniform", True))


def _impl_name(key) -> str:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(key))
    return str(jax.config.jax_default_prng_impl)


def reproduces(key) -> bool:
    """Whether `uniform_at` gives ``jax.random.uniform(key, ...)``'s draws: the key is a
    threefry2x32 key (a typed key of that implementation, or raw uint32 ``[2]`` under
    the default implementation) and JAX draws partitionably."""
    if key is None:
        return False
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not typed and (key.dtype != jnp.uint32 or key.shape != (2,)):
        return False
    return (_impl_name(key) == "threefry2x32"
            and bool(jax.config.jax_threefry_partitionable))


def key_words(key) -> jax.Array:
    """The key's two uint32 words (``jax.random.key_data``), for `uniform_at`.

    Raises:
      ValueError: ``key`` is not one `reproduces` takes.
    """
    if key is None:
        raise ValueError("key: stochastic rounding needs a key (a threefry2x32 jax.random.key "
                         "or PRNGKey), got None")
    if not reproduces(key):
        raise ValueError(
            f"key: expected a threefry2x32 key (jax.random.key or PRNGKey under the default "
            f"implementation) with jax_threefry_partitionable on, got dtype {key.dtype}, "
            f"shape {key.shape}, implementation {_impl_name(key)!r}, partitionable "
            f"{bool(jax.config.jax_threefry_partitionable)}")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return key.astype(jnp.uint32)


def _rotl(x, r: int):
    return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def _threefry2x32(k0, k1, x0, x1):
    """The threefry2x32 block cipher, 20 rounds, on uint32 arrays (keys broadcast)."""
    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(_PARITY))
    x0 = x0 + ks[0]
    x1 = x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def flat_index(row, row_length: int, column):
    """The 64-bit flat index ``row * row_length + column`` as uint32 words ``(hi, lo)``.

    Args:
      row, column: uint32 arrays (broadcast), each below 2^31.
      row_length: a Python int below 2^31.
    """
    if not 0 < row_length < 1 << 31:
        raise ValueError(f"row_length: expected 0 < n < 2^31, got {row_length}")
    lo_mask = jnp.uint32(0xFFFF)
    r_lo, r_hi = row & lo_mask, row >> jnp.uint32(16)
    n_lo, n_hi = jnp.uint32(row_length & 0xFFFF), jnp.uint32(row_length >> 16)
    low, mid_a, mid_b = r_lo * n_lo, r_hi * n_lo, r_lo * n_hi  # each below 2^32
    lo = low + (mid_a << jnp.uint32(16))
    carry = (lo < low).astype(jnp.uint32)
    lo2 = lo + (mid_b << jnp.uint32(16))
    carry = carry + (lo2 < lo).astype(jnp.uint32)
    hi = r_hi * n_hi + (mid_a >> jnp.uint32(16)) + (mid_b >> jnp.uint32(16)) + carry
    lo3 = lo2 + column
    return hi + (lo3 < lo2).astype(jnp.uint32), lo3


def uniform_at(k0, k1, hi, lo, *, legacy: bool = True):
    """f32 uniforms in [0, 1): ``jax.random.uniform(key, shape)``'s draws at the flat
    indices ``(hi, lo)`` (uint32 arrays) of ``shape``, for the key words ``k0, k1``
    (uint32 scalars, `key_words`); ``legacy``: the conversion of `uniforms_legacy`."""
    a, b = _threefry2x32(k0, k1, hi, lo)
    bits = a ^ b
    if legacy:
        one = (bits >> jnp.uint32(9)) | jnp.uint32(0x3F800000)
        return jax.lax.bitcast_convert_type(one, jnp.float32) - jnp.float32(1.0)
    return (bits >> jnp.uint32(8)).astype(jnp.float32) * jnp.float32(2.0 ** -24)
