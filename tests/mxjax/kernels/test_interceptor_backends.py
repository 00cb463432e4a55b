"""The interceptor runs all three GEMMs through the kernel backends (interpret mode on CPU)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import kernels, policies
from mxjax import recipes as policy_mod


def _with_backend(policy, backend):
    return dataclasses.replace(
        policy,
        **{g: dataclasses.replace(getattr(policy, g), backend=backend)
           for g in ("fprop", "dgrad", "wgrad")},
    )


def _loss_and_grads(policy, x, w, key):
    def loss(x, w):
        y = mxjax.dot_general(x, w, (((1,), (0,)), ((), ())), policy=policy, key=key)
        return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


def test_backend_names_agree_with_kernels():
    assert policy_mod.BACKENDS == kernels.BACKENDS


@pytest.mark.parametrize("name", ["mxfp4_all_h16", "mxfp4_all_sr"])
def test_kernel_backend_matches_xla_for_all_three_gemms(name):
    # Both backends in one test: the xla reference program is compiled once for the two.
    x = jax.random.normal(jax.random.key(1), (16, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (64, 32), jnp.float32)
    key = jax.random.key(3)
    ref_policy = policies.get(name)
    want = _loss_and_grads(ref_policy, x, w, key)
    for backend in ("pallas", "auto"):
        got = _loss_and_grads(_with_backend(ref_policy, backend), x, w, key)
        # Products of MXFP4 values are exact in f32; only the summation order of the
        # kernel may differ (tolerance of mxjax.kernels.GEMM_TOLERANCE_DOC, K <= 64 here).
        chex.assert_trees_all_close(got, want, rtol=2e-6, atol=2e-6, custom_message=backend)
        assert np.isfinite(np.asarray(got[0])), backend


def test_explicit_kernel_backend_with_unsupported_format_raises():
    policy = _with_backend(policies.get("fp8"), "pallas")
    x = jnp.ones((8, 32))
    w = jnp.ones((32, 8))
    with pytest.raises(ValueError, match="MXFP4 x MXFP4 only"):
        mxjax.dot_general(x, w, (((1,), (0,)), ((), ())), policy=policy)


def test_triton_backend_without_gpu_raises_instead_of_falling_back():
    if kernels.capabilities().platform == "gpu":
        pytest.skip("this check is for machines without a GPU")
    policy = _with_backend(policies.get("mxfp4_all"), "triton")
    with pytest.raises(RuntimeError):
        mxjax.dot_general(jnp.ones((8, 32)), jnp.ones((32, 8)), (((1,), (0,)), ((), ())),
                          policy=policy)
