"""The one-pass NVFP4 operand kernel (Pallas interpreter) against mxjax.quantize.

The kernel's codes, E4M3 scale bytes and tensor scale must be `mxjax.quantize`'s of the
rotated operand, byte for byte, in both directions of a pair and along one axis with a
contraction that is not a multiple of the block; NaN/Inf, saturation, E4M3-subnormal block
scales, all-zero blocks and the tensor-scale floor included. Compile budget: one kernel
per (shape, dtype, recipe); the cases share them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxjax import OperandRecipe, policies
from mxjax import formats as F
from mxjax.routes import xla_nvfp4_kernel as K
from tests.mxjax.kernels._kernel_testutil import hard_matrix
from tests.mxjax.routes._operand_kernel_testutil import (
    assert_refuses_bad_arguments,
    check_pair,
    configs,
    pair_fn,
    reference,
    signs,
)

RNE = policies.get("nvfp4").fprop.lhs  # NVFP4, nearest even
RTZ = OperandRecipe(fmt=F.NVFP4, rounding=F.Rounding.TOWARD_ZERO)
SHAPE = (96, 160)  # padded to whole 128 x 128 tiles inside the kernel
CONFIGS = {  # name -> (dtype, op, h, signs seed)
    "bf16_h16_signs": (jnp.bfloat16, RNE, 16, 0),
    "f32_no_rotation_rtz": (jnp.float32, RTZ, None, None),
}


def _pair_fn(op, h, seed):
    return pair_fn(K.nvfp4_operand_pair, op, h, seed)


def _assert_kernel_is_reference(got, want):
    codes, scales, t = (np.asarray(v) for v in got)
    want_codes, want_scales, want_t = want
    np.testing.assert_array_equal(t.view(np.uint32), want_t.view(np.uint32))
    k16 = want_scales.shape[1]  # the quantizer pads to 16, the kernel to 32 (zeros)
    np.testing.assert_array_equal(scales[:, :k16], want_scales)
    np.testing.assert_array_equal(codes[:, :k16 * 8], want_codes)
    if np.isfinite(want_t):
        assert not codes[:, k16 * 8:].any() and not scales[:, k16:].any()


def _data(dtype, seed=0):
    x = hard_matrix(np.random.default_rng(seed), SHAPE, spread=3.0, specials=False)
    return jnp.asarray(x).astype(dtype)


def _edges(x):
    """Range edges in one operand: a saturating outlier (its block's scale is E4M3's top),
    blocks 11 and 20 binades below the rest (E4M3-subnormal and zero block scales), an all-zero
    band of rows and columns, and f32/bf16 subnormals."""
    x = np.array(x, np.float32)
    x[10, 20] = 3.0e4
    x[32:40, :] *= 2.0 ** -11
    x[40:48, :] *= 2.0 ** -20
    x[64:80, :] = 0.0
    x[:, 96:112] = 0.0
    x[50, 3] = 2.0 ** -133
    return x


@pytest.mark.parametrize("config", configs(CONFIGS, "bf16_h16_signs"))
def test_pair_is_mxjax_quantize_in_both_directions(config):
    dtype, op, h, seed = CONFIGS[config]
    x = jnp.asarray(_edges(_data(dtype))).astype(dtype)
    row, _ = check_pair(K.nvfp4_operand_pair, x, op, h, seed, _assert_kernel_is_reference)
    assert (np.asarray(row[1]) == 0).any()  # zero block scales were exercised
    assert ((np.asarray(row[1]) > 0) & (np.asarray(row[1]) < 8)).any()  # subnormal


@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf])
def test_a_non_finite_tensor_is_nan_scaled_as_the_quantizer_writes_it(special):
    dtype, op, h, seed = CONFIGS["bf16_h16_signs"]
    x = _data(dtype).at[5, 7].set(special)
    row, col = _pair_fn(op, h, seed)(x)
    for got, axis in ((row, 1), (col, 0)):
        _assert_kernel_is_reference(got, reference(x, op, h, seed, axis))
        assert np.isnan(np.asarray(got[2])) and (np.asarray(got[1]) == 0x7F).all()


def test_tensor_scale_floor_and_zero_tensor():
    dtype, op, h, seed = CONFIGS["bf16_h16_signs"]
    tiny = (_data(jnp.float32) * 2.0 ** -120).astype(dtype)  # amax / 2688 below 2^-116
    for x in (tiny, jnp.zeros(SHAPE, dtype)):
        check_pair(K.nvfp4_operand_pair, x, op, h, seed, _assert_kernel_is_reference)
    assert float(_pair_fn(op, h, seed)(tiny)[0][2]) == 2.0 ** -116


def test_one_direction_with_a_contraction_not_a_multiple_of_the_block():
    # K = 100 along axis 1 (the quantizer pads to 112, the kernel to 128); K = 40 along
    # axis 0 with H16 (padded to 48 for the rotation).
    x = _data(jnp.float32)[:40, :100]
    got = jax.jit(functools.partial(K.nvfp4_operand, axis=1, op=RNE, hadamard_size=None,
                                    signs=None, interpret=True))(x)
    assert got[0].shape == (40, 64)
    _assert_kernel_is_reference(got, reference(x, RNE, None, None, 1))
    got = jax.jit(functools.partial(K.nvfp4_operand, axis=0, op=RNE, hadamard_size=16,
                                    signs=signs(16, 0), interpret=True))(x)
    xp = jnp.pad(x, ((0, 8), (0, 0)))
    _assert_kernel_is_reference(got, reference(xp, RNE, 16, 0, 0))


def test_takes_kernel_and_bad_arguments():
    sr = policies.get("nvfp4").dgrad.lhs
    assert K.takes_kernel(RNE, 16, jnp.bfloat16) and K.takes_kernel(RTZ, None, jnp.float32)
    assert not K.takes_kernel(sr, 16, jnp.bfloat16)
    assert not K.takes_kernel(RNE, 32, jnp.bfloat16)
    assert not K.takes_kernel(RNE, None, jnp.float16)
    assert not K.takes_kernel(OperandRecipe(fmt=F.MXFP4), None, jnp.float32)
    assert_refuses_bad_arguments(K.nvfp4_operand, K.nvfp4_operand_pair, RNE, sr)
    x = jnp.zeros((64, 64), jnp.float32)
    with pytest.raises(ValueError, match="compiled: PTX's div.rn has no interpreter form"):
        K.nvfp4_operand(x, 1, RNE, hadamard_size=None, signs=None, compiled=True,
                        interpret=True)


# wgrad (SR dY from a key, H16 X) in the default run; fprop (~30 s on 2 cores) in the slow one
@pytest.mark.parametrize("gemm", [pytest.param("fprop", marks=pytest.mark.slow), "wgrad"])
def test_route_with_the_kernel_is_the_xla_form(gemm):
    """The nvfp4 preset's fprop (X [M, K] · W [K, N]: W by the pair, X along one axis)
    and wgrad (dY and X contracted over M, H16 with fixed signs: dY's stochastic rounding
    by the XLA form from the same key, X by the kernel), with and without the kernel."""
    from mxjax.routes import xla_nvfp4
    from mxjax.routes.spec import in_place_route_gemm

    recipe = getattr(policies.get("nvfp4"), gemm)
    rng = np.random.default_rng(5)
    a = jnp.asarray(hard_matrix(rng, (64, 96), spread=3.0, specials=False), jnp.bfloat16)
    b = jnp.asarray(hard_matrix(rng, (96, 128) if gemm == "fprop" else (64, 128), spread=3.0,
                                specials=False), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ())) if gemm == "fprop" else (((0,), (0,)), ((), ()))
    key = jax.random.key(7)
    kw = {"dims": dims, "recipe": recipe, "key": key, "out_dtype": jnp.float32}
    with_kernel = jax.jit(lambda a, b: in_place_route_gemm(
        functools.partial(xla_nvfp4.nvfp4_kernel_gemm, pair_rhs=gemm == "fprop",
                          interpret=True), a, b, **kw))
    xla_form = jax.jit(lambda a, b: xla_nvfp4.ROUTE.gemm(a, b, gemm_name=gemm, **kw))
    got, want = with_kernel(a, b), xla_form(a, b)
    assert np.isfinite(np.asarray(want)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
