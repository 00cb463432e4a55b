"""wrap on layers whose compute dtype is narrower than their parameters (Flax's ``dtype=bf16,
param_dtype=f32``): the policy gets the f32 weight as stored, with ``operand_dtype`` the
compute dtype, and the GEMM is bit for bit the one of the cast weight."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mxjax.nn as mnn
from mxjax import policies

BF16, F32 = jnp.bfloat16, jnp.float32


class Layer(nn.Module):
    dtype: object = BF16
    param_dtype: object = F32
    dot_general: object = None

    @nn.compact
    def __call__(self, x):
        kw = {} if self.dot_general is None else {"dot_general": self.dot_general}
        return nn.gelu(nn.Dense(96, dtype=self.dtype, param_dtype=self.param_dtype,
                                name="up", **kw)(x))


def _x(dtype=F32):
    return jax.random.normal(jax.random.key(0), (6, 70), dtype)  # K = 70: not a multiple of 32


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype, (x.dtype, y.dtype)
        np.testing.assert_array_equal(np.asarray(x.astype(F32)), np.asarray(y.astype(F32)))


def _policy_operands(fn, *args) -> list[tuple[str, tuple]]:
    """(dtype, shape) of the 2-D float operands the policies' GEMMs are called with (the
    custom_vjp calls of the traced program)."""
    got = []
    for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns:
        if e.primitive.name == "custom_vjp_call":
            got += [(str(v.aval.dtype), tuple(v.aval.shape)) for v in e.invars
                    if v.aval.ndim == 2 and jnp.issubdtype(v.aval.dtype, jnp.floating)]
    return got


def _loss(apply):
    return lambda v, x: jnp.sum(apply(v, x).astype(F32) ** 2)


def test_linen_bf16_dense_gets_its_f32_kernel_uncast_with_the_same_bits():
    pol = policies.get("mxfp4_all_h16")
    x = _x()
    plain, built = Layer(), Layer(dot_general=pol.dot_general())
    v = plain.init(jax.random.key(1), x)
    wrapped = mnn.wrap(plain, [mnn.Rule(path=".*", policy=pol)])
    ours = jax.jit(jax.value_and_grad(_loss(wrapped.apply), (0, 1)))(v, x)
    theirs = jax.jit(jax.value_and_grad(_loss(built.apply), (0, 1)))(v, x)
    _leaves_equal(ours, theirs)  # loss, every parameter's and the input's gradient
    assert ours[1][0]["params"]["up"]["kernel"].dtype == F32

    # the f32 kernels (and the f32 input) reach the policy; a model built with the policy
    # hands it Flax's bf16 copies (so this check can fail)
    got = _policy_operands(wrapped.apply, v, x)
    assert ("float32", (70, 96)) in got and ("float32", (6, 70)) in got, got
    built_ops = _policy_operands(built.apply, v, x)
    assert ("bfloat16", (70, 96)) in built_ops and ("float32", (70, 96)) not in built_ops


def test_a_widening_cast_stays_where_it_is():
    """bf16 parameters computed in f32: the policy gets the f32 values (nothing narrower to
    hand over; the program is the one it was)."""
    pol = policies.get("mxfp4_all_h16")
    x = _x()
    plain = Layer(dtype=F32, param_dtype=BF16)
    v = plain.init(jax.random.key(1), x)
    wrapped = mnn.wrap(plain, [mnn.Rule(path=".*", policy=pol)])
    got = _policy_operands(wrapped.apply, v, x)
    assert ("float32", (70, 96)) in got and ("bfloat16", (70, 96)) not in got, got


def test_nnx_bf16_linear_gets_its_f32_kernel_uncast_with_the_same_bits():
    pol = policies.get("mxfp4_all_h16")
    x = _x(BF16)

    def linear(**kw):
        return nnx.Linear(70, 48, dtype=BF16, param_dtype=F32, rngs=nnx.Rngs(0), **kw)

    plain, built = linear(), linear(dot_general=pol.dot_general())
    wrapped = mnn.wrap(plain, [mnn.Rule(path=".*", policy=pol)])

    def loss(m):
        return jnp.sum(m(x).astype(F32) ** 2)

    step = nnx.jit(lambda m: nnx.value_and_grad(loss)(m))
    l1, g1 = step(wrapped)
    l2, g2 = step(built)
    _leaves_equal((l1, nnx.state(g1.module, nnx.Param)), (l2, nnx.state(g2, nnx.Param)))
    got = _policy_operands(lambda m: m(x), wrapped)
    assert ("float32", (70, 48)) in got, got
