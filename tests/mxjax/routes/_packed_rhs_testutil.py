"""Helpers shared by the routes' packed-rhs (quantized residual) tests."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals's list

import mxjax
from mxjax import interceptor
from mxjax.residuals import saves_packed


def assert_packed_gradients_are_the_bf16_residuals(policy, x, w, dims, key, monkeypatch):
    """Through `mxjax.dot_general` under `policy` (a bf16 operand cast): both backward
    GEMMs save packed, the gradients are bit for bit those of the bf16 residuals, and X
    is saved as codes (uint8), not in bf16."""
    assert saves_packed(policy.dgrad) and saves_packed(policy.wgrad)

    def loss(x, w):
        y = mxjax.dot_general(x, w, dims, policy=policy, key=key, operand_dtype=jnp.bfloat16)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    def run(packed):
        with monkeypatch.context() as m:
            if not packed:
                m.setattr(interceptor, "saves_packed", lambda recipe: False)
            grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
            return grads, [(r.dtype, r.shape) for r, _ in saved_residuals(loss, x, w)]

    (got, packed), (want, plain) = run(True), run(False)
    chex.assert_trees_all_equal(got, want)
    assert (jnp.dtype(jnp.bfloat16), x.shape) in plain
    assert (jnp.dtype(jnp.bfloat16), x.shape) not in packed
    assert any(d == jnp.uint8 for d, _ in packed)


def normal_operands(shape_a=(64, 96), shape_b=(96, 80), dtype=jnp.bfloat16, seed=0):
    """Two standard-normal operands of the packed-rhs GEMM tests."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape_a), dtype),
            jnp.asarray(rng.standard_normal(shape_b), dtype))


def assert_randomized_backward_recipes_are_the_gemms(both, preset, dims):
    """A route's packed-rhs GEMM is its GEMM, bit for bit, for a randomized preset's dgrad and
    wgrad recipes with their key. ``both(a, b, key, dims=, recipe=)``: the two results."""
    from mxjax import policies

    a, b = normal_operands()
    for gemm in ("dgrad", "wgrad"):
        recipe = getattr(policies.get(preset), gemm)
        primal, packed = both(a, b, jax.random.key(3), dims=dims, recipe=recipe)
        chex.assert_trees_all_equal(primal, packed)
