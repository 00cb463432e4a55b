"""The one-pass MXFP8 operand kernel (Pallas interpreter) against mxjax.quantize.

The kernel's f8 codes and E8M0 bytes must be `mxjax.quantize`'s of the rotated operand,
byte for byte, in both directions of a pair and along one axis with a contraction that is
not a multiple of the block: E4M3 and E5M2, RCEIL/FLOOR/EVEN scales, the Hadamard,
NaN/Inf blocks, saturation, subnormal scales and elements, all-zero blocks. Compile
budget: one kernel per (shape, dtype, recipe); the cases share them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxjax import OperandRecipe, policies
from mxjax import formats as F
from mxjax.routes import xla_mxfp8_kernel as K
from tests.mxjax.kernels._kernel_testutil import hard_matrix
from tests.mxjax.routes._operand_kernel_testutil import (
    assert_refuses_bad_arguments,
    check_pair,
    configs,
    reference,
)

RCEIL_E4M3 = policies.get("mxfp8").fprop.lhs  # E4M3, RCEIL, nearest even
FLOOR_E5M2_RTZ = OperandRecipe(fmt=F.MXFP8_E5M2, scale_rule=F.ScaleRule.FLOOR,
                               rounding=F.Rounding.TOWARD_ZERO)
EVEN_E4M3_H32 = OperandRecipe(fmt=F.MXFP8_E4M3, scale_rule=F.ScaleRule.EVEN)
SHAPE = (96, 160)  # padded to whole 128 x 128 tiles inside the kernel
CONFIGS = {  # name -> (dtype, op, h, signs seed)
    "bf16_e4m3_rceil": (jnp.bfloat16, RCEIL_E4M3, None, None),
    "f32_e5m2_floor_rtz_h16": (jnp.float32, FLOOR_E5M2_RTZ, 16, 3),
    "bf16_e4m3_even_h32": (jnp.bfloat16, EVEN_E4M3_H32, 32, None),
}


def _assert_kernel_is_reference(got, want):
    codes, scales = (np.asarray(v) for v in got)
    want_codes, want_scales, _ = want
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(codes, want_codes)


def _edges(dtype, seed=0):
    """hard_matrix's specials (NaN, ±Inf, f32 subnormals, -0, 3e38, an all-zero row) plus
    a band of blocks 125 binades down (E8M0's clamped subnormal scales, subnormal
    elements) and one near f32's top (saturation under RCEIL/EVEN's capped exponent)."""
    x = hard_matrix(np.random.default_rng(seed), SHAPE, spread=3.0, specials=True)
    x[40:48, :] *= np.float32(2.0 ** -125)
    x[60, 33:64] = np.float32(3.3e38)
    return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize("config", configs(CONFIGS, "f32_e5m2_floor_rtz_h16"))
def test_pair_is_mxjax_quantize_in_both_directions(config):
    dtype, op, h, seed = CONFIGS[config]
    row, col = check_pair(K.mxfp8_operand_pair, _edges(dtype), op, h, seed,
                          _assert_kernel_is_reference)
    assert row[0].shape == (96, 160) and row[1].shape == (96, 5)
    assert col[0].shape == (160, 96) and col[1].shape == (160, 3)
    assert (np.asarray(row[1]) == 255).any() and (np.asarray(row[1]) < 20).any()


def test_one_direction_with_a_contraction_not_a_multiple_of_the_block():
    # K = 100 along axis 1 (padded to 128: zero codes, scale byte 127).
    x = _edges(jnp.float32)[:40, :100]
    got = jax.jit(functools.partial(K.mxfp8_operand, axis=1, op=RCEIL_E4M3,
                                    hadamard_size=None, signs=None, interpret=True))(x)
    assert got[0].shape == (40, 128)
    _assert_kernel_is_reference(got, reference(x, RCEIL_E4M3, None, None, 1))


def test_takes_kernel_and_bad_arguments():
    sr = OperandRecipe(fmt=F.MXFP8_E4M3, rounding=F.Rounding.STOCHASTIC)
    assert K.takes_kernel(RCEIL_E4M3, None, jnp.bfloat16)
    assert K.takes_kernel(FLOOR_E5M2_RTZ, 32, jnp.float32)
    assert not K.takes_kernel(sr, None, jnp.bfloat16)
    assert not K.takes_kernel(RCEIL_E4M3, 64, jnp.bfloat16)
    assert not K.takes_kernel(RCEIL_E4M3, None, jnp.float16)
    assert not K.takes_kernel(OperandRecipe(fmt=F.MXFP4), None, jnp.float32)
    assert_refuses_bad_arguments(K.mxfp8_operand, K.mxfp8_operand_pair, RCEIL_E4M3, sr)


@pytest.mark.slow
def test_route_with_the_kernel_is_the_in_place_form():
    """The mxfp8 preset's fprop (X [M, K] · W [K, N]; W by the pair, X with K = 100 along
    one axis) and an f32 operand cast to bf16 in the kernel, with and without it."""
    from mxjax.routes import xla_mxfp8

    recipe = policies.get("mxfp8").fprop
    rng = np.random.default_rng(5)
    a = jnp.asarray(hard_matrix(rng, (48, 96), spread=3.0, specials=False))
    b = jnp.asarray(hard_matrix(rng, (96, 64), spread=3.0, specials=False))
    dims = (((1,), (0,)), ((), ()))
    bf16 = (jnp.bfloat16, jnp.bfloat16)

    def route(a, b, kernel):
        return xla_mxfp8.mxfp8_gemm(a, b, dims, recipe, None, None, None,
                                    operand_dtypes=bf16, out_dtype=jnp.float32,
                                    kernel=kernel, interpret=True)

    got = jax.jit(functools.partial(route, kernel=True))(a, b)
    want = jax.jit(functools.partial(route, kernel=False))(a, b)
    assert np.isfinite(np.asarray(want)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _ptx_cvt_model(y: np.ndarray, dtype) -> np.ndarray:
    """PTX's ``cvt.rn.satfinite.<f8>x2.f32`` as its ISA manual defines it, for finite f32
    y: IEEE round to nearest even onto the f8 format, a magnitude past its largest finite
    value saturated to it (ml_dtypes rounds to nearest even; it turns overflow into
    NaN, so the saturation comes first: a value between the largest finite and the next
    binade's midpoint rounds down to the largest finite either way)."""
    import ml_dtypes

    top = float(ml_dtypes.finfo(dtype).max)
    return np.clip(y, -top, top).astype(dtype).view(np.uint8)


@pytest.mark.parametrize("fmt", [F.MXFP8_E4M3, F.MXFP8_E5M2], ids=lambda f: f.name)
def test_ptx_f8_conversion_gives_the_quantizers_nearest_even_codes(fmt):
    """The compiled kernel's ``f8_cvt`` path rounds by PTX's cvt where the interpreter
    rounds by `round_to_grid`: on every f32 exponent from far below the f8 format's
    smallest subnormal to past its largest value, the mantissas of ties, their neighbours
    and random ones, both signs and zeros, the two give the same code byte."""
    import ml_dtypes

    from mxjax.elements import round_to_grid

    dtype = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[
        fmt.element.name]
    rng = np.random.default_rng(0)
    mantissas = np.concatenate([
        np.arange(0, 1 << 23, 1 << 17),  # on and between the f8 grid points (3 or 2 bits)
        (np.arange(0, 1 << 23, 1 << 19) + (1 << 18))[:, None] + np.array([-1, 0, 1]),
        rng.integers(0, 1 << 23, 256)], axis=None).astype(np.uint32)
    exponents = np.arange(127 - 40, 127 + 20, dtype=np.uint32)  # 2^-40 .. 2^19
    bits = (exponents[:, None] << 23 | mantissas[None, :]).reshape(-1)
    y = np.concatenate([bits.view(np.float32), [0.0, 2.0 ** -140]]).astype(np.float32)
    y = np.concatenate([y, -y])
    sign, mag = jax.jit(round_to_grid, static_argnums=(1, 2))(
        jnp.asarray(y), fmt.element, F.Rounding.NEAREST_EVEN)
    mine = (np.asarray(mag) | (np.asarray(sign).astype(np.int32) << 7)).astype(np.uint8)
    np.testing.assert_array_equal(mine, _ptx_cvt_model(y, dtype))


@pytest.mark.parametrize("cc,has", [((8, 0), False), ((8, 6), False), ((8, 9), True),
                                    ((9, 0), True), ((10, 0), True), (None, False)])
def test_has_f8_cvt_from_ada_on(cc, has):
    assert K.has_f8_cvt(cc) is has


def test_f8_cvt_has_no_interpreter_form():
    x = jnp.zeros((64, 64), jnp.float32)
    with pytest.raises(ValueError, match="f8_cvt: PTX's cvt has no interpreter form"):
        K.mxfp8_operand(x, 1, RCEIL_E4M3, hadamard_size=None, signs=None, f8_cvt=True,
                        interpret=True)
