"""The fused quantize kernel bounds the scale by the input dtype like mxjax.quantize
(finite in, finite out at the top of the range)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mxjax import OperandRecipe
from mxjax import formats as F
from mxjax.kernels import QuantSpec, fused_quantize
from tests.mxjax.kernels._kernel_testutil import assert_same_mx, quantize


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_top_of_range_matches_quantize(dtype):
    top = float(jnp.finfo(dtype).max)
    x = np.linspace(top * 0.5, top, 64 * 32).reshape(64, 32)
    x[1::2] *= -1
    x = jnp.asarray(x, dtype)
    spec = QuantSpec(recipe=OperandRecipe(fmt=F.MXFP4, scale_rule=F.ScaleRule.EVEN))
    row, col = fused_quantize(x, row=spec, col=spec, block_rows=32, block_cols=32)
    for got, axis in ((row, 1), (col, 0)):
        want = quantize(x, spec.recipe.fmt, axis=axis, scale_rule=spec.recipe.scale_rule)
        assert_same_mx(got, want)
