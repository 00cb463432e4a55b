"""The fused Pallas quantize kernel (interpret mode) is bit-identical to mxjax.quantize.

Each case asks for both the row-wise and the column-wise copy in one kernel
call, on a tile grid with padding in both directions, and compares codes and
scales byte for byte with mxjax.quantize (and mxjax.hadamard first when the
spec has a Hadamard). Compile budget: one kernel per case; ~30 s in all.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import OperandRecipe
from mxjax import formats as F
from mxjax.kernels import QuantSpec, fused_quantize
from mxjax.kernels.pallas_quantize import _hadamard_tile, _pack_tile
from tests.mxjax.kernels._kernel_testutil import assert_same_mx, hadamard, hard_matrix, quantize

DETERMINISTIC = (F.Rounding.NEAREST_EVEN, F.Rounding.TOWARD_ZERO, F.Rounding.NEAREST_AWAY)
R, S = F.ScaleRule, F.Rounding
# Six calls cover all 4 x 3 (scale rule, deterministic rounding) pairs: row copy, col copy.
RULE_ROUNDING_PAIRS = [
    ((R.FLOOR, S.NEAREST_EVEN), (R.EVEN, S.TOWARD_ZERO)),
    ((R.FLOOR, S.TOWARD_ZERO), (R.CEIL, S.NEAREST_AWAY)),
    ((R.FLOOR, S.NEAREST_AWAY), (R.RCEIL, S.NEAREST_EVEN)),
    ((R.EVEN, S.NEAREST_EVEN), (R.CEIL, S.TOWARD_ZERO)),
    ((R.EVEN, S.NEAREST_AWAY), (R.RCEIL, S.TOWARD_ZERO)),
    ((R.CEIL, S.NEAREST_EVEN), (R.RCEIL, S.NEAREST_AWAY)),
]


def _reference(x, spec, axis, signs=None, key=None):
    """mxjax.hadamard then mxjax.quantize's keyword form with the spec's recipe fields."""
    if spec.hadamard:
        x = hadamard(x, spec.hadamard, axis=axis, signs=signs)
    r = spec.recipe
    return quantize(x, r.fmt, axis=axis, scale_rule=r.scale_rule, rounding=r.rounding, key=key,
                    sr_prescale=r.sr_prescale)


def test_pairs_cover_every_rule_and_deterministic_rounding():
    covered = {p for pair in RULE_ROUNDING_PAIRS for p in pair}
    assert covered == set(itertools.product(F.ScaleRule, DETERMINISTIC))


@pytest.mark.parametrize(("row_rr", "col_rr"), RULE_ROUNDING_PAIRS)
def test_every_scale_rule_and_deterministic_rounding(np_rng, row_rr, col_rr):
    # 40 x 72: padding to 64 x 96 tiles (32 x 32) and to the 32-block in both copies.
    x = jnp.asarray(hard_matrix(np_rng, (40, 72)))
    row_spec = QuantSpec(recipe=OperandRecipe(fmt=F.MXFP4, scale_rule=row_rr[0],
                                              rounding=row_rr[1]))
    col_spec = QuantSpec(recipe=OperandRecipe(fmt=F.MXFP4, scale_rule=col_rr[0],
                                              rounding=col_rr[1]))
    row, col = fused_quantize(x, row=row_spec, col=col_spec, block_rows=32, block_cols=32)
    assert_same_mx(row, _reference(x, row_spec, 1))
    assert_same_mx(col, _reference(x, col_spec, 0))


@pytest.mark.parametrize(("h", "dtype"), [(16, jnp.bfloat16), (32, jnp.float32), (16, jnp.float32)])
def test_hadamard_then_quantize(np_rng, h, dtype):
    # The paper's recipe: deterministic H16 (fixed signs), EVEN scales, RNE; both copies.
    x = jnp.asarray(hard_matrix(np_rng, (64, 96), specials=False), dtype)
    x = x.at[9, 17].set(jnp.nan)
    spec = QuantSpec(recipe=OperandRecipe(fmt=F.MXFP4, scale_rule=F.ScaleRule.EVEN), hadamard=h)
    signs_r, signs_c = mxjax.fixed_signs(1, h), mxjax.fixed_signs(2, h)
    row, col = fused_quantize(x, row=spec, col=spec, row_signs=signs_r, col_signs=signs_c,
                              block_rows=32, block_cols=64)
    assert_same_mx(row, _reference(x, spec, 1, signs_r))
    assert_same_mx(col, _reference(x, spec, 0, signs_c))


def test_hadamard_padding_stays_positive_zero(np_rng):
    # 48 columns: H16 blocks are whole, the 32-block pads 16 zeros after the rotation.
    x = jnp.asarray(hard_matrix(np_rng, (24, 48), specials=False))
    spec = QuantSpec(hadamard=16)
    signs = -jnp.ones(16, jnp.float32)  # all-negative signs would turn 0 into -0
    row, _ = fused_quantize(x, row=spec, row_signs=signs)
    assert_same_mx(row, _reference(x, spec, 1, signs))


def test_different_specs_per_copy(np_rng):
    x = jnp.asarray(hard_matrix(np_rng, (64, 96), specials=False), jnp.bfloat16)
    row_spec = QuantSpec(recipe=OperandRecipe(fmt=F.MXFP4, scale_rule="rceil",
                                              rounding="nearest_away"))
    col_spec = QuantSpec(recipe=OperandRecipe(fmt=F.MXFP8_E4M3, scale_rule="ceil"), hadamard=32)
    row, col = fused_quantize(x, row=row_spec, col=col_spec)
    assert_same_mx(row, _reference(x, row_spec, 1))
    assert_same_mx(col, _reference(x, col_spec, 0))


@pytest.mark.parametrize("fmt", [F.MXFP8_E4M3, F.MXFP8_E5M2])
def test_mxfp8_row_copy(np_rng, fmt):
    x = jnp.asarray(hard_matrix(np_rng, (40, 72)))
    spec = QuantSpec(recipe=OperandRecipe(fmt=fmt, scale_rule=F.ScaleRule.EVEN))
    row, col = fused_quantize(x, row=spec)
    assert col is None
    assert_same_mx(row, _reference(x, spec, 1))


def test_stochastic_rounding_matches_reference_bits(np_rng):
    x = jnp.asarray(hard_matrix(np_rng, (64, 96)))
    spec = QuantSpec(recipe=OperandRecipe(fmt=F.MXFP4, rounding=F.Rounding.STOCHASTIC,
                                          sr_prescale=True), hadamard=16)
    k_row, k_col = jax.random.split(jax.random.key(7))
    row, col = fused_quantize(x, row=spec, col=spec, row_key=k_row, col_key=k_col,
                              block_rows=32, block_cols=32)
    assert_same_mx(row, _reference(x, spec, 1, key=k_row))
    assert_same_mx(col, _reference(x, spec, 0, key=k_col))
    # A different key changes the draw (the key really is used).
    row2, _ = fused_quantize(x, row=spec, row_key=k_col)
    assert not np.array_equal(np.asarray(row2.codes), np.asarray(row.codes))


def test_inside_jit_and_default_tiles(np_rng):
    x = jnp.asarray(hard_matrix(np_rng, (130, 200)))
    spec = QuantSpec(recipe=OperandRecipe(fmt=F.MXFP4, scale_rule="even"))
    row, col = jax.jit(lambda v: fused_quantize(v, row=spec, col=spec))(x)
    assert_same_mx(row, _reference(x, spec, 1))
    assert_same_mx(col, _reference(x, spec, 0))


@pytest.mark.parametrize(("h", "dtype"),
                         [(16, jnp.bfloat16), (32, jnp.float32), (128, jnp.float32)])
def test_hadamard_tile_is_mxjax_hadamard_bit_for_bit(np_rng, h, dtype):
    x = jnp.asarray(hard_matrix(np_rng, (8, 256), specials=False), dtype)
    signs = mxjax.fixed_signs(5, h)
    for s in (None, signs):
        got = jax.jit(lambda v, s=s: _hadamard_tile(v, h, s))(x)
        want = mxjax.hadamard(x, h, axis=-1, signs=s)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                      np.asarray(want).view(np.uint8))


def test_pack_tile_layout():
    codes = jnp.asarray(np.arange(16, dtype=np.uint8).reshape(2, 8) % 16)
    packed = np.asarray(_pack_tile(codes))
    # first code in the low nibble
    np.testing.assert_array_equal(packed[0], [0x10, 0x32, 0x54, 0x76])


def test_errors(np_rng):
    x = jnp.ones((32, 32))
    with pytest.raises(ValueError, match="fmt"):
        QuantSpec(recipe=F.NVFP4)
    with pytest.raises(ValueError, match="hadamard"):
        QuantSpec(hadamard=8)
    with pytest.raises(ValueError, match="at least one copy"):
        fused_quantize(x)
    with pytest.raises(ValueError, match="row_key"):
        fused_quantize(x, row=QuantSpec(recipe=OperandRecipe(fmt=F.MXFP4,
                                                             rounding="stochastic")))
    with pytest.raises(ValueError, match="row_signs"):
        fused_quantize(x, row=QuantSpec(), row_signs=jnp.ones(16))
    with pytest.raises(ValueError, match="not a multiple of col.hadamard"):
        fused_quantize(jnp.ones((48, 32)), col=QuantSpec(hadamard=32))
    with pytest.raises(ValueError, match="2-D"):
        fused_quantize(jnp.ones(32), row=QuantSpec())
    with pytest.raises(TypeError, match="QuantSpec"):
        fused_quantize(x, row="mxfp4")
    with pytest.raises(TypeError, match="recipe: expected an OperandRecipe"):
        QuantSpec(recipe=3)


@pytest.mark.parametrize("rounding", [F.Rounding.NEAREST_EVEN, F.Rounding.STOCHASTIC])
def test_value_dtype_f32_quantizes_the_f32_values_of_a_bf16_input(np_rng, rounding):
    # What mxjax's GEMMs quantize: the f32 canonical operand, rotated in f32 (no bf16
    # rounding after the Hadamard), its scale bounded by f32.
    x = jnp.asarray(hard_matrix(np_rng, (64, 96), specials=False), jnp.bfloat16)
    x = x.at[3, 5].set(jnp.nan).at[7, :32].set(jnp.bfloat16(2.0**120))
    spec = QuantSpec(recipe=OperandRecipe(fmt=F.MXFP4, scale_rule=F.ScaleRule.EVEN,
                                          rounding=rounding), hadamard=16)
    signs = mxjax.fixed_signs(0, 16)
    keys = jax.random.split(jax.random.key(3)) if rounding is F.Rounding.STOCHASTIC else (
        None, None)
    row, col = fused_quantize(x, row=spec, col=spec, row_signs=signs, col_signs=signs,
                              row_key=keys[0], col_key=keys[1], block_rows=32, block_cols=32,
                              value_dtype=jnp.float32)
    x32 = x.astype(jnp.float32)
    assert_same_mx(row, _reference(x32, spec, 1, signs, key=keys[0]))
    assert_same_mx(col, _reference(x32, spec, 0, signs, key=keys[1]))
    # ...which is not what the bf16 input's own quantization gives (the rotation rounds).
    plain, _ = fused_quantize(x, row=spec, row_signs=signs, row_key=keys[0])
    assert not np.array_equal(np.asarray(plain.codes), np.asarray(row.codes))
    with pytest.raises(ValueError, match="value_dtype: expected None or float32"):
        fused_quantize(x, row=spec, value_dtype=jnp.bfloat16)
