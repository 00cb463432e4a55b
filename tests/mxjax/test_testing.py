"""mxjax.testing helpers, used on wrapped and policy-injected models.

Also: wrap costs nothing under bf16.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import mxjax.nn as mnn
import mxjax.testing as mt
from mxjax import policies


class MLP(nn.Module):
    dot_general: object = None

    @nn.compact
    def __call__(self, x):
        kw = {} if self.dot_general is None else {"dot_general": self.dot_general}
        h = jax.nn.gelu(nn.Dense(64, name="up", **kw)(x))
        return nn.Dense(32, name="down", **kw)(h)


X = jax.random.normal(jax.random.key(1), (16, 32))
PARAMS = MLP().init(jax.random.key(0), X)


@pytest.mark.slow
def test_wrapped_equals_injected_and_passthrough_is_exact():
    policy = policies.get("mxfp4_all")
    wrapped = mnn.wrap(MLP(), policy)
    mt.assert_equivalent(wrapped.apply, MLP(dot_general=policy.dot_general()).apply, PARAMS, X,
                         argnums=(0, 1))
    mt.assert_passthrough_exact(MLP().apply, mnn.wrap(MLP(), "passthrough").apply, PARAMS, X,
                                argnums=(0, 1))
    mt.assert_quantized_weight_matmuls(wrapped.report(PARAMS, X), policy, paths=("up", "down"))
    # The helpers fail when they should: quantized vs exact, a layer left out.
    with pytest.raises(AssertionError):
        mt.assert_passthrough_exact(MLP().apply, wrapped.apply, PARAMS, X, argnums=())
    partial = mnn.wrap(MLP(), mnn.Rule(path="up", policy=policy)).report(PARAMS, X)
    with pytest.raises(AssertionError, match="down"):
        mt.assert_quantized_weight_matmuls(partial, policy)


def test_route_matches_the_reference_within_the_stated_bound():
    base = policies.get("mxfp4_fprop")
    fp8 = base.with_backend("xla_fp8")
    assert fp8 != base and mt.reference_policy(fp8) == base
    make = lambda p: mnn.wrap(MLP(), p).apply
    # f32 sums in another order: a few ulps of the output over a contraction of 32-64.
    mt.assert_matches_reference(make, fp8, PARAMS, X, argnums=(), rtol=1e-5, atol=1e-5)
    mt.assert_matches_reference(make, base, PARAMS, X)  # the reference itself: bit for bit
    with pytest.raises(ValueError, match="argnums"):
        mt.assert_equivalent(make(base), make(base), PARAMS, X, argnums=5)


def _hlo(fn, *args) -> str:
    return mt.program_text(jax.jit(fn).lower(*args).compile())


def _cuda_program(fn, *args) -> str:
    """StableHLO exported for CUDA (no device needed), without source locations."""
    text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    text = re.sub(r"\s*loc\(#loc\d*\)", "", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))


def test_wrapping_under_bf16_compiles_to_the_unwrapped_program():
    from tests.mxjax.nn.test_wrap_names import Stack
    from tests.mxjax.nn.test_wrap_names import X as XS  # remat + scan + einsum attention

    m = Stack()
    v = m.init(jax.random.key(0), XS)
    wrapped = mnn.wrap(m, mnn.Rule(path=".*", policy="passthrough", operands="any"))
    assert all(s.policy is not None for s in wrapped.report(v, XS).sites)

    def step(apply):
        return jax.value_and_grad(lambda v: jnp.sum(apply(v, XS) ** 2))

    plain_step, our_step = step(m.apply), step(wrapped.apply)  # traced once for both checks
    plain, ours = _hlo(plain_step, v), _hlo(our_step, v)
    assert len(re.findall(r"= \S+ dot\(", plain)) >= 6  # forward and backward GEMMs
    assert ours == plain
    # What a GPU gets: the exported CUDA program (before XLA) is the same too.
    plain, ours = _cuda_program(plain_step, v), _cuda_program(our_step, v)
    assert plain.count("stablehlo.dot_general") >= 6
    assert ours == plain


def test_program_text_drops_source_locations_but_not_the_computation():
    x = jnp.arange(8.0)

    def first():
        def f(v):
            return jnp.sin(v) * 2.0
        return f

    def second():  # the same computation, traced from other source lines
        def f(v):
            y = jnp.sin(v)
            return y * 2.0
        return f

    a, b = (jax.jit(make()).lower(x).compile() for make in (first, second))
    assert a.as_text() != b.as_text()  # the raw texts differ in their location tables
    assert "FileNames" in a.as_text()
    assert mt.program_text(a) == mt.program_text(b)
    def f(v):
        return jnp.sin(v) * 3.0
    other = jax.jit(f).lower(x).compile()
    assert mt.program_text(other) != mt.program_text(a)
