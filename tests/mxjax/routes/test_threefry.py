"""`mxjax.routes.threefry` against jax.random.uniform and a numpy threefry2x32, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxjax.routes import threefry

_ROT = ((13, 15, 26, 6), (17, 29, 16, 24))


def _np_threefry(k0: int, k1: int, x0: np.ndarray, x1: np.ndarray):
    """threefry2x32 (20 rounds) in numpy uint64 arithmetic masked to 32 bits."""
    m = np.uint64(0xFFFFFFFF)
    ks = [np.uint64(k0), np.uint64(k1), np.uint64(k0 ^ k1 ^ 0x1BD11BDA)]
    x0 = (x0.astype(np.uint64) + ks[0]) & m
    x1 = (x1.astype(np.uint64) + ks[1]) & m
    for i in range(5):
        for r in _ROT[i % 2]:
            x0 = (x0 + x1) & m
            x1 = (((x1 << np.uint64(r)) | (x1 >> np.uint64(32 - r))) & m) ^ x0
        x0 = (x0 + ks[(i + 1) % 3]) & m
        x1 = (x1 + ks[(i + 2) % 3] + np.uint64(i + 1)) & m
    return x0.astype(np.uint32), x1.astype(np.uint32)


def _at(key, shape):
    words = threefry.key_words(key)
    rows = jnp.arange(shape[0], dtype=jnp.uint32)[:, None]
    cols = jnp.arange(shape[1], dtype=jnp.uint32)[None, :]
    hi, lo = threefry.flat_index(rows, shape[1], cols)
    return jax.jit(threefry.uniform_at, static_argnames="legacy")(
        words[0], words[1], hi, lo, legacy=threefry.uniforms_legacy())


@pytest.mark.parametrize("legacy", [True, False])
@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey],
                         ids=["typed", "raw"])
def test_uniform_at_is_jax_random_uniform(make_key, legacy):
    key = jax.random.split(make_key(2024), 3)[2]  # a split key, as each GEMM's is
    shape = (37, 83)  # odd sizes: indices cross rows unevenly
    try:
        jax.config.update("jax_legacy_random_uniform", legacy)
        want = jax.random.uniform(key, shape, jnp.float32)
        got = _at(key, shape)
    finally:
        jax.config.update("jax_legacy_random_uniform", True)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                  np.asarray(want).view(np.uint32))
    assert 0.0 <= float(got.min()) and float(got.max()) < 1.0


def test_indices_past_2_to_the_32_and_the_cipher_against_numpy():
    rows = np.array([0, 1, 4095, 70001, 2**31 - 1], np.uint32)[:, None]
    cols = np.array([0, 5, 65535, 2**31 - 7], np.uint32)[None, :]
    n = 3 * 2**20 + 12345
    hi, lo = jax.jit(threefry.flat_index, static_argnums=1)(rows, n, cols)
    want = rows.astype(np.uint64) * np.uint64(n) + cols.astype(np.uint64)
    np.testing.assert_array_equal(np.asarray(hi), (want >> np.uint64(32)).astype(np.uint32))
    np.testing.assert_array_equal(np.asarray(lo), (want & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    assert (np.asarray(hi) > 0).any()
    k0, k1 = 0xDEADBEEF, 0x01234567
    got = jax.jit(threefry._threefry2x32)(jnp.uint32(k0), jnp.uint32(k1), hi, lo)
    for g, w in zip(got, _np_threefry(k0, k1, np.asarray(hi), np.asarray(lo))):
        np.testing.assert_array_equal(np.asarray(g), w)
    # Random123's known-answer vector for threefry2x32_20 (key and counter all ones).
    ones = jnp.uint32(0xFFFFFFFF)
    a, b = threefry._threefry2x32(ones, ones, ones, ones)
    assert (int(a), int(b)) == (0x1CB996FC, 0xBB002BE7)


def test_which_keys_are_reproduced():
    assert threefry.reproduces(jax.random.key(0))
    assert threefry.reproduces(jax.random.PRNGKey(0))
    assert not threefry.reproduces(None)
    assert not threefry.reproduces(jax.random.key(0, impl="rbg"))
    assert not threefry.reproduces(jnp.zeros((4,), jnp.uint32))
    try:
        jax.config.update("jax_threefry_partitionable", False)
        assert not threefry.reproduces(jax.random.key(0))
    finally:
        jax.config.update("jax_threefry_partitionable", True)
    with pytest.raises(ValueError, match="key: expected a threefry2x32 key.*'rbg'"):
        threefry.key_words(jax.random.key(0, impl="rbg"))
    with pytest.raises(ValueError, match="key: stochastic rounding needs a key"):
        threefry.key_words(None)
    with pytest.raises(ValueError, match="row_length"):
        threefry.flat_index(jnp.uint32(0), 0, jnp.uint32(0))
