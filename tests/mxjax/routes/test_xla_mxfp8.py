"""MXFP8 quantized in place for the block-scaled dot (mxjax/routes/xla_mxfp8.py), on CPU.

* Each in-place operand is `mxjax.quantize_with`'s bit for bit: its f8 elements are the
  codes, its E8M0 scales the scale bytes, in both layouts a GEMM reads (contraction last
  or first), for E4M3 and E5M2, RCEIL and FLOOR scales, stochastic rounding from a key,
  a Hadamard, zeros, NaN and Inf blocks, and E8M0's extreme scales.
* The GEMM (XLA:CPU expands ``jax.nn.scaled_matmul`` into a dequantize and an f32 dot) is
  the emulation's in all three GEMMs of the ``mxfp8`` policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import OperandRecipe, Rounding, ScaleRule, backends, policies
from mxjax.emulation import in_place
from mxjax.operands import rotation_signs
from mxjax.quantization import quantize_with
from mxjax.recipes import GemmRecipe, Hadamard
from mxjax.rotation import hadamard
from mxjax.routes import xla_mxfp8

E4 = OperandRecipe(fmt=mxjax.MXFP8_E4M3, scale_rule=ScaleRule.RCEIL)


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    general = rng.standard_normal((48, 96)) * np.exp2(rng.uniform(-8, 8, (48, 1)))
    zeros = rng.standard_normal((32, 64))
    zeros[3, :] = 0.0
    zeros[4, 32:] = 0.0
    zeros[5, 1] = -0.0
    nan = rng.standard_normal((32, 64))
    nan[2, 7] = np.nan
    nan[9, 40] = np.inf
    # E8M0's ends: scale exponents near -127 (values down to E4M3's subnormals times
    # 2^-127, exact in f32 on this machine only as normals) and near the top.
    low = rng.standard_normal((32, 64)) * 2.0 ** -100
    high = rng.standard_normal((32, 64)) * 2.0 ** 120
    return {"general": general, "zeros": zeros, "nan": nan, "low": low, "high": high,
            "k80": rng.standard_normal((16, 80))}


def _operand(x, axis, op, key=None, h=None, signs=None):
    """The route's operand of x2 contracted along `axis` (its in-place view)."""
    k = x.shape[axis]
    step = max(32, h or 1)
    return jax.jit(lambda x, key, signs: xla_mxfp8.in_place_operand(
        in_place.contraction_view(x, (), (axis,)), op, key, k_out=-(-k // step) * step,
        hadamard_size=h, signs=signs))(x, key, signs)


def _want(x, axis, op, key=None, h=None, signs=None):
    """quantize_with of the canonical operand [F, K] (rotated first if h)."""
    x3 = jnp.moveaxis(x, axis, -1)
    if h is not None:
        pad = (-x3.shape[-1]) % h
        x3 = hadamard(jnp.pad(x3, ((0, 0), (0, pad))), h, axis=-1, signs=signs)
    return quantize_with(x3, op, -1, key=key)


def _assert_operand(got, q, f8):
    elements, scales = got
    assert elements.dtype == f8 and scales.dtype == jnp.float8_e8m0fnu
    codes = np.asarray(jax.lax.bitcast_convert_type(elements, jnp.uint8))[0]
    want = np.asarray(q.codes)
    np.testing.assert_array_equal(codes[:, :want.shape[-1]], want)
    assert not codes[:, want.shape[-1]:].any()
    sb = np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8))[0]
    np.testing.assert_array_equal(sb[:, :q.scales.shape[-1]], np.asarray(q.scales))


@pytest.mark.parametrize("axis", [1, 0], ids=["k_last", "k_first"])
@pytest.mark.parametrize("case", sorted(_cases()))
def test_in_place_operand_is_the_quantizers_bits(case, axis):
    x = jnp.asarray(_cases()[case], jnp.float32)
    x = x if axis == 1 else x.T
    _assert_operand(_operand(x, axis, E4), _want(x, axis, E4), jnp.float8_e4m3fn)


@pytest.mark.parametrize("op", [
    OperandRecipe(fmt=mxjax.MXFP8_E5M2),
    OperandRecipe(fmt=mxjax.MXFP8_E4M3, scale_rule=ScaleRule.FLOOR),
    OperandRecipe(fmt=mxjax.MXFP8_E4M3, rounding=Rounding.STOCHASTIC),
    OperandRecipe(fmt=mxjax.MXFP8_E5M2, rounding=Rounding.STOCHASTIC, sr_prescale=True),
], ids=["e5m2", "floor", "sr", "e5m2_sr_prescale"])
def test_formats_rules_and_stochastic_rounding_are_the_quantizers(op):
    x = jnp.asarray(_cases()["general"], jnp.float32)
    key = jax.random.key(5)
    f8 = xla_mxfp8.F8_DTYPES[op.fmt.element.name]
    for axis in (1, 0):
        xa = x if axis == 1 else x.T
        _assert_operand(_operand(xa, axis, op, key), _want(xa, axis, op, key), f8)


@pytest.mark.parametrize("h", [16, 32])
def test_hadamard_rotated_operand_is_the_quantizers_bits(h):
    had = Hadamard(block_size=h, seed=0)
    signs = rotation_signs(had, None)
    x = jnp.asarray(_cases()["general"], jnp.float32)
    _assert_operand(_operand(x, 1, E4, h=h, signs=signs), _want(x, 1, E4, h=h, signs=signs),
                    jnp.float8_e4m3fn)


def _grads(policy, x, w, key):
    def loss(x, w):
        y = mxjax.dot_general(x, w, (((1,), (0,)), ((), ())), policy=policy, key=key)
        return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


def test_mxfp8_policy_on_the_route_is_the_emulation_in_all_three_gemms():
    x = jax.random.normal(jax.random.key(1), (16, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (64, 32), jnp.float32)
    key = jax.random.key(3)
    want = _grads(policies.get("mxfp8"), x, w, key)
    got = _grads(policies.get("mxfp8").with_backend("xla_mxfp8"), x, w, key)
    # MXFP8 products are exact in f32; only the order of the f32 sums may differ.
    for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), rtol=2e-6, atol=2e-6)


def test_a_bf16_result_is_rounded_by_the_gemm_as_the_emulation_rounds_it():
    x = jax.random.normal(jax.random.key(1), (64, 96), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (96, 48), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    want = mxjax.dot_general(x, w, dims, policy=policies.get("mxfp8"))
    got = jax.jit(lambda x, w: mxjax.dot_general(
        x, w, dims, policy=policies.get("mxfp8").with_backend("xla_mxfp8")))(x, w)
    assert got.dtype == want.dtype == jnp.bfloat16
    # The same f32 sums up to their order, each rounded once to bf16: equal, or one bf16
    # step apart where the two orders' sums straddle a rounding boundary.
    g, w_ = np.asarray(got, np.float32), np.asarray(want, np.float32)
    step = np.exp2(np.floor(np.log2(np.maximum(np.abs(w_), 1e-30))) - 7)
    assert np.all(np.abs(g - w_) <= step)
    assert np.mean(g == w_) > 0.95


def test_mxfp8_route_gives_nan_where_the_emulation_does():
    x = jax.random.normal(jax.random.key(1), (16, 64), jnp.float32).at[3, 5].set(jnp.nan)
    w = jax.random.normal(jax.random.key(2), (64, 32), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    want = mxjax.dot_general(x, w, dims, policy=policies.get("mxfp8"))
    got = mxjax.dot_general(x, w, dims, policy=policies.get("mxfp8").with_backend("xla_mxfp8"))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(np.asarray(got)[3]).all() and not np.isnan(np.asarray(got)[4]).any()


def test_route_rejects_other_formats():
    with pytest.raises(ValueError, match="expected an MXFP8 operand recipe"):
        _operand(jnp.ones((4, 32)), 1, OperandRecipe(fmt=mxjax.MXFP4))
    with pytest.raises(ValueError, match="takes MXFP8 x MXFP8"):
        xla_mxfp8.mxfp8_gemm(jnp.ones((4, 32)), jnp.ones((4, 32)), (((1,), (1,)), ((), ())),
                             GemmRecipe(lhs=E4, rhs=OperandRecipe(fmt=mxjax.MXFP4)),
                             None, None, None)
    policy = policies.get("nvfp4").with_backend("xla_mxfp8")
    either = r"\(MXFP8_E4M3 \| MXFP8_E5M2\)"  # mixed pairs are served too (dY in E5M2)
    with pytest.raises(ValueError, match=rf"'xla_mxfp8' implements {either} x {either} only"):
        policy.check_backends()
    assert xla_mxfp8.ROUTE.serves("mxfp8_e5m2", "mxfp8_e4m3")


def test_capabilities_of_xla_mxfp8():
    from mxjax.chips import Chip, compute_capability_of

    for kind, ok in (("NVIDIA B200", True), ("NVIDIA H100 80GB HBM3", False)):
        caps = backends.capabilities_for(Chip(platform="gpu", device_kind=kind,
                                              compute_capability=compute_capability_of(kind)))
        assert caps.can_run("xla_mxfp8") is ok
