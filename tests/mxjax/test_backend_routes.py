"""The interceptor runs all three GEMMs on each route that runs on CPU ('xla_fp8',
'xla_fp4', and 'auto'), with the emulation's values, and refuses what a route cannot do."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import backends, policies


def _loss_and_grads(policy, x, w, key):
    def loss(x, w):
        y = mxjax.dot_general(x, w, (((1,), (0,)), ((), ())), policy=policy, key=key)
        return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("name", ["mxfp4_all_h16",
                                  pytest.param("mxfp4_all_sr", marks=pytest.mark.slow)])
def test_routes_match_the_emulation_for_all_three_gemms(name):
    # Every route in one test: the emulation's program is compiled once for them.
    x = jax.random.normal(jax.random.key(1), (16, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (64, 32), jnp.float32)
    key = jax.random.key(3)
    ref_policy = policies.get(name)
    want = _loss_and_grads(ref_policy, x, w, key)
    for backend in ("xla_fp8", "xla_fp4", "auto"):
        got = _loss_and_grads(ref_policy.with_backend(backend), x, w, key)
        # Products of MXFP4 values are exact in f32; only the summation order of a route
        # may differ (tolerance of mxjax.kernels.GEMM_TOLERANCE_DOC, K <= 64 here).
        chex.assert_trees_all_close(got, want, rtol=2e-6, atol=2e-6, custom_message=backend)
        assert np.isfinite(np.asarray(got[0])), backend


def test_explicit_route_with_unsupported_format_raises():
    policy = policies.get("fp8").with_backend("xla_fp8")
    x = jnp.ones((8, 32))
    w = jnp.ones((32, 8))
    with pytest.raises(ValueError, match="MXFP4 x MXFP4 only"):
        mxjax.dot_general(x, w, (((1,), (0,)), ((), ())), policy=policy)
    with pytest.raises(ValueError, match=r"policy\.fprop\.backend: .*MXFP4 x MXFP4 only"):
        policy.check_backends()


def test_triton_backend_without_gpu_raises_instead_of_falling_back():
    if backends.capabilities().platform == "gpu":
        pytest.skip("this check is for machines without a GPU")
    policy = policies.get("mxfp4_all").with_backend("triton")
    with pytest.raises(RuntimeError):
        mxjax.dot_general(jnp.ones((8, 32)), jnp.ones((32, 8)), (((1,), (0,)), ((), ())),
                          policy=policy)
    with pytest.raises(backends.BackendUnavailableError,
                       match=r"policy\.fprop\.backend: .*'triton' cannot run"):
        policy.check_backends()
