"""The Llama model under mxjax's real precision policies (mxjax.policies presets)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from llama_test_utils import max_abs, small

from models.llama import Llama
from mxjax import policies


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(3), (2, 16), 0, 128, dtype=jnp.int32)


@functools.partial(nnx.jit, static_argnames=("policy",))
def _loss_grads(model, tokens, policy=None, policy_key=None):
    def loss(m):
        logits = m(tokens, policy=policy, policy_key=policy_key)
        lse = jax.nn.logsumexp(logits, -1)
        return jnp.mean(lse - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]), logits
    (l, logits), g = nnx.value_and_grad(loss, has_aux=True)(model)
    return l, logits, g


def _bitwise_equal(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(
        lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bf16_policy_equals_no_policy_bit_for_bit(tokens, dtype):
    model = Llama(small(dtype=dtype), rngs=nnx.Rngs(0))
    l0, y0, g0 = _loss_grads(model, tokens)
    l1, y1, g1 = _loss_grads(model, tokens, policy=policies.get("passthrough"))
    assert np.array_equal(np.asarray(y0), np.asarray(y1))
    assert float(l0) == float(l1)
    assert _bitwise_equal(g0, g1)


@pytest.mark.slow
def test_mxfp4_all_h16_forward_backward(tokens):
    """(make test-slow: ~21 CPU-s.) The default run keeps a stronger check of the same
    program: tests/study/test_study_probe.py runs this Llama's forward and backward under
    mxfp4_all_h16 and compares every GEMM of every layer with the numpy reference."""
    model = Llama(small(), rngs=nnx.Rngs(0))
    l0, y0, g0 = _loss_grads(model, tokens)
    pol = policies.get("mxfp4_all_h16")
    l1, y1, g1 = _loss_grads(model, tokens, policy=pol)
    assert bool(jnp.isfinite(y1).all()) and np.isfinite(float(l1))
    leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
    assert all(bool(jnp.isfinite(g).all()) for g in leaves1)
    # quantization changes the numbers, but not beyond recognition
    assert max_abs(y0, y1) > 0
    assert abs(float(l0) - float(l1)) < 0.1 * abs(float(l0))
    gq0 = np.asarray(g0["layers"]["q_proj"]["kernel"][...])
    gq1 = np.asarray(g1["layers"]["q_proj"]["kernel"][...])
    cos = float(np.sum(gq0 * gq1) / np.linalg.norm(gq0) / np.linalg.norm(gq1))
    assert cos > 0.8, cos
    assert len(leaves0) == len(leaves1)


@pytest.mark.slow
def test_randomized_policy_needs_key_and_keys_matter(tokens):
    """(make test-slow: ~18 CPU-s.) The default run keeps each part at a cheaper level:
    the missing key (test_llama_model::test_policy_needing_key_without_key_raises), the
    per-layer keys the model folds (test_every_layer_and_projection_gets_its_own_key,
    test_noise_depends_on_key), and same key same
    result / other key other SR noise, fprop unaffected
    (test_dot_general::test_randomized_policies_same_key_same_result_different_key_different,
    test_gemms_never_share_noise)."""
    pol = policies.get("mxfp4_all_sr")
    assert pol.needs_key
    model = Llama(small(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="policy_key"):
        model(tokens, policy=pol)
    k1, k2 = jax.random.key(10), jax.random.key(11)
    _, ya, ga = _loss_grads(model, tokens, policy=pol, policy_key=k1)
    _, yb, gb = _loss_grads(model, tokens, policy=pol, policy_key=k1)
    _, yc, gc = _loss_grads(model, tokens, policy=pol, policy_key=k2)
    assert np.array_equal(np.asarray(ya), np.asarray(yb)) and _bitwise_equal(ga, gb)
    gqa = ga["layers"]["q_proj"]["kernel"][...]
    gqc = gc["layers"]["q_proj"]["kernel"][...]
    assert max_abs(gqa, gqc) > 0  # SR on the backward GEMMs follows the key
    assert np.array_equal(np.asarray(ya), np.asarray(yc))  # fprop rounds to nearest


@pytest.mark.slow
def test_randomized_policy_scan_equals_unrolled(tokens):
    """Scanned and unrolled layers fold the same per-layer keys (compiles 2 layers
    of quantized GEMMs unrolled: slow on CPU)."""
    pol = policies.get("mxfp4_all_sr")
    k1 = jax.random.key(10)
    _, ya, ga = _loss_grads(Llama(small(), rngs=nnx.Rngs(0)), tokens, policy=pol, policy_key=k1)
    unrolled = Llama(small(scan_layers=False), rngs=nnx.Rngs(0))
    _, yu, gu = _loss_grads(unrolled, tokens, policy=pol, policy_key=k1)
    assert max_abs(ya, yu) <= 1e-5
    assert max(jax.tree.leaves(jax.tree.map(max_abs, ga, gu))) <= 1e-4


@pytest.mark.slow
def test_remat_with_quantized_policy_matches_no_remat(tokens):
    """Recomputing the blocks re-runs the quantized forward bit-identically."""
    pol = policies.get("mxfp4_all_h16")
    plain = Llama(small(), rngs=nnx.Rngs(0))
    remat = Llama(small(remat=True), rngs=nnx.Rngs(0))
    lp, yp, gp = _loss_grads(plain, tokens, policy=pol)
    lr, yr, gr = _loss_grads(remat, tokens, policy=pol)
    assert max_abs(yp, yr) <= 1e-6 and abs(float(lp) - float(lr)) <= 1e-6
    assert max(jax.tree.leaves(jax.tree.map(max_abs, gp, gr))) <= 1e-5


def test_projections_hand_their_f32_kernels_to_the_policy_uncast():
    """A projection's f32 kernel reaches an mxjax policy as stored, with
    ``operand_dtype`` the compute dtype: bit for bit the GEMM of the cast kernel, value
    and gradients (the f32 kernel's gradient is the cast one's, cast back)."""
    from models.llama import _Gemms

    pol = policies.get("mxfp4_all_h16")
    x = jax.random.normal(jax.random.key(1), (2, 8, 64), jnp.bfloat16)
    kernel = jax.random.normal(jax.random.key(2), (64, 96), jnp.float32) * 0.1
    dn = (((2,), (0,)), ((), ()))

    def projected(x, kernel):
        return jnp.sum(_Gemms(pol, None, 0).project(0, x, kernel, dn).astype(jnp.float32) ** 2)

    def cast_first(x, kernel):
        y = pol.dot_general()(x, kernel.astype(x.dtype), dn)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    got = jax.jit(jax.value_and_grad(projected, (0, 1)))(x, kernel)
    want = jax.jit(jax.value_and_grad(cast_first, (0, 1)))(x, kernel)
    assert _bitwise_equal(got, want)
    assert got[1][1].dtype == jnp.float32
