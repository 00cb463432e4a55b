"""The quantizer's recipe form (one validated OperandRecipe) and its scaling schemes.

The keyword API (``mxjax.quantize(x, fmt, scale_rule=..., ...)``) is tested bit
for bit against the numpy reference in test_quantize.py; here the recipe form is
checked to be the same computation, each format to pick its one scheme, and the
recipe form to check only what belongs to the call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import formats as F
from mxjax import scaling
from mxjax.operand_recipe import OperandRecipe
from mxjax.quantization import (
    fake_quantize_parts,
    fake_quantize_parts_with,
    fake_quantize_with,
    quantize_with,
)

# One recipe per scheme and a few settings of each (incl. SR with the 3/4 pre-scale).
RECIPES = (
    OperandRecipe(fmt="mxfp4", scale_rule="even"),
    OperandRecipe(fmt="mxfp8_e5m2", scale_rule="rceil", rounding="stochastic",
                  sr_prescale=True),
    OperandRecipe(fmt="nvfp4", rounding="toward_zero"),
    OperandRecipe(fmt="fp8_e4m3", rounding="stochastic"),
    OperandRecipe(fmt="fp8_e5m2", rounding="nearest_away"),
)


def _hard(rng, shape=(6, 40)):
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(
        rng.integers(-12, 12, shape)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, :] = 0.0
    x[2, 5] = 1e-40
    x[3, 7] = 3e38
    x[4, 1] = 2.5  # a tie on the E2M1 grid
    return jnp.asarray(x)


@functools.cache
def _both_forms():
    def f(x, key):
        out = []
        for i, r in enumerate(RECIPES):
            kw = {"scale_rule": r.scale_rule, "rounding": r.rounding, "key": key,
                  "sr_prescale": r.sr_prescale}
            for axis in (i % 2,):  # both axes over the recipes (one compile, kept small)
                q1 = quantize_with(x, r, axis, key=key)
                q2 = mxjax.quantize(x, r.fmt, axis, **kw)
                out.append(((q1.codes, q1.scales, q1.tensor_scale),
                            (q2.codes, q2.scales, q2.tensor_scale)))
                out.append((fake_quantize_with(x, r, axis, key=key),
                            mxjax.fake_quantize(x, r.fmt, axis, **kw)))
                out.append((fake_quantize_parts_with(x, r, axis, key=key),
                            fake_quantize_parts(x, r.fmt, axis, **kw)))
                assert q1.fmt is q2.fmt and q1.axis == q2.axis and q1.sr_prescale == q2.sr_prescale
        return out
    return jax.jit(f)


def test_recipe_form_is_the_keyword_form_bit_for_bit(np_rng):
    x = _hard(np_rng)
    pairs = _both_forms()(x, jax.random.key(1))
    assert len(pairs) == len(RECIPES) * 3
    for got, want in pairs:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                          np.asarray(b).reshape(-1).view(np.uint8))


def test_recipe_form_eager_on_bf16():
    x = jnp.linspace(-7, 7, 64, dtype=jnp.bfloat16).reshape(2, 32)
    r = OperandRecipe(fmt="mxfp4", scale_rule="floor")
    np.testing.assert_array_equal(np.asarray(fake_quantize_with(x, r), np.float32),
                                  np.asarray(mxjax.fake_quantize(x, "mxfp4"), np.float32))
    assert fake_quantize_with(x, r).dtype == jnp.bfloat16


def test_each_format_has_one_scheme():
    for name in ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"):
        s = scaling.scheme_for(name)
        assert type(s) is scaling.E8M0Blocks and s.block_size == 32
        assert s.scale_rules == tuple(F.ScaleRule)
    s = scaling.scheme_for(F.NVFP4)
    assert type(s) is scaling.E4M3BlocksTensorScale and s.block_size == 16
    for name in ("fp8_e4m3", "fp8_e5m2"):
        s = scaling.scheme_for(name)
        assert type(s) is scaling.PerTensor and s.block_size == 1
        assert s.scale_rules == (F.ScaleRule.FLOOR,)
    for f in F.FORMATS.values():
        if not f.is_passthrough:
            assert OperandRecipe(fmt=f).scheme.element is f.element
    assert OperandRecipe(fmt="bf16").scheme is None
    with pytest.raises(ValueError, match="BF16 is pass-through"):
        scaling.scheme_for("bf16")


def test_recipe_form_checks_only_the_call():
    x = jnp.ones((2, 32), jnp.float32)
    with pytest.raises(TypeError, match="recipe: expected an mxjax.OperandRecipe"):
        quantize_with(x, "mxfp4")
    sr = OperandRecipe(fmt="mxfp4", rounding="stochastic")
    for fn in (quantize_with, fake_quantize_with, fake_quantize_parts_with):
        with pytest.raises(ValueError, match="key: STOCHASTIC rounding needs a PRNG key"):
            fn(x, sr)
        with pytest.raises(ValueError, match="axis: 2 is out of range"):
            fn(x, OperandRecipe(fmt="mxfp4"), 2)
        with pytest.raises(TypeError, match="x: expected a float32"):
            fn(jnp.ones((2, 32), jnp.int32), OperandRecipe(fmt="mxfp4"))
    passthrough = OperandRecipe(fmt="bf16")
    assert fake_quantize_with(x, passthrough) is x
    with pytest.raises(ValueError, match="fmt: BF16 is pass-through; there is nothing to quantize"):
        quantize_with(x, passthrough)
    with pytest.raises(ValueError, match="fmt: BF16 is pass-through"):
        fake_quantize_parts_with(x, passthrough)


def test_keyword_form_messages_name_its_arguments():
    x = jnp.ones((2, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"scale_rule: EVEN applies to E8M0-scaled MX formats "
                                         r"only; nvfp4 has a fixed scale computation \(pass"):
        mxjax.quantize(x, "nvfp4", scale_rule="even")
    with pytest.raises(ValueError, match=r"OperandRecipe: scale_rule=EVEN applies to E8M0"):
        OperandRecipe(fmt="nvfp4", scale_rule="even")
    # BF16 keyword calls ignore the scale rule, as before (nothing is quantized).
    assert mxjax.fake_quantize(x, "bf16", scale_rule="even") is x
    with pytest.raises(ValueError, match="key:"):
        mxjax.fake_quantize(x, "bf16", rounding="stochastic")
    assert mxjax.quantize(x, "mxfp4", sr_prescale=np.bool_(False)).sr_prescale is False


def test_describe_shows_a_scale_rule_only_where_it_is_a_choice():
    assert OperandRecipe(fmt="mxfp4", scale_rule="even").describe() == "mxfp4 even/nearest_even"
    assert OperandRecipe(fmt="nvfp4").describe() == "nvfp4 nearest_even"
    assert OperandRecipe(fmt="fp8_e5m2", rounding="stochastic",
                         sr_prescale=True).describe() == "fp8_e5m2 stochastic x3/4"
    assert mxjax.recipes.OperandRecipe is OperandRecipe is mxjax.OperandRecipe
