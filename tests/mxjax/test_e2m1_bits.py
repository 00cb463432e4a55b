"""mxjax.e2m1_bits: MXFP4 values by integer rounding of the bit pattern, bit for bit.

Against an independent numpy reference (the E2M1 grid as a table, float64 arithmetic,
where every value involved is exact) for every scale exponent class, ties, grid points,
their neighbours, saturation, f32 subnormals and zeros; against the generic quantizer
path (`_fake_quantize_generic`) on random bit patterns for every scale rule; and
`fake_quantize` taking this path. test_quantize.py checks fake_quantize, and so this
path, against tests/reference.py for every rule, rounding, dtype and axis.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mxjax
from mxjax import e2m1_bits
from mxjax import quantization as Q
from mxjax.formats import Rounding, ScaleRule
from mxjax.operand_recipe import OperandRecipe

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Scale exponents: the bottom (values and steps in the f32 subnormals), around the
# shift-24 boundary (-124), ordinary, and the top (s <= 125 for finite f32 amax).
SCALES = (-127, -126, -125, -124, -123, -121, -64, -3, 0, 5, 100, 124, 125)


def _reference(x: np.ndarray, s: int, rounding: Rounding) -> np.ndarray:
    """x rounded onto GRID * 2^s (saturated), in float64: exact for f32 x and s >= -127."""
    y = np.abs(x.astype(np.float64)) * 2.0 ** -s
    hi_idx = np.clip(np.searchsorted(GRID, y, side="left"), 1, len(GRID) - 1)
    lo, hi = GRID[hi_idx - 1], GRID[hi_idx]
    if rounding is Rounding.TOWARD_ZERO:
        q = np.where(y >= hi, hi, lo)
    else:
        mid = (lo + hi) / 2
        tie_up = (hi_idx % 2 == 0) if rounding is Rounding.NEAREST_EVEN else np.ones_like(y, bool)
        q = np.where(y > mid, hi, np.where(y < mid, lo, np.where(tie_up, hi, lo)))
    q = np.where(y >= GRID[-1], GRID[-1], q)
    return (np.copysign(q, x.astype(np.float64)) * 2.0 ** s).astype(np.float32)


def _adversarial(s: int) -> np.ndarray:
    """f32 values for scale 2^s: grid points, midpoints, one ulp either side, beyond the
    top, far below, f32 subnormals (every power of two and random patterns), zeros."""
    marks = np.concatenate([GRID, (GRID[1:] + GRID[:-1]) / 2, [7.0, 8.0, 12.0, 1e3, 0.25,
                                                               0.125, 2.0 ** -20]])
    base = (marks * 2.0 ** s).astype(np.float64)
    base = base[(base < 3.0e38) & (base >= 2.0 ** -149)].astype(np.float32)
    near = np.concatenate([base, np.nextafter(base, np.float32(np.inf)),
                           np.nextafter(base, np.float32(0))])
    rng = np.random.default_rng(s + 200)
    sub_bits = np.concatenate([1 << np.arange(23), rng.integers(1, 1 << 23, 64),
                               [0x7FFFFF, 0x400000, 0x400001, 0x3FFFFF]]).astype(np.uint32)
    vals = np.concatenate([near, sub_bits.view(np.float32), [0.0, 2.0 ** -126]])
    vals = np.concatenate([vals, -vals]).astype(np.float32)
    return np.concatenate([vals, np.float32([-0.0])])


@functools.cache
def _values_fn(rounding: Rounding):
    return jax.jit(lambda x, s: e2m1_bits.e2m1_values(x, s, jnp.zeros(s.shape, bool), rounding))


@pytest.mark.parametrize("rounding", e2m1_bits.ROUNDINGS, ids=lambda r: r.value)
def test_values_equal_the_grid_reference_for_every_scale_class(rounding):
    xs, ss = [], []
    for s in SCALES:
        v = _adversarial(s)
        xs.append(v)
        ss.append(np.full(v.shape, s, np.int32))
    x, s = np.concatenate(xs), np.concatenate(ss)
    got = np.asarray(_values_fn(rounding)(jnp.asarray(x), jnp.asarray(s)))
    want = np.concatenate([_reference(v, int(c[0]), rounding) for v, c in zip(xs, ss)])
    chex.assert_trees_all_equal(got.view(np.uint32), want.view(np.uint32))


def test_nonfinite_blocks_become_nan_and_bad_rounding_is_refused():
    x = jnp.asarray([[1.0, -2.0], [3.0, 0.0]], jnp.float32)
    out = e2m1_bits.e2m1_values(x, jnp.zeros((2, 1), jnp.int32),
                                jnp.asarray([[True], [False]]), Rounding.NEAREST_EVEN)
    assert np.isnan(np.asarray(out[0])).all()
    chex.assert_trees_all_equal(np.asarray(out[1]), np.float32([3.0, 0.0]))
    with pytest.raises(ValueError, match="rounding"):
        e2m1_bits.e2m1_values(x, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), bool),
                              Rounding.STOCHASTIC)


def test_applies_only_to_deterministic_mxfp4():
    assert e2m1_bits.applies(OperandRecipe(fmt=mxjax.MXFP4, scale_rule=ScaleRule.EVEN))
    assert not e2m1_bits.applies(OperandRecipe(fmt=mxjax.MXFP4, rounding=Rounding.STOCHASTIC))
    assert not e2m1_bits.applies(OperandRecipe(fmt=mxjax.MXFP8_E4M3))
    assert not e2m1_bits.applies(OperandRecipe(fmt=mxjax.NVFP4))
    assert not e2m1_bits.applies(OperandRecipe(fmt=mxjax.BF16))


@functools.cache
def _both_paths(rule: ScaleRule, rounding: Rounding):
    op = OperandRecipe(fmt=mxjax.MXFP4, scale_rule=rule, rounding=rounding)
    return jax.jit(lambda x: (Q._fake_quantize(x, op, 1, None),
                              Q._fake_quantize_generic(x, op, 1, None)))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), rule=st.sampled_from(tuple(ScaleRule)),
       rounding=st.sampled_from(e2m1_bits.ROUNDINGS))
def test_fake_quantize_takes_this_path_with_the_generic_paths_bits(data, rule, rounding):
    """Random f32 bit patterns (NaN, Inf, subnormals included), one block exponent range
    per row, blocks along axis 1 of length 50 (not a multiple of 32)."""
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    top = rng.integers(0, 256, size=(3, 1, 1))  # exponent field of each row's largest
    field = np.clip(top - rng.integers(0, 40, size=(3, 50, 2)), 0, 255)
    bits = (rng.integers(0, 2, size=field.shape) << 31) | (field << 23) | rng.integers(
        0, 1 << 23, size=field.shape)
    x = jnp.asarray(bits.astype(np.uint32).view(np.float32))
    new, generic = _both_paths(rule, rounding)(x)
    chex.assert_trees_all_equal(np.asarray(new).view(np.uint32),
                                np.asarray(generic).view(np.uint32))
