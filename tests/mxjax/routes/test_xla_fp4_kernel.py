"""The one-pass MXFP4 operand kernel (Pallas interpreter) against mxjax.quantize and the route.

The kernel's codes and E8M0 bytes must be `mxjax.quantize`'s of the rotated f32 operand
(byte for byte, every block whose scale is finite), both directions of a pair from one
call; its NVFP4 operand (`xla_fp4.kernel_operand`) must be the XLA form's
(`xla_fp4.in_place_operand`): elements, E4M3 scales, shift and exactness; and the
'xla_fp4' route must give the same GEMM results with and without it. Compile budget: one
kernel per (shape, dtype, recipe); the cases share them.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mxjax
from mxjax import OperandRecipe, policies
from mxjax import formats as F
from mxjax.emulation import in_place
from mxjax.routes import xla_fp4
from mxjax.routes import xla_fp4_kernel as K
from tests.mxjax.kernels._kernel_testutil import hadamard, hard_matrix, quantize
from tests.mxjax.routes._operand_kernel_testutil import configs

H16_OP = policies.get("mxfp4_all_h16").fprop.lhs  # MXFP4, EVEN, round to nearest even
# The other arithmetic path (values_from_amax): floor scale rule, rounding toward zero.
FLOOR_RTZ = OperandRecipe(fmt=F.MXFP4, scale_rule=F.ScaleRule.FLOOR,
                          rounding=F.Rounding.TOWARD_ZERO)
SHAPE = (96, 160)  # padded to whole 128 x 128 tiles inside the kernel
CONFIGS = {  # name -> (dtype, op, h, signs seed)
    "bf16_h16_signs": (jnp.bfloat16, H16_OP, 16, 3),
    "f32_h32_floor_rtz": (jnp.float32, FLOOR_RTZ, 32, None),
    "bf16_no_rotation": (jnp.bfloat16, H16_OP, None, None),
}


def _signs(h, seed):
    return None if seed is None else mxjax.fixed_signs(seed, h)


@functools.cache
def _pair_fn(op, h, seed):
    return jax.jit(functools.partial(K.mxfp4_operand_pair, op=op, hadamard_size=h,
                                     signs=_signs(h, seed), interpret=True))


@functools.cache
def _route_operand_fn(op, h, seed, axis, pair):
    def fn(x):
        got = xla_fp4.kernel_operand(x, axis, op, hadamard_size=h, signs=_signs(h, seed),
                                     k_out=x.shape[axis], pair=pair, interpret=True)
        view = in_place.contraction_view(x, (), (axis,))
        want = xla_fp4.in_place_operand(view, op, None, k_out=x.shape[axis],
                                        hadamard_size=h, signs=_signs(h, seed))
        return got, want
    return jax.jit(fn)


def _reference(x, op, h, seed, axis):
    """mxjax.quantize of the f32 operand rotated along `axis`: (codes [F, K/2], E8M0
    bytes [F, K/32]) in the kernel's [F, K] layout."""
    xf = jnp.asarray(x, jnp.float32)
    if h is not None:
        xf = hadamard(xf, h, axis=axis, signs=_signs(h, seed))
    q = quantize(xf, op.fmt, axis=axis, scale_rule=op.scale_rule, rounding=op.rounding)
    codes, scales = np.asarray(q.codes), np.asarray(q.scales)
    return (codes, scales) if axis == 1 else (codes.T, scales.T)


def _assert_kernel_is_reference(got, want):
    codes, scale16, _, _ = (np.asarray(v) for v in got)
    want_codes, want_scales = want
    np.testing.assert_array_equal(scale16[:, ::2], want_scales)
    np.testing.assert_array_equal(scale16[:, 1::2], want_scales)
    # NaN blocks' codes are never read (the route takes the emulation): compare the rest.
    finite = np.repeat(want_scales != 255, 16, axis=1)
    np.testing.assert_array_equal(codes[finite], want_codes[finite])


def _data(dtype, seed=0, specials=True):
    x = hard_matrix(np.random.default_rng(seed), SHAPE, spread=3.0, specials=specials)
    return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize("config", configs(CONFIGS, "bf16_h16_signs"))
def test_pair_is_mxjax_quantize_in_both_directions(config):
    dtype, op, h, seed = CONFIGS[config]
    x = _data(dtype)
    row, col = _pair_fn(op, h, seed)(x)
    chex.assert_shape(row[0], (96, 80))
    chex.assert_shape(row[1], (96, 10))
    chex.assert_shape(col[0], (160, 48))
    chex.assert_shape(col[1], (160, 6))
    _assert_kernel_is_reference(row, _reference(x, op, h, seed, 1))
    _assert_kernel_is_reference(col, _reference(x, op, h, seed, 0))


# Launches other than the interpreter's default (`K.Launch`): the B200's, and tiles split
# both ways into chunks (each direction's slices a chunk at a time).
LAUNCHES = {
    "b200": K.launch_for((10, 0)),
    "64x128_chunks": K.Launch(rows=64, cols=128, row_parts=4, col_parts=2, num_warps=4),
}


@pytest.mark.slow  # ~27 s a case on 2 cores
@pytest.mark.parametrize("launch,config", [
    (launch, config) for launch in sorted(LAUNCHES)
    for config in ("bf16_h16_signs", "f32_h32_floor_rtz")])
def test_every_launch_gives_the_same_bits(launch, config):
    dtype, op, h, seed = CONFIGS[config]
    kw = {"op": op, "hadamard_size": h, "signs": _signs(h, seed), "interpret": True,
          "launch": LAUNCHES[launch]}

    @jax.jit
    def fn(x):
        return (K.mxfp4_operand_pair(x, **kw), K.mxfp4_operand(x, 1, **kw),
                K.mxfp4_operand(x, 0, **kw))

    x = _data(dtype)
    (row, col), one_row, one_col = fn(x)
    _assert_kernel_is_reference(row, _reference(x, op, h, seed, 1))
    _assert_kernel_is_reference(col, _reference(x, op, h, seed, 0))
    chex.assert_trees_all_equal((row, col), (one_row, one_col))
    chex.assert_trees_all_equal((row, col), _pair_fn(op, h, seed)(x))  # statistics too


def test_window_statistics():
    fn = _pair_fn(H16_OP, 16, 3)
    (_, scales, s_max, s_min), _ = fn(_data(jnp.bfloat16, specials=False))
    exps = np.asarray(scales).astype(np.int32) - 127
    assert int(s_max) == exps.max() and int(s_min) == exps.min()
    # A NaN makes s_max the sentinel; an all-zero operand has no live block.
    (_, _, s_max, _), (_, _, col_max, _) = fn(_data(jnp.bfloat16).at[5, 7].set(jnp.nan))
    assert int(s_max) == int(col_max) == K.NONFINITE_SENTINEL
    (_, _, s_max, s_min), _ = fn(jnp.zeros(SHAPE, jnp.bfloat16))
    assert int(s_max) < int(s_min)


def _assert_same_operand(got, want, exact_expected):
    (q, sc, t, exact), (q2, sc2, t2, exact2) = got, want
    assert bool(exact) == bool(exact2) == exact_expected
    if not exact_expected:
        return  # the route takes the emulation: the elements are never read
    assert int(t) == int(t2)
    chex.assert_trees_all_equal(jax.lax.bitcast_convert_type(q, jnp.uint4),
                                jax.lax.bitcast_convert_type(q2, jnp.uint4))
    chex.assert_trees_all_equal(jax.lax.bitcast_convert_type(sc, jnp.uint8),
                                jax.lax.bitcast_convert_type(sc2, jnp.uint8))


def _spread(x, binades):
    """x with every other 32-row band scaled by 2^-binades (the span the window sees)."""
    rows = (np.arange(x.shape[0]) // 32) % 2 == 1
    return jnp.where(rows[:, None], x * jnp.float32(2.0 ** -binades), x).astype(x.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("axis", [1, 0])
def test_route_operand_is_the_xla_forms(axis):
    fn = _route_operand_fn(H16_OP, 16, 3, axis, True)
    x = _data(jnp.bfloat16, specials=False)
    _assert_same_operand(*fn(x), exact_expected=True)
    _assert_same_operand(*fn(x.at[3, 9].set(jnp.inf)), exact_expected=False)
    # Blocks 40 binades apart: outside E4M3's 18-binade window in both directions.
    _assert_same_operand(*fn(_spread(x, 40)), exact_expected=False)
    _assert_same_operand(*fn(jnp.zeros(SHAPE, jnp.bfloat16)), exact_expected=True)


def test_single_direction_with_a_padded_contraction_is_the_xla_forms():
    # K = 100, zero-padded to 128 (a multiple of 32) by the caller; the free size 40 is
    # not a multiple of 32 (no pair).
    x = _data(jnp.float32, specials=False)[:40, :100]

    def fn(x):
        got = xla_fp4.kernel_operand(x, 1, H16_OP, hadamard_size=16, signs=None, k_out=128,
                                     interpret=True)
        view = in_place.contraction_view(x, (), (1,))
        want = xla_fp4.in_place_operand(view, H16_OP, None, k_out=128, hadamard_size=16,
                                        signs=None)
        return got, want

    got, want = jax.jit(fn)(x)
    chex.assert_shape(got[0], (1, 40, 128))
    _assert_same_operand(got, want, exact_expected=True)


@pytest.mark.slow
def test_route_results_with_and_without_the_kernel_are_identical():
    recipe = policies.get("mxfp4_all_h16").fprop
    a = _data(jnp.bfloat16, seed=1, specials=False).reshape(2, 48, 160)
    b = jnp.asarray(hard_matrix(np.random.default_rng(2), (128, 160), spread=3.0,
                                specials=False)).astype(jnp.bfloat16)  # [out, in]
    dims = (((2,), (1,)), ((), ()))

    def route(a, b, kernel):
        return xla_fp4.mx_gemm_fp4(a, b, dims, recipe, None, None, None,
                                   out_dtype=jnp.bfloat16, kernel=kernel, interpret=True)

    with_kernel = jax.jit(functools.partial(route, kernel=True))
    without = jax.jit(functools.partial(route, kernel=False))
    chex.assert_trees_all_equal(with_kernel(a, b), without(a, b))
    far = _spread(b.T, 40).T  # out of the window: both take the emulation
    chex.assert_trees_all_equal(with_kernel(a, far), without(a, far))


def test_takes_kernel_and_bad_arguments():
    sr = OperandRecipe(fmt=F.MXFP4, rounding=F.Rounding.STOCHASTIC)
    assert K.takes_kernel(H16_OP, 16, jnp.bfloat16)
    assert not K.takes_kernel(sr, 16, jnp.bfloat16)
    assert not K.takes_kernel(H16_OP, 64, jnp.bfloat16)
    assert not K.takes_kernel(H16_OP, 16, jnp.float16)
    assert not K.takes_kernel(OperandRecipe(fmt=F.MXFP8_E4M3), None, jnp.float32)
    x = jnp.zeros((64, 64), jnp.float32)
    with pytest.raises(ValueError, match="axis"):
        K.mxfp4_operand(x, 2, H16_OP, hadamard_size=16, signs=None)
    with pytest.raises(ValueError, match="x2: expected a 2-D"):
        K.mxfp4_operand(x[None], 1, H16_OP, hadamard_size=16, signs=None)
    with pytest.raises(ValueError, match="deterministic rounding"):
        K.mxfp4_operand(x, 1, sr, hadamard_size=16, signs=None)
    with pytest.raises(ValueError, match="contraction length 48"):
        K.mxfp4_operand(x[:, :48], 1, H16_OP, hadamard_size=16, signs=None)
    with pytest.raises(ValueError, match="contraction length 40"):
        K.mxfp4_operand_pair(x[:40], H16_OP, hadamard_size=16, signs=None)
    with pytest.raises(ValueError, match="e2m1_cvt: PTX's cvt has no interpreter form"):
        K.mxfp4_operand_pair(x, H16_OP, hadamard_size=16, signs=None, e2m1_cvt=True,
                             interpret=True)


@pytest.mark.parametrize("cc,has", [((9, 0), False), ((8, 0), False), (None, False),
                                    ((10, 0), True), ((10, 3), True), ((12, 0), True)])
def test_has_e2m1_cvt_is_blackwell(cc, has):
    assert K.has_e2m1_cvt(cc) is has


def _f32_sweep():
    """f32 bit patterns: every exponent from zero/subnormal up to 2^13, the top 10
    significand bits exhaustively, and low bits on and around the E2M1 grid's ties (bit
    21 is the half-step in [1, 2), bit 22 in [2, 4), ...); both signs; 2^24 and up,
    f32's largest finite and Inf."""
    exponents = np.arange(0, 141, dtype=np.uint32) << 23
    tops = np.arange(1 << 10, dtype=np.uint32) << 13
    lows = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF], np.uint32)
    bits = (exponents[:, None, None] | tops[None, :, None] | lows[None, None, :]).ravel()
    bits = np.concatenate([bits, np.array([0x4B800000, 0x4C000000, 0x7F7FFFFF, 0x7F800000],
                                          np.uint32)])
    return np.concatenate([bits, bits | 0x80000000]).view(np.float32)


def test_nearest_even_code_is_e2m1_round_to_nearest_even():
    """`nearest_even_code` against ml_dtypes' float4_e2m1fn cast (round to nearest even)
    for |y| <= 6, and against the in-place forms' rounding then `_e2m1_code` everywhere
    (saturating at 6, -0 and negative values that round to zero keeping the sign)."""
    y = _f32_sweep()
    got = np.asarray(jax.jit(K.nearest_even_code)(jnp.asarray(y)))
    in_range = np.abs(y) <= 6
    want = y[in_range].astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(got[in_range], want)
    saturated = np.where(y[~in_range] < 0, 15, 7)
    np.testing.assert_array_equal(got[~in_range], saturated)
    from mxjax.elements import nearest_even_value

    via_values = jax.jit(lambda v: K._e2m1_code(nearest_even_value(v, F.MXFP4.element)))
    np.testing.assert_array_equal(got, np.asarray(via_values(jnp.asarray(y))))


@pytest.mark.slow  # the interpreter's longest case (~30 s on 2 cores)
def test_an_f32_operand_cast_to_bf16_is_rounded_in_the_kernel():
    """operand_dtypes=(bf16, bf16) on f32 operands: the kernel reads the f32 arrays and
    rounds them itself (bf16_values), the same GEMM as on the cast operands."""
    recipe = policies.get("mxfp4_all_h16").fprop
    a = jnp.asarray(hard_matrix(np.random.default_rng(3), (96, 160), spread=3.0,
                                specials=False))
    b = jnp.asarray(hard_matrix(np.random.default_rng(4), (160, 128), spread=3.0,
                                specials=False))
    dims = (((1,), (0,)), ((), ()))
    bf16 = (jnp.bfloat16, jnp.bfloat16)

    def route(a, b, operand_dtypes, kernel):
        return xla_fp4.mx_gemm_fp4(a, b, dims, recipe, None, None, None,
                                   operand_dtypes=operand_dtypes, out_dtype=jnp.bfloat16,
                                   kernel=kernel, interpret=True)

    in_kernel = jax.jit(functools.partial(route, operand_dtypes=bf16, kernel=True))(a, b)
    cast_first = jax.jit(functools.partial(route, operand_dtypes=None, kernel=False))(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
    chex.assert_trees_all_equal(in_kernel, cast_first)
