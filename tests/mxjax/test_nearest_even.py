"""Round to nearest, ties to even: the library's two forms, bit for bit, against ml_dtypes.

The f32-addition form (`mxjax.elements.nearest_even_value` / `nearest_even_code`, behind
`round_to_value`, `round_to_grid`, the in-place forms and the one-pass FP4 kernel) and the
integer form (`mxjax.e2m1_bits.e2m1_values`, MXFP4 on XLA:CPU) against ml_dtypes' casts
(IEEE round to nearest even) and against each other, on ties, grid points and their
neighbours, saturation, zeros, f32 subnormals, NaN and Inf, from every input dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mxjax import e2m1_bits, elements
from mxjax import formats as F

# Each element format and ml_dtypes' type of it (ml_dtypes rounds to nearest even).
ML_TYPES = {"e2m1": ml_dtypes.float4_e2m1fn, "e4m3": ml_dtypes.float8_e4m3fn,
            "e5m2": ml_dtypes.float8_e5m2}
ELEMENTS = (F.E2M1, F.E4M3, F.E5M2)
INPUT_DTYPES = (np.float32, ml_dtypes.bfloat16, np.float16)


def _adversarial(elem: F.ElementFormat, dtype) -> np.ndarray:
    """f32 values of `dtype`: every grid point and midpoint (ties) of `elem`'s grid, one
    f32 ulp either side, beyond the top, f32 subnormals, ±0, NaN, ±Inf, both signs."""
    steps = np.exp2(np.arange(elem.emin - elem.mbits - 1, elem.emax + 3, dtype=np.float64))
    grid = np.concatenate([k * steps for k in range(1, 1 << (elem.mbits + 2))])
    grid = grid.astype(np.float32)
    near = np.concatenate([np.nextafter(grid, d) for d in (np.float32(-np.inf),
                                                           np.float32(np.inf))])
    rng = np.random.default_rng(len(elem.name))
    subnormals = np.concatenate([1 << np.arange(23), rng.integers(1, 1 << 23, 32)])
    specials = np.float32([0.0, 1e30, 3.4e38, np.inf, 2.0**-126, elem.max_normal * 1.0625])
    y = np.concatenate([grid, near, subnormals.astype(np.uint32).view(np.float32), specials])
    y = np.concatenate([y, -y, np.float32([np.nan, -np.nan])])
    with np.errstate(over="ignore"):  # beyond f16's top: Inf, as the cast of an input gives
        return y.astype(dtype).astype(np.float32)


def _ml_round(y: np.ndarray, elem: F.ElementFormat) -> np.ndarray:
    """ml_dtypes' round to nearest even, saturated at max_normal (ml_dtypes overflows to
    Inf/NaN instead); NaN stays NaN."""
    q = y.astype(ML_TYPES[elem.name]).astype(np.float32)
    top = np.float32(elem.max_normal)
    return np.where(np.abs(y) > top, np.copysign(top, y), q).astype(np.float32)


@functools.cache
def _value_fn(elem):
    return jax.jit(lambda y: elements.round_to_value(y, elem, F.Rounding.NEAREST_EVEN))


@functools.cache
def _code_fn(elem):
    return jax.jit(lambda y: elements.round_to_grid(y, elem, F.Rounding.NEAREST_EVEN))


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("elem", ELEMENTS, ids=lambda e: e.name)
def test_the_addition_form_is_ml_dtypes_round_to_nearest_even(elem, dtype):
    y = _adversarial(elem, dtype)
    want = _ml_round(y, elem)
    got = np.asarray(_value_fn(elem)(jnp.asarray(y)))
    nan = np.isnan(y)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()
    # The codes: ml_dtypes' bytes (sign bit apart), max_code past the top.
    sign, code = (np.asarray(v) for v in _code_fn(elem)(jnp.asarray(y)))
    finite = np.isfinite(y)
    in_range = finite & (np.abs(y) <= elem.max_normal)
    want_code = y[in_range].astype(ML_TYPES[elem.name]).view(np.uint8) & (elem.sign_bit - 1)
    np.testing.assert_array_equal(code[in_range], want_code)
    np.testing.assert_array_equal(code[~in_range & ~nan], elem.max_code)
    np.testing.assert_array_equal(sign[~nan], np.signbit(y[~nan]).astype(np.uint32))


# Scale exponents at which both forms are exact on every platform (the grid's half step at
# least 2^-126: the f32 addition never meets a subnormal that matters) and C stays normal.
SCALES = (-124, -123, -64, -3, -1, 0, 1, 7, 64, 100)


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_the_integer_and_addition_forms_agree_and_are_ml_dtypes_at_every_scale(dtype):
    """`e2m1_values` (integer form) and `nearest_even_value` (addition form) on x in blocks
    of scale 2^s: bit for bit, and ml_dtypes' rounding of x / 2^s (exact in float64)."""
    base = _adversarial(F.E2M1, np.float32)
    xs, ss = [], []
    for s in SCALES:
        with np.errstate(over="ignore"):
            x = np.ldexp(base.astype(np.float64), s).astype(np.float32).astype(dtype)
        xs.append(x.astype(np.float32))
        ss.append(np.full(x.shape, s, np.int32))
    x, s = jnp.asarray(np.concatenate(xs)), jnp.asarray(np.concatenate(ss))
    integer = np.asarray(jax.jit(lambda x, s: e2m1_bits.e2m1_values(
        x, s, ~jnp.isfinite(x), F.Rounding.NEAREST_EVEN))(x, s))
    addition = np.asarray(jax.jit(lambda x, s: elements.nearest_even_value(x, F.E2M1, s))(x, s))
    x, s = np.asarray(x), np.asarray(s)
    finite = np.isfinite(x)
    np.testing.assert_array_equal(integer[finite].view(np.uint32),
                                  addition[finite].view(np.uint32))
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.ldexp(x.astype(np.float64), -s).astype(np.float32)
        want = np.ldexp(_ml_round(y, F.E2M1).astype(np.float64), s).astype(np.float32)
    np.testing.assert_array_equal(addition[finite].view(np.uint32),
                                  want[finite].view(np.uint32))
    # Non-finite: the integer form marks its block NaN; the addition form gives NaN for NaN
    # and saturates Inf (a block holding either is NaN in every caller).
    assert np.isnan(integer[~finite]).all()
    assert np.isnan(addition[np.isnan(x)]).all()
    inf = np.isinf(x)
    np.testing.assert_array_equal(addition[inf], np.copysign(np.ldexp(6.0, s[inf]), x[inf]))
