"""The top of the range (finite in, finite out) and sr_prescale validation.

Bit-exact against tests/reference.py, which finds the largest allowed scale exponent
by search (`top_scale_exponent`) where mxjax uses a closed form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mxjax
from mxjax.scaling import max_scale_exponent
from tests import reference as ref
from tests.mxjax.test_quantize import _check, _unit

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
MX = ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2")
RULES = ("floor", "even", "ceil", "rceil")


def _top_binade(dt) -> np.ndarray:
    """[4, 64]: every block's amax in the dtype's top binade (incl. the max itself), and
    a row that every EVEN/CEIL/RCEIL scale would previously have rounded up to Inf."""
    info = ml_dtypes.finfo(dt)
    top = float(info.max)
    half = float(2.0 ** (int(info.maxexp) - 1))  # smallest value of the top binade
    rng = np.random.default_rng(13)
    x = rng.uniform(-1, 1, size=(4, 64)) * top
    x[0, ::32] = top
    x[1] = np.linspace(half, top, 64)
    x[2] = -np.linspace(half * 1.74, top, 64)
    x[3, :32] = top
    x[3, 32:] = half * 1.75  # 3e38 in f32, 57344 in f16: the probes
    return x.astype(dt)


@functools.cache
def _unit_fn(fmt, rules, sr):
    """One jitted program for all `rules` (one compile per format and dtype, not per rule)."""
    kw = {"rounding": "stochastic", "sr_prescale": True} if sr else {}
    return jax.jit(lambda x, k: {r: _unit(x, fmt, -1, scale_rule=r, **kw, key=k if sr else None)
                                 for r in rules})


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("fmt", MX)
def test_top_of_range_is_finite_and_matches_reference(fmt, dt):
    x = _top_binade(DTYPES[dt])
    f = mxjax.formats.get(fmt)
    all_rules = _unit_fn(fmt, RULES, False)(jnp.asarray(x), None)
    for rule in RULES:
        got = all_rules[rule]
        for name in ("deq32", "deqdt", "fake"):
            assert np.isfinite(np.asarray(got[name], np.float32)).all(), (fmt, dt, rule, name)
        _check(x, -1, got, f, mxjax.ScaleRule(rule), mxjax.Rounding.NEAREST_EVEN, "top")


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("fmt", MX)
def test_top_of_range_with_sr_prescale(fmt, dt):
    # The 3/4 pre-scale's 4/3 on dequantize would overflow even FLOOR's top scale.
    x = _top_binade(DTYPES[dt])
    key = jax.random.key(5)
    u = np.asarray(jax.random.uniform(key, x.shape, jnp.float32))
    f = mxjax.formats.get(fmt)
    all_rules = _unit_fn(fmt, ("floor", "even"), True)(jnp.asarray(x), key)
    for rule in ("floor", "even"):
        got = all_rules[rule]
        assert np.isfinite(np.asarray(got["fake"], np.float32)).all(), (fmt, dt, rule)
        _check(x, -1, got, f, mxjax.ScaleRule(rule), mxjax.Rounding.STOCHASTIC, "top-sr",
               u=u, sr_prescale=True)


def test_max_scale_exponent_closed_form_matches_reference_search():
    elems = {"mxfp4": ref.E2M1, "mxfp8_e4m3": ref.FORMATS["mxfp8_e4m3"].elem,
             "mxfp8_e5m2": ref.FORMATS["mxfp8_e5m2"].elem}
    for fmt, relem in elems.items():
        elem = mxjax.formats.get(fmt).element
        for dt in DTYPES.values():
            for pre in (False, True):
                assert max_scale_exponent(dt, elem, pre) == \
                    ref.top_scale_exponent(dt, relem, pre), (fmt, dt, pre)


@pytest.mark.parametrize("fn", ["quantize", "fake_quantize", "fake_quantize_parts"])
@pytest.mark.parametrize("rounding", ["nearest_even", "toward_zero", "nearest_away"])
def test_sr_prescale_needs_stochastic_rounding(fn, rounding):
    x = jnp.ones((2, 32), jnp.float32)
    with pytest.raises(ValueError, match="sr_prescale: True needs rounding=STOCHASTIC, got "
                                         + rounding.upper()):
        getattr(mxjax.quantization, fn)(x, "mxfp4", rounding=rounding, sr_prescale=True)
    with pytest.raises(TypeError, match="sr_prescale: expected a bool"):
        getattr(mxjax.quantization, fn)(x, "mxfp4", sr_prescale="yes")
    # the valid combination still works (jitted: one compile instead of ~100 eager ones;
    # the checks above run at trace time either way)
    _valid_sr_prescale_fn(fn)(x, jax.random.key(0))


@functools.cache
def _valid_sr_prescale_fn(fn):
    quantizer = getattr(mxjax.quantization, fn)
    return jax.jit(lambda x, k: quantizer(x, "mxfp4", rounding="stochastic", key=k,
                                          sr_prescale=True))
