"""The rotation at the top of the f32 range (docs/NUMERICS.md, "Hadamard near the top of the
range", issue 45): partial sums reach h * max|x| before the 1/sqrt(h) scaling, so a block
above FLT_MAX / h can overflow to Inf, and the GEMM outputs over it are NaN (never a silent
wrong finite value); at or below FLT_MAX / h everything is finite."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import policies

FLT_MAX = float(np.finfo(np.float32).max)
DN = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("h", [16, 32])
def test_rotation_is_finite_up_to_flt_max_over_h_and_overflows_above(h):
    at = jnp.full((2, 32), FLT_MAX / h, jnp.float32)
    assert bool(jnp.all(jnp.isfinite(mxjax.hadamard(at, block_size=h))))
    above = jnp.full((2, 32), 3e38, jnp.float32)
    assert not bool(jnp.all(jnp.isfinite(mxjax.hadamard(above, block_size=h))))


@pytest.mark.parametrize("name", ["mxfp4_all_h16", "mxfp4_all_h32"])
def test_h16_h32_gemm_near_flt_max_is_nan_not_a_wrong_number(name):
    """The exact product (3e38 * 1e-30 * 32 = 9.6e9) is finite; the rotated GEMM gives NaN in
    the rows whose block overflowed, finite values in the others; the same input at
    FLT_MAX / h is finite, and without rotation (mxfp4_all) 3e38 is finite."""
    x = jnp.full((4, 32), 1.0, jnp.float32).at[0].set(3e38)
    w = jnp.full((32, 4), 1e-30, jnp.float32)
    y = mxjax.dot_general(x, w, DN, policy=policies.get(name))
    assert bool(jnp.all(jnp.isnan(y[0]))) and bool(jnp.all(jnp.isfinite(y[1:])))
    h = 16 if name.endswith("16") else 32
    y = mxjax.dot_general(x.at[0].set(FLT_MAX / h), w, DN, policy=policies.get(name))
    assert bool(jnp.all(jnp.isfinite(y)))
    y = mxjax.dot_general(x, w, DN, policy=policies.get("mxfp4_all"))
    assert bool(jnp.all(jnp.isfinite(y)))
