"""JAX caches the traces of the emulated GEMM and of the quantizer (both jitted, inlined).

Tracing, not compiling, dominates small quantized programs: every GEMM traces its
CPU, GPU and TPU forms (`lax.platform_dependent` stages out all of them). These
tests count how often the Python bodies run, by wrapping a function they look up
at trace time; the shapes are this file's own, and JAX's caches are cleared first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import quantization
from mxjax.emulation import forms

DIMS = (((1,), (0,)), ((), ()))


@pytest.fixture
def cpu_form_traces(monkeypatch):
    """A list that gets one entry per trace of a GEMM's CPU form (`forms._cpu_gemm`, which
    the canonical form and the form of a packed rhs, the backward's, both run)."""
    jax.clear_caches()
    calls = []
    inner = forms._cpu_gemm

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return inner(*args, **kwargs)

    monkeypatch.setattr(forms, "_cpu_gemm", counted)
    yield calls
    jax.clear_caches()  # the cached traces hold the counting wrapper


def _loss(policy, layers):
    def loss(x, ws):
        for w in ws[:layers]:
            x = jnp.tanh(mxjax.dot_general(x, w, DIMS, policy=policy))
        return jnp.sum(x * x)
    return loss


def test_layers_of_the_same_shapes_trace_each_gemm_once(cpu_form_traces):
    x = jax.random.normal(jax.random.key(0), (40, 56))
    ws = [jax.random.normal(jax.random.key(i), (56, 56)) * 0.1 for i in range(1, 4)]
    grad = jax.jit(jax.grad(_loss("mxfp4_all_h16", 3), argnums=(0, 1)))
    want = jax.jit(jax.grad(_loss("mxfp4_all_h16", 1), argnums=(0, 1)))
    jax.block_until_ready(want(x, ws))
    # dgrad and wgrad of one layer (on their packed residuals); fprop, deterministic MX,
    # takes `forms._canonical_cpu_form`'s blockwise operands (per shard where sharded)
    assert len(cpu_form_traces) == 2
    gx, gws = grad(x, ws)
    # Three layers, one more jitted program: the same traces serve them all.
    assert len(cpu_form_traces) == 2
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in (gx, *gws))
    # New shapes are new traces (the backward traces dgrad and wgrad even when only
    # dx is asked for).
    jax.jit(jax.grad(_loss("mxfp4_all_h16", 1)))(x[:24], ws)
    assert len(cpu_form_traces) == 4


def test_a_cached_trace_gives_the_same_bits_as_a_fresh_one(cpu_form_traces):
    x = jax.random.normal(jax.random.key(5), (40, 56))
    ws = [jax.random.normal(jax.random.key(6), (56, 56)) * 0.1]
    loss = _loss("mxfp4_all", 1)
    first = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, ws)
    n = len(cpu_form_traces)
    again = jax.jit(jax.value_and_grad(lambda a, b: loss(a, b), argnums=(0, 1)))(x, ws)
    assert len(cpu_form_traces) == n
    jax.clear_caches()
    fresh = jax.jit(jax.value_and_grad(lambda a, b: loss(a, b), argnums=(0, 1)))(x, ws)
    assert len(cpu_form_traces) == 2 * n
    for got in (again, fresh):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(first)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_eager_quantizer_calls_of_one_shape_trace_once(monkeypatch):
    jax.clear_caches()
    calls = []
    inner = quantization.round_to_value

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(quantization, "round_to_value", counted)
    x = jax.random.normal(jax.random.key(1), (24, 72))
    first = mxjax.fake_quantize(x, "nvfp4", axis=1)
    assert len(calls) == 1
    again = mxjax.fake_quantize(x * 2, "nvfp4", axis=1)
    assert len(calls) == 1
    mxjax.fake_quantize(x, "nvfp4", axis=0)  # another axis: another trace
    assert len(calls) == 2
    assert first.shape == x.shape and first.dtype == x.dtype
    jax.clear_caches()
    fresh = jax.jit(lambda v: mxjax.fake_quantize(v, "nvfp4", axis=1))(x * 2)
    assert len(calls) == 3
    np.testing.assert_array_equal(np.asarray(again), np.asarray(fresh))
    jax.clear_caches()
