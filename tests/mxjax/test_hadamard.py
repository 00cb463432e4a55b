"""mxjax.hadamard against a dense Sylvester product (tests/reference.py).

Tolerances: the fast transform does log2(h) stages of fp32 additions plus one fp32
scaling, each with relative error <= 2^-24 of an intermediate bounded by
sqrt(h)·max|x| (stage k sums 2^k inputs, the normalised output is bounded by
sqrt(h)·max|x|). We allow (log2(h) + 2)·2^-23·sqrt(h)·max|x| absolute error per
element, a factor ~2 above that bound.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mxjax
from tests import reference as ref

SIZES = (16, 32, 64, 128)
EPS32 = 2.0**-23


def _atol(h: int, x) -> float:
    return (math.log2(h) + 2) * EPS32 * math.sqrt(h) * float(np.max(np.abs(x)))


def test_reference_sylvester_is_orthogonal():
    for h in SIZES:
        s = ref.sylvester(h)
        np.testing.assert_array_equal(s @ s.T, h * np.eye(h))
        np.testing.assert_array_equal(s[1], np.tile([1.0, -1.0], h // 2))  # Sylvester order


@functools.cache
def _all_axes_fn(h: int):
    """One jit per size: every axis position, with and without signs."""
    def run(xs, signs):
        return [(mxjax.hadamard(x, h, axis=a), mxjax.hadamard(x, h, axis=a, signs=signs))
                for x, a in zip(xs, (0, 1, 2, -1))]
    return jax.jit(run)


@pytest.mark.parametrize("h", SIZES)
def test_matches_dense_sylvester_along_every_axis(h, np_rng):
    """Block-diagonal (1/sqrt h) H (d ⊙ x) equals the dense product, two blocks per axis."""
    base = (3, 2, 2 * h)  # the block axis has two blocks
    xs = [np.moveaxis(np_rng.normal(size=base).astype(np.float32), -1, a) for a in (0, 1, 2, -1)]
    signs = np_rng.choice([-1.0, 1.0], size=h).astype(np.float32)
    got = _all_axes_fn(h)(tuple(jnp.asarray(x) for x in xs), jnp.asarray(signs))
    for x, a, (y, ys) in zip(xs, (0, 1, 2, -1), got):
        assert y.shape == x.shape and y.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(y), ref.hadamard(x, h, a), rtol=0,
                                   atol=_atol(h, x), err_msg=f"h={h} axis={a}")
        np.testing.assert_allclose(np.asarray(ys), ref.hadamard(x, h, a, signs), rtol=0,
                                   atol=_atol(h, x), err_msg=f"h={h} axis={a} signs")


@functools.cache
def _roundtrip_fn(h: int):
    def run(x, y, signs):
        hx = mxjax.hadamard(x, h, signs=signs)
        # the inverse of H·D is D·H (H is symmetric and orthonormal, D = D^-1)
        back = mxjax.hadamard(x=mxjax.hadamard(x, h), block_size=h)
        back_signed = (signs * mxjax.hadamard(hx.reshape(-1, h), h)).reshape(x.shape)
        return back, back_signed, hx, mxjax.hadamard(y, h, signs=signs)
    return jax.jit(run)


@pytest.mark.parametrize("h", SIZES)
def test_involution_and_dot_products(h, np_rng):
    """H(Hx) = x within fp32 rounding, and <Hx, Hy> = <x, y> (orthogonality)."""
    x = np_rng.normal(size=(4, 2 * h)).astype(np.float32)
    y = np_rng.normal(size=(4, 2 * h)).astype(np.float32)
    signs = np_rng.choice([-1.0, 1.0], size=h).astype(np.float32)
    back, back_signed, hx, hy = map(np.asarray, _roundtrip_fn(h)(x, y, jnp.asarray(signs)))
    np.testing.assert_allclose(back, x, rtol=0, atol=2 * _atol(h, x))
    np.testing.assert_allclose(back_signed, x, rtol=0, atol=2 * _atol(h, x))
    # dot products per row, in float64 from the fp32 outputs: relative to |x||y|
    got = np.sum(hx.astype(np.float64) * hy, axis=-1)
    want = np.sum(x.astype(np.float64) * y, axis=-1)
    scale = np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1)
    assert np.all(np.abs(got - want) <= 4 * (math.log2(h) + 2) * EPS32 * scale), (got, want)


def test_low_precision_dtypes_keep_dtype():
    x = np.random.default_rng(0).normal(size=(2, 32)).astype(ml_dtypes.bfloat16)
    y = jax.jit(lambda a: mxjax.hadamard(a, 16))(jnp.asarray(x))
    assert y.dtype == jnp.bfloat16
    want = ref.hadamard(x, 16).astype(np.float32).astype(ml_dtypes.bfloat16)
    np.testing.assert_allclose(np.asarray(y, np.float32), want.astype(np.float32),
                               rtol=2.0**-7, atol=0)


class JitAgreementTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hadamard(self):
        x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 64)), jnp.float32)
        signs = mxjax.fixed_signs(0, 32)
        fn = self.variant(functools.partial(mxjax.hadamard, block_size=32, axis=1))
        np.testing.assert_allclose(np.asarray(fn(x, signs=signs)),
                                   ref.hadamard(np.asarray(x), 32, 1, np.asarray(signs)),
                                   rtol=0, atol=_atol(32, x))


def test_fixed_signs_deterministic_by_seed():
    for h in SIZES:
        a, b = mxjax.fixed_signs(0, h), mxjax.fixed_signs(0, h)
        assert a.shape == (h,) and a.dtype == jnp.float32
        chex.assert_trees_all_equal(a, b)
        assert set(np.unique(np.asarray(a)).tolist()) <= {-1.0, 1.0}
    seeds = [np.asarray(mxjax.fixed_signs(s, 16)) for s in range(8)]
    assert len({s.tobytes() for s in seeds}) > 1


def test_random_signs_differ_by_key():
    f = jax.jit(mxjax.random_signs, static_argnums=1)
    a, a2 = f(jax.random.key(0), 64), f(jax.random.key(0), 64)
    b = f(jax.random.key(1), 64)
    assert a.shape == (64,) and a.dtype == jnp.float32
    assert set(np.unique(np.asarray(a)).tolist()) == {-1.0, 1.0}
    chex.assert_trees_all_equal(a, a2)
    assert np.any(np.asarray(a) != np.asarray(b))


def test_bad_arguments_raise_naming_the_argument():
    x = jnp.ones((4, 64), jnp.float32)
    with pytest.raises(ValueError, match="block_size"):
        mxjax.hadamard(x, 24)
    with pytest.raises(ValueError, match="block_size"):
        mxjax.hadamard(jnp.ones((4, 256)), 256)
    with pytest.raises(ValueError, match="block_size"):
        mxjax.fixed_signs(0, 48)
    with pytest.raises(ValueError, match=r"x: .*multiple of block_size"):
        mxjax.hadamard(jnp.ones((4, 40)), 16)
    with pytest.raises(ValueError, match="axis"):
        mxjax.hadamard(x, 16, axis=2)
    with pytest.raises(TypeError, match="x"):
        mxjax.hadamard(jnp.ones((4, 64), jnp.int32), 16)
    with pytest.raises(ValueError, match="signs"):
        mxjax.hadamard(x, 16, signs=jnp.ones(32))
