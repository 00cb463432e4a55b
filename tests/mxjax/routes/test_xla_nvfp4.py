"""NVFP4 on the block-scaled dot (mxjax/routes/xla_nvfp4.py), checked on this CPU machine.

* The operands are `mxjax.quantize_with`'s bit for bit: the f4 elements' bits are its
  codes, the E4M3 scales its scale bytes, the tensor scale its own; decoded by ml_dtypes
  they are its dequantized values (random data, zeros, all-zero blocks, NaN and Inf, the
  tensor scale's floor, values near f32's largest, K not a multiple of 32, batch axes),
  and stochastic rounding draws the same bits from the same key.
* The GEMM (XLA:CPU runs ``jax.nn.scaled_matmul`` as a dequantize and an f32 dot) is
  within docs/NUMERICS.md's bound of the exact product and of the emulation, Hadamard and
  stochastic rounding included, and NaN wherever the emulation is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import OperandRecipe, Rounding, backends, policies
from mxjax.dimensions import Dims
from mxjax.emulation import forms
from mxjax.quantization import quantize_with
from mxjax.recipes import GemmRecipe, Hadamard
from mxjax.routes import xla_nvfp4

U32 = 2.0 ** -24
RNE = OperandRecipe(fmt=mxjax.NVFP4)
SR = OperandRecipe(fmt=mxjax.NVFP4, rounding=Rounding.STOCHASTIC)
_operand = jax.jit(xla_nvfp4.nvfp4_operand, static_argnums=1)
_quantize = jax.jit(quantize_with, static_argnums=(1, 2))


def _unpack(codes) -> np.ndarray:
    c = np.asarray(codes, np.uint8)
    return np.stack([c & 0x0F, c >> 4], axis=-1).reshape(c.shape[:-1] + (c.shape[-1] * 2,))


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    general = rng.standard_normal((2, 3, 24, 100)) * np.exp2(rng.uniform(-6, 6, (2, 3, 24, 1)))
    zeros = rng.standard_normal((16, 96))
    zeros[2, :] = 0.0  # an all-zero row
    zeros[5, 16:32] = 0.0  # an all-zero block
    zeros[7, 3] = -0.0
    nan = rng.standard_normal((8, 64))
    nan[1, 5] = np.nan
    inf = rng.standard_normal((8, 64))
    inf[3, 40] = -np.inf
    tiny = rng.standard_normal((8, 64)) * 2.0 ** -130  # the tensor scale's floor
    huge = rng.standard_normal((8, 64)) * 2.0 ** 126  # amax / (6 * 448) near f32's top
    # Blocks far below the largest: E4M3 block scales underflow to subnormals and zero.
    spread = rng.standard_normal((8, 64)) * np.exp2(-np.arange(64)[None, :] // 16 * 6.0)
    return {"general": general, "zeros": zeros, "nan": nan, "inf": inf, "tiny": tiny,
            "huge": huge, "spread": spread, "k48": rng.standard_normal((4, 48)),
            "k16": rng.standard_normal((3, 16))}


@pytest.mark.parametrize("case", sorted(_cases()))
def test_operands_are_the_quantizers_bits(case):
    x = jnp.asarray(_cases()[case], jnp.float32)
    elements, scales, t = _operand(x, RNE, None)
    q = _quantize(x, RNE, -1)
    f, k = x.shape[-2], x.shape[-1]
    kp = -(-k // 32) * 32
    assert elements.dtype == jnp.float4_e2m1fn and scales.dtype == jnp.float8_e4m3fn
    assert elements.shape == (int(np.prod(x.shape[:-2])), f, kp)
    assert scales.shape == elements.shape[:-1] + (kp // 16,)
    codes = np.asarray(jax.lax.bitcast_convert_type(elements, jnp.uint4)).astype(np.uint8)
    want = _unpack(q.codes).reshape(-1, f, q.codes.shape[-1] * 2)
    np.testing.assert_array_equal(codes[..., :want.shape[-1]], want)
    assert not codes[..., want.shape[-1]:].any()  # the padding to 32: zero codes
    sbytes = np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8))
    want_s = np.asarray(q.scales).reshape(-1, f, q.scales.shape[-1])
    np.testing.assert_array_equal(sbytes[..., :want_s.shape[-1]], want_s)
    assert not sbytes[..., want_s.shape[-1]:].any()
    np.testing.assert_array_equal(np.asarray(t).view(np.uint32),
                                  np.asarray(q.tensor_scale).view(np.uint32))
    # Decoded by ml_dtypes, then the tensor scale: mxjax's dequantized values bit for bit.
    with np.errstate(invalid="ignore", over="ignore"):
        v = (np.asarray(elements).astype(np.float32)
             * np.repeat(np.asarray(scales).astype(np.float32), 16, axis=-1)) * np.float32(t)
    deq = np.asarray(mxjax.dequantize(q), np.float32).reshape(-1, f, k)
    got = v[..., :k]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(deq))
    ok = ~np.isnan(deq)
    np.testing.assert_array_equal(got[ok].view(np.uint32), deq[ok].view(np.uint32))


def test_stochastic_rounding_draws_the_emulations_bits_from_the_key():
    x = jax.random.normal(jax.random.key(0), (32, 80), jnp.float32)
    codes = {}
    for seed in (1, 2):
        key = jax.random.key(seed)
        elements, scales, _ = _operand(x, SR, key)
        q = _quantize(x, SR, -1, key=key)
        got = np.asarray(jax.lax.bitcast_convert_type(elements, jnp.uint4)).astype(np.uint8)
        want = _unpack(q.codes).reshape(1, 32, -1)
        np.testing.assert_array_equal(got[..., :want.shape[-1]], want)
        np.testing.assert_array_equal(
            np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8))[..., :5],
            np.asarray(q.scales).reshape(1, 32, -1))
        codes[seed] = got
    assert np.mean(codes[1] != codes[2]) > 0.1  # the key matters


_DIMS = Dims(((2,), (2,)), ((0,), (0,)))


def _gemm_operands(k=100):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 40, k)) * np.exp2(rng.uniform(-4, 4, (2, 40, 1)))
    b = rng.standard_normal((2, 24, k))
    return jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)


def _route(a3, b3, recipe, key):
    return np.asarray(jax.jit(lambda a, b, k: xla_nvfp4.ROUTE.gemm(
        a, b, dims=_DIMS, recipe=recipe, key=k, gemm_name="wgrad", platform="cpu"))(
            a3, b3, key), np.float64)


def _emulation(a3, b3, recipe, key):
    return np.asarray(jax.jit(lambda a, b, k: forms.emulated_gemm(
        a, b, _DIMS, recipe, k, "wgrad"))(a3, b3, key), np.float64)


def _dequantized(x, op, key, hadamard_key, recipe):
    """The emulation's operand (rotated as the recipe rotates it), dequantized, f64."""
    from mxjax.operands import rotate

    xr, _ = rotate(x, x, recipe, hadamard_key)
    return np.asarray(mxjax.dequantize(quantize_with(xr, op, -1, key=key)), np.float64)


@pytest.mark.parametrize("recipe", [
    GemmRecipe(lhs=RNE, rhs=RNE),
    GemmRecipe(lhs=SR, rhs=RNE, hadamard=Hadamard(block_size=16, seed=0)),
], ids=["fprop", "wgrad_sr_h16"])
def test_gemm_is_within_the_bound_of_the_exact_product_and_the_emulation(recipe):
    from mxjax.operands import split_key

    a3, b3 = _gemm_operands()
    key = jax.random.key(7)
    c = _route(a3, b3, recipe, key)
    emul = _emulation(a3, b3, recipe, key)
    k_lhs, k_rhs, k_had = split_key(key)
    aq = _dequantized(a3, recipe.lhs, k_lhs, k_had, recipe)
    bq = _dequantized(b3, recipe.rhs, k_rhs, k_had, recipe)
    k = aq.shape[-1]
    mag = np.einsum("bik,bjk->bij", np.abs(aq), np.abs(bq))
    exact = np.einsum("bik,bjk->bij", aq, bq)
    assert c.shape == (2, 40, 24) and np.all(np.isfinite(c))
    # f32 sums of exact products, then two tensor-scale multiplies (one rounding each).
    assert np.all(np.abs(c - exact) <= (k + 8) * U32 * mag)
    assert np.all(np.abs(c - emul) <= (2 * k + 16) * U32 * mag)
    # Tight enough to see the FP4 rounding: the unquantized product is outside the bound.
    plain = np.einsum("bik,bjk->bij", np.asarray(a3, np.float64), np.asarray(b3, np.float64))
    if recipe.hadamard is None:
        assert np.mean(np.abs(plain - exact) > (k + 8) * U32 * mag) > 0.5


def test_a_non_finite_operand_gives_nan_everywhere_as_the_emulation():
    a3, b3 = _gemm_operands(64)
    a3 = a3.at[1, 3, 7].set(jnp.inf)
    recipe = GemmRecipe(lhs=RNE, rhs=RNE)
    c = _route(a3, b3, recipe, None)
    emul = _emulation(a3, b3, recipe, None)
    np.testing.assert_array_equal(np.isnan(c), np.isnan(emul))
    assert np.isnan(c).all()


def test_zero_operands_give_zero():
    recipe = GemmRecipe(lhs=RNE, rhs=RNE)
    a3, b3 = jnp.zeros((2, 40, 64)), jnp.zeros((2, 24, 64))
    assert not np.any(_route(a3, b3, recipe, None))


def test_nvfp4_policy_on_the_route_matches_the_emulation_in_all_three_gemms():
    x = jax.random.normal(jax.random.key(1), (16, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (64, 32), jnp.float32)
    key = jax.random.key(3)

    def grads(policy):
        def loss(x, w):
            y = mxjax.dot_general(x, w, (((1,), (0,)), ((), ())), policy=policy, key=key)
            return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

    want = grads(policies.get("nvfp4"))
    got = grads(policies.get("nvfp4").with_backend("xla_nvfp4"))
    # Exact products; summation order and the tensor scales' multiplies differ (K <= 64).
    for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w_ = np.asarray(g, np.float64), np.asarray(w_, np.float64)
        np.testing.assert_allclose(g, w_, rtol=2e-5, atol=2e-5 * np.max(np.abs(w_)))


def test_operand_and_gemm_reject_other_formats():
    with pytest.raises(ValueError, match="expected an NVFP4 operand recipe"):
        xla_nvfp4.nvfp4_operand(jnp.ones((4, 32)), OperandRecipe(fmt=mxjax.MXFP4), None)
    with pytest.raises(ValueError, match="takes NVFP4 x NVFP4"):
        xla_nvfp4.nvfp4_gemm(jnp.ones((1, 4, 32)), jnp.ones((1, 4, 32)),
                             GemmRecipe(lhs=RNE, rhs=OperandRecipe(fmt=mxjax.MXFP4)),
                             None, None)
    policy = policies.get("mxfp4_all").with_backend("xla_nvfp4")
    with pytest.raises(ValueError, match="'xla_nvfp4' implements NVFP4 x NVFP4 only"):
        mxjax.dot_general(jnp.ones((8, 32)), jnp.ones((32, 8)), (((1,), (0,)), ((), ())),
                          policy=policy)


@pytest.mark.parametrize("kind,ok", [("NVIDIA B200", True), ("NVIDIA GB200", True),
                                     ("NVIDIA H200", False), ("AMD Instinct MI355X", False)])
def test_runs_on_blackwell_only(kind, ok):
    from mxjax.chips import Chip, compute_capability_of

    caps = backends.capabilities_for(Chip(platform="gpu", device_kind=kind,
                                          compute_capability=compute_capability_of(kind)))
    assert caps.can_run("xla_nvfp4") is ok
    if not ok:
        assert "Blackwell" in caps.reason("xla_nvfp4")
