"""The weight operand's quantization in a wrapped program depends on parameters alone.

A data-dependence analysis of the wrapped program's jaxpr: every equation's
outputs depend on all of its inputs (``optimization_barrier`` included: a
barrier that ties both operands makes the weight's quantization wait for the
activation), recursing into jit/custom_vjp/remat bodies with their inputs mapped.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jcore

import mxjax.nn as mnn

_CALL_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _read(env: dict, v) -> frozenset:
    return frozenset() if isinstance(v, jcore.Literal) else env[v]


def _step(eqn, args: list, positional_barrier: bool, dots: list | None) -> list:
    """Dependences of one equation's outputs; dot_generals in sub-jaxprs go to `dots`."""
    if eqn.primitive.name == "cond":  # e.g. lax.platform_dependent: every branch counts
        outs = [_deps(br, args[1:], positional_barrier, dots) for br in eqn.params["branches"]]
        return [frozenset().union(args[0], *col) for col in zip(*outs, strict=True)]
    sub = next((eqn.params[k] for k in _CALL_KEYS if isinstance(
        eqn.params.get(k), (jcore.Jaxpr, jcore.ClosedJaxpr))), None)
    if sub is not None and eqn.primitive.name not in ("scan", "while"):
        return _deps(sub, args, positional_barrier, dots)
    if positional_barrier and eqn.primitive.name == "optimization_barrier":
        return args
    return [frozenset().union(*args)] * len(eqn.outvars)


def _deps(jaxpr, ins: list, positional_barrier: bool, dots: list | None = None) -> list:
    """Which inputs each output depends on (sets of input labels); `dots` collects the
    (lhs, rhs) dependences of the dot_generals, sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    env = {v: frozenset() for v in jaxpr.constvars}
    env.update(zip(jaxpr.invars, ins, strict=True))
    for eqn in jaxpr.eqns:
        args = [_read(env, v) for v in eqn.invars]
        if dots is not None and eqn.primitive.name == "dot_general":
            dots.append(tuple(args))
        env.update(zip(eqn.outvars, _step(eqn, args, positional_barrier, dots), strict=True))
    return [_read(env, v) for v in jaxpr.outvars]


def _quantized_gemm_operand_deps(jaxpr, positional_barrier: bool) -> list:
    """For each quantized GEMM (a custom_vjp_call): deps of its inner dots' (lhs, rhs).

    The forward GEMM has one dot per lowering platform (the CPU, GPU and TPU forms,
    `lax.platform_dependent`), so each quantized GEMM contributes three."""
    found: list = []
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name != "custom_vjp_call":
            continue
        body = eqn.params["call_jaxpr"]
        n = eqn.params.get("num_consts", 0)  # constants first, then (lhs, rhs, ...)
        n_in = len(getattr(body, "jaxpr", body).invars)
        names = ["const"] * n + ["lhs", "rhs"] + ["other"] * (n_in - n - 2)
        _deps(body, [frozenset({name}) for name in names], positional_barrier, found)
    return found


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="down")(jax.nn.relu(nn.Dense(32, name="up")(x)))


def _wrapped_jaxpr(policy):
    m, x = MLP(), jnp.ones((8, 16))
    v = m.init(jax.random.key(0), x)
    return jax.make_jaxpr(mnn.wrap(m, policy).apply)(v, x)


@pytest.mark.parametrize("policy", ["mxfp4_all", "mxfp4_all_h16"])
def test_weight_quantization_is_computed_apart_from_the_barriers(policy):
    # Treating optimization_barrier as the identity it is per operand: the
    # weight side (rhs) is quantized from the weight alone. Guards the analysis
    # below (it finds both GEMMs) and everything but the barriers.
    found = _quantized_gemm_operand_deps(_wrapped_jaxpr(policy), positional_barrier=True)
    assert len(found) == 2 * 3  # two layers x (CPU, GPU, TPU) forms
    for lhs, rhs in found:
        assert "lhs" in lhs and "rhs" not in lhs
        assert "rhs" in rhs and "lhs" not in rhs


@pytest.mark.parametrize("policy", ["mxfp4_all", "mxfp4_all_h16"])
def test_weight_quantization_depends_on_parameters_alone(policy):
    found = _quantized_gemm_operand_deps(_wrapped_jaxpr(policy), positional_barrier=False)
    assert len(found) == 2 * 3  # two layers x (CPU, GPU, TPU) forms
    for lhs, rhs in found:
        assert "lhs" not in rhs, "the weight's quantization waits for the activation"
