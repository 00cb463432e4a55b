"""Second-order and forward-mode differentiation through mxjax.dot_general.

The defined meaning (docs/NUMERICS.md, "Second-order derivatives"): first-order
gradients are the policy's quantized dgrad/wgrad; differentiating a quantized GEMM
again uses the straight-through rule (the derivative of the unquantized product,
the quantization error held constant). Forward mode raises an mxjax message.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import policies

DIMS = (((1,), (0,)), ((), ()))
KEY = jax.random.key(3)


def _inputs():
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (8, 64), jnp.float32)
    w = jax.random.normal(k[1], (64, 16), jnp.float32) * 0.5
    vx = jax.random.normal(k[2], x.shape, jnp.float32)
    vw = jax.random.normal(k[3], w.shape, jnp.float32)
    return x, w, vx, vw


def _dot(policy, x, w):
    return mxjax.dot_general(x, w, DIMS, policy=policy, key=KEY)


def _hvps(loss, x, v):
    """(reverse-over-reverse, forward-over-reverse) Hessian-vector products."""
    rr = jax.grad(lambda z: jnp.vdot(jax.grad(loss)(z), v))(x)
    fr = jax.jvp(jax.grad(loss), (x,), (v,))[1]
    return rr, fr


@functools.partial(jax.jit, static_argnames="policy")
def _quadratic_hvps(policy, x, w, vx):
    return _hvps(lambda z: 0.5 * jnp.sum(_dot(policy, z, w) ** 2), x, vx)


@pytest.mark.parametrize("policy", policies.names())
def test_hvp_of_quadratic_equals_bf16_under_every_policy(policy):
    # For L = |x w|^2 / 2 the Hessian in x is (. w) w^T whatever y's value, so with the
    # straight-through rule every policy must give bf16's Hessian-vector product
    # (today: silently zero under every quantizing policy).
    x, w, vx, _ = _inputs()
    want = _quadratic_hvps("passthrough", x, w, vx)
    got = _quadratic_hvps(policy, x, w, vx)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-5)
    assert float(jnp.max(jnp.abs(got[0]))) > 1.0  # not the silent zeros of before


@pytest.mark.parametrize("policy", ["mxfp4_fprop", "mxfp4_all", "mxfp4_all_h16", "tseng"])
def test_hvp_of_cubic_matches_straight_through_formula(policy):
    # L = sum(y^3)/3, y = x w. The policy's gradient is dgrad_Q(y_q^2, w); its derivative
    # with the straight-through rule is (2 y_q * (v w)) w^T in x and x^T (2 y_q * (x v)) in
    # w, with y_q the policy's (quantized) forward value.
    x, w, vx, vw = _inputs()
    hi = jax.lax.Precision.HIGHEST
    mm = functools.partial(jnp.matmul, precision=hi)

    @jax.jit
    def all_hvps():  # y_q in the same program (eager, op by op, it costs seconds)
        loss_x = lambda z: jnp.sum(_dot(policy, z, w) ** 3) / 3
        loss_w = lambda z: jnp.sum(_dot(policy, x, z) ** 3) / 3
        return _dot(policy, x, w), _hvps(loss_x, x, vx), _hvps(loss_w, w, vw)

    yq, (rr_x, fr_x), (rr_w, fr_w) = all_hvps()
    want_x = mm(2 * yq * mm(vx, w), w.T)
    want_w = mm(x.T, 2 * yq * mm(x, vw))
    chex.assert_trees_all_close((rr_x, fr_x), (want_x, want_x), rtol=1e-5, atol=1e-4)
    chex.assert_trees_all_close((rr_w, fr_w), (want_w, want_w), rtol=1e-5, atol=1e-4)


def test_mixed_second_derivative_is_not_zero():
    # d/dw of dL/dx for L = sum(x w): the identity pattern, not zeros.
    x, w, _, _ = _inputs()
    x, w = x[:2, :32], w[:32, :4]

    @functools.partial(jax.jit, static_argnums=0)
    def mixed(policy):
        return jax.jacrev(jax.grad(lambda a, b: jnp.sum(_dot(policy, a, b)), 0), 1)(x, w)

    chex.assert_trees_all_close(mixed("mxfp4_all"), mixed("passthrough"), rtol=0, atol=0)
    assert float(jnp.sum(mixed("passthrough"))) == x.size * w.shape[1]


def test_hessian_of_bf16_policy_still_exact():
    x, w, _, _ = _inputs()
    h = jax.jit(jax.hessian(lambda z: 0.5 * jnp.sum(_dot("passthrough", z[None], w) ** 2)))(x[0])
    chex.assert_trees_all_close(h, np.asarray(w @ w.T), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(("how", "policy"), [("jvp", "fp8"), ("jit_jvp", "mxfp4_all"),
                                             ("jit_jacfwd", "mxfp4_all")])
def test_forward_mode_raises_mxjax_message(how, policy):
    # Eager jvp fails inside mxjax.dot_general; under jit JAX itself would fail only when
    # lowering, with its generic custom_vjp message. (fp8 keeps the eager cases cheap.)
    x, w, vx, _ = _inputs()
    x, w, vx = x[:2, :32], w[:32, :4], vx[:2, :32]
    f = lambda z: jnp.sum(_dot(policy, z, w))
    run = {
        "jvp": lambda: jax.jvp(f, (x,), (vx,)),
        "jit_jvp": lambda: jax.jit(lambda a, t: jax.jvp(f, (a,), (t,)))(x, vx),
        "jit_jacfwd": lambda: jax.jit(jax.jacfwd(f))(x),
    }[how]
    with pytest.raises(TypeError, match=rf"mxjax\.dot_general under policy {policy} .*"
                                        r"forward mode.*jax\.grad"):
        run()


def test_forward_mode_through_constants_and_bf16_still_works():
    x, w, vx, _ = _inputs()
    # The quantized GEMM only sees constants: nothing to forward-differentiate there.
    _, t = jax.jit(lambda: jax.jvp(lambda s: s * _dot("mxfp4_all", x, w), (2.0,), (1.0,)))()
    chex.assert_trees_all_equal(t, jax.jit(_dot, static_argnums=0)("mxfp4_all", x, w))
    # bf16 is lax.dot_general itself, forward mode included.
    _, t = jax.jit(lambda: jax.jvp(lambda z: _dot("passthrough", z, w), (x,), (vx,)))()
    chex.assert_trees_all_equal(t, jax.lax.dot_general(vx, w, DIMS))
