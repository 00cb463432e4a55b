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
from mxjax.routes import xla_fp4_kernel as fp4k
from mxjax.routes import xla_nvfp4_kernel as K
from tests import reference as ref
from tests.mxjax.kernels._kernel_testutil import hadamard, hard_matrix
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


def _emulation_tensor_scale(x, axis, h, seed):
    from mxjax import hadamard as mx_hadamard
    from mxjax.quantization import quantize_with

    xf = jnp.asarray(x, jnp.float32)
    pad = [(0, 0), (0, 0)]
    pad[axis] = (0, (-x.shape[axis]) % h)
    xf = mx_hadamard(jnp.pad(xf, pad), h, axis=axis, signs=signs(h, seed))
    return np.asarray(quantize_with(xf, RNE, axis).tensor_scale)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("axis,shape", [(0, (200, 24)), (1, (24, 200)), (0, (40, 8)),
                                        (1, (8, 48))])
def test_tensor_scale_of_a_rotated_operand_is_the_emulations(axis, shape, jit):
    # The rotated amax from strided slices (one fused read) against the emulation's
    # mxjax.hadamard then quantize_with, bit for bit: contractions of 200, 40 and 48 (not
    # multiples of 32: the slices pad to 32, the emulation to 16), each sign, an outlier
    # that a rotation spreads, NaN/Inf, an all-zero operand and the tensor-scale floor.
    rng = np.random.default_rng(sum(shape) + axis)
    base = hard_matrix(rng, shape, spread=3.0, specials=False).astype(np.float32)
    base[3, 5] = 7.0e3
    cases = [base, -base, np.zeros(shape, np.float32), base * np.float32(2.0 ** -126)]
    for special in (np.nan, np.inf, -np.inf):
        x = base.copy()
        x[-1, -1] = special
        cases.append(x)
    fn = functools.partial(K.tensor_scale, axis=axis, hadamard_size=16, signs=signs(16, 1))
    fn = jax.jit(fn) if jit else fn
    for x in cases:
        for dtype in (jnp.float32, jnp.bfloat16):
            xd = jnp.asarray(x).astype(dtype)
            got = np.asarray(fn(xd))
            want = _emulation_tensor_scale(xd, axis, 16, 1)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # Exact data (small integers: every butterfly sum exact) against numpy's float64
    # Hadamard and the reference's tensor scale, independently of mxjax's rotation.
    ints = rng.integers(-64, 65, size=shape).astype(np.float32)
    want = ref._tensor_scale(ref.hadamard(np.pad(ints, [(0, (-n) % 16 if a == axis else 0)
                                                        for a, n in enumerate(shape)]),
                                          16, axis=axis, signs=np.asarray(signs(16, 1)))
                             .astype(np.float32), np.float32(6 * 448),
                             ref.TENSOR_SCALE_FLOOR["nvfp4"])
    got = np.asarray(fn(jnp.asarray(ints)))
    np.testing.assert_array_equal(got.view(np.uint32), np.float32(want).view(np.uint32))


@pytest.mark.slow
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
    key = jax.random.key(0)
    assert K.takes_kernel(RNE, 16, jnp.bfloat16) and K.takes_kernel(RTZ, None, jnp.float32)
    assert K.takes_kernel(sr, 16, jnp.bfloat16, key)
    assert K.takes_kernel(sr, None, jnp.float32, jax.random.PRNGKey(0))
    # Stochastic rounding needs a key whose draws the kernel reproduces.
    assert not K.takes_kernel(sr, 16, jnp.bfloat16)
    assert not K.takes_kernel(sr, 16, jnp.bfloat16, jax.random.key(0, impl="rbg"))
    assert not K.takes_kernel(RNE, 32, jnp.bfloat16)
    assert not K.takes_kernel(RNE, None, jnp.float16)
    assert not K.takes_kernel(OperandRecipe(fmt=F.MXFP4), None, jnp.float32)
    assert_refuses_bad_arguments(K.nvfp4_operand, K.nvfp4_operand_pair, RNE, sr,
                                 sr_match="key: stochastic rounding needs a key")
    x = jnp.zeros((64, 64), jnp.float32)
    with pytest.raises(ValueError, match="compiled: PTX's div.rn has no interpreter form"):
        K.nvfp4_operand(x, 1, RNE, hadamard_size=None, signs=None, compiled=True,
                        interpret=True)
    with pytest.raises(ValueError, match="key: only stochastic rounding takes a key"):
        K.nvfp4_operand(x, 1, RNE, hadamard_size=None, signs=None, key=key)
    with pytest.raises(ValueError, match="key: expected a threefry2x32 key.*'rbg'"):
        K.nvfp4_operand(x, 1, sr, hadamard_size=None, signs=None,
                        key=jax.random.key(0, impl="rbg"))
    with pytest.raises(ValueError, match="op: a pair takes deterministic rounding"):
        K.nvfp4_operand_pair(x, sr, hadamard_size=None, signs=None)


SR = policies.get("nvfp4").dgrad.lhs  # NVFP4, stochastic rounding
SR_PRESCALED = OperandRecipe(fmt=F.NVFP4, rounding=F.Rounding.STOCHASTIC, sr_prescale=True)
# Hopper's and Blackwell's pair launch: 128 x 64 tiles, rows in two chunks (other draw
# positions); their launch of one direction: 64 x 64 tiles, bf16 read element by element
# along columns (one slice set).
TUNED = fp4k.Launch(rows=128, cols=64, row_parts=2, num_warps=4)
ONE_DIRECTION = fp4k.launch_for((10, 0), directions=(0,))
SR_CASES = {  # name -> (dtype, axis, op, h, signs seed, launch, shape)
    # wgrad's dY as a B200 reads it: bf16 along columns, H16, 4 x 3 tiles, K = 200
    "wgrad_dy_bf16_axis0_h16_b200": (jnp.bfloat16, 0, SR, 16, 0, ONE_DIRECTION, (200, 160)),
    # bf16 pairs along columns (two slice sets), 2 x 3 tiles
    "bf16_axis0_h16_pairs": (jnp.bfloat16, 0, SR, 16, 0, TUNED, (200, 160)),
    # dgrad's dY: along rows, K = 100 (padded to 112 by the quantizer, 128 by the kernel)
    "dgrad_dy_f32_axis1": (jnp.float32, 1, SR, None, None, fp4k.DEFAULT_LAUNCH, (160, 100)),
    "bf16_axis1_tuned_prescaled": (jnp.bfloat16, 1, SR_PRESCALED, None, None, TUNED,
                                   (160, 200)),
    "f32_axis0_default": (jnp.float32, 0, SR, None, None, fp4k.DEFAULT_LAUNCH, (200, 160)),
    # the default run's: H16 along rows, K = 40 (padded to 48 for the rotation); the
    # interpreter's launch (~20 s; the B200's tiles and row chunks ~50 s: the slow cases)
    "small_bf16_axis1_h16": (jnp.bfloat16, 1, SR, 16, 0, fp4k.DEFAULT_LAUNCH, (64, 40)),
}


def _sr_reference(x, op, h, seed, axis, key):
    """mxjax.quantize_with of the rotated operand with the key: the emulation's draws."""
    from mxjax.quantization import quantize_with

    xf = jnp.asarray(x, jnp.float32)
    if h is not None:
        pad = [(0, 0), (0, 0)]
        pad[axis] = (0, (-x.shape[axis]) % h)
        xf = hadamard(jnp.pad(xf, pad), h, axis=axis, signs=signs(h, seed))
    q = quantize_with(xf, op, axis, key=key)
    codes, scales = np.asarray(q.codes), np.asarray(q.scales)
    if axis == 0:
        codes, scales = codes.T, scales.T
    return codes, scales, np.asarray(q.tensor_scale)


@functools.cache
def _sr_fn(op, axis, h, seed, launch):
    return jax.jit(functools.partial(K.nvfp4_operand, axis=axis, op=op, hadamard_size=h,
                                     signs=signs(h, seed), interpret=True, launch=launch))


# One small case in the default run; the others (~40 s a case on 2 cores) in make test-slow.
@pytest.mark.parametrize("case", [
    c if c == "small_bf16_axis1_h16" else pytest.param(c, marks=pytest.mark.slow)
    for c in sorted(SR_CASES)])
def test_stochastic_rounding_draws_the_emulations_uniforms(case):
    """SR inside the kernel: the codes of `quantize_with(..., key=key)` (jax.random.uniform
    of the canonical [F, K16] operand), byte for byte, for two keys; the draws matter (the
    codes differ from nearest-even's and between the keys)."""
    dtype, axis, op, h, seed, launch, shape = SR_CASES[case]
    x = jnp.asarray(_edges(hard_matrix(np.random.default_rng(3), shape, spread=3.0,
                                       specials=False))).astype(dtype)
    fn = _sr_fn(op, axis, h, seed, launch)
    codes = []
    for key in (jax.random.key(11), jax.random.PRNGKey(12)):
        got = fn(x, key=key)
        _assert_kernel_is_reference(got, _sr_reference(x, op, h, seed, axis, key))
        codes.append(np.asarray(got[0]))
    nearest = _sr_reference(x, RNE, h, seed, axis, None)[0]
    assert (codes[0][:, :nearest.shape[1]] != nearest).mean() > 0.05
    assert (codes[0] != codes[1]).mean() > 0.05


@pytest.mark.slow
def test_stochastic_rounding_of_a_non_finite_tensor():
    dtype, axis, op, h, seed, launch, shape = SR_CASES["wgrad_dy_bf16_axis0_h16_b200"]
    x = jnp.asarray(hard_matrix(np.random.default_rng(3), shape, spread=3.0,
                                specials=False)).at[5, 7].set(jnp.inf).astype(dtype)
    key = jax.random.key(11)
    got = _sr_fn(op, axis, h, seed, launch)(x, key=key)
    _assert_kernel_is_reference(got, _sr_reference(x, op, h, seed, axis, key))
    assert np.isnan(np.asarray(got[2])) and (np.asarray(got[1]) == 0x7F).all()


# ~50 s (wgrad) and ~30 s (fprop) on 2 cores: the slow run; the default run checks the kernel
# against the emulation operand by operand (the pair and SR tests above)
@pytest.mark.slow
@pytest.mark.parametrize("gemm", ["fprop", "wgrad"])
def test_route_with_the_kernel_is_the_xla_form(gemm):
    """The nvfp4 preset's fprop (X [M, K] · W [K, N]: W by the pair, X along one axis)
    and wgrad (dY and X contracted over M, H16 with fixed signs: dY's stochastic rounding
    drawn in the kernel from the GEMM's key, X by the kernel), with and without the
    kernel."""
    from mxjax.routes import xla_nvfp4
    from mxjax.routes.spec import in_place_route_gemm

    recipe = getattr(policies.get("nvfp4"), gemm)
    rng = np.random.default_rng(5)
    # wgrad: 160 tokens, two tiles along dY's contraction (the second tile's draws start
    # at row 128 of the canonical operand's K)
    m = 64 if gemm == "fprop" else 160
    a = jnp.asarray(hard_matrix(rng, (m, 96), spread=3.0, specials=False), jnp.bfloat16)
    b = jnp.asarray(hard_matrix(rng, (96, 128) if gemm == "fprop" else (m, 128), spread=3.0,
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
    # The XLA form draws dY's uniforms with jax.random; the kernel draws its own.
    assert ("random_bits" in str(jax.make_jaxpr(xla_form)(a, b))) == (gemm == "wgrad")
    assert "random_bits" not in str(jax.make_jaxpr(with_kernel)(a, b))
