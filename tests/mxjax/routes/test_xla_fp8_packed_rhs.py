"""'xla_fp8' (MXFP4 carried in FP8, Hopper's route) with its rhs given quantized (a quantized
residual), checked on this CPU machine (XLA:CPU computes the f8 dot from exact products).

* `packed_window` of the canonical operand is the in-place operand's E4M3 window (the shift
  t and ``exact``): every scale rule, stochastic rounding with its key, H16, both
  contraction directions, all-zero blocks, blocks so small every code rounds to zero,
  outliers past the window, NaN.
* `mx_gemm_fp8_packed_rhs` is `mx_gemm_fp8` bit for bit: fprop, dgrad and wgrad, the
  emulation's branch (a rhs wider than E4M3's window, or holding NaN), batch axes, a
  contraction not last, a bf16 result, the randomized presets' backward recipes with keys.
* Through `mxjax.dot_general`'s backward on the route: the gradients of the packed
  residuals are those of the bf16 ones, and X is saved as codes.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import OperandRecipe, ScaleRule, policies
from mxjax.dimensions import Dims
from mxjax.emulation import in_place
from mxjax.operands import canonical_operands, rotate, rotation_signs, split_key
from mxjax.quantization import quantize_with
from mxjax.routes import xla_fp8
from tests.mxjax.routes._packed_rhs_testutil import (
    assert_packed_gradients_are_the_bf16_residuals,
    assert_randomized_backward_recipes_are_the_gemms,
    normal_operands,
)

_MM = (((1,), (0,)), ((), ()))
_SLOW = pytest.mark.slow


def _canonical_q(a, b, dims, recipe, key):
    """The rhs as the backward GEMM quantizes it (canonical, rotated), with the GEMM's keys."""
    _, k_rhs, k_had = split_key(key if recipe.needs_key else None)
    _, b3 = rotate(*canonical_operands(a, b, Dims(*dims)), recipe, k_had)
    return quantize_with(b3, recipe.rhs, -1, key=k_rhs)


def _adversarial(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, :] = 0.0  # all-zero blocks along the rows
    x[1, :] *= 2.0 ** -140  # inputs so small every code rounds to zero
    x[2, 5] = 2.0 ** 12  # an outlier
    return x


@pytest.mark.parametrize("rule", [ScaleRule.FLOOR, ScaleRule.EVEN,
                                  pytest.param(ScaleRule.CEIL, marks=_SLOW),
                                  pytest.param(ScaleRule.RCEIL, marks=_SLOW)])
@pytest.mark.parametrize("axis", [0, 1])
def test_packed_window_is_the_in_place_window(rule, axis):
    op = OperandRecipe(fmt=mxjax.MXFP4, scale_rule=rule)
    rng = np.random.default_rng(3)
    x = jnp.asarray(_adversarial(rng, (40, 100)))
    x = x if axis == 1 else x.T
    for scale in (1.0, 2.0 ** 20):  # the second spans past E4M3's window
        xs = x.at[3].multiply(scale) if axis == 1 else x.at[:, 3].multiply(scale)
        view = in_place.contraction_view(xs, (), (axis,))
        k_out = view.x.shape[view.axis]

        def finish(v, amax_bits):
            return v, xla_fp8.carrier_window(amax_bits, op, xla_fp8.RHS_CARRIER)

        _, want = in_place.mx_operand_values(view, op, key=None, finish=finish, k_out=k_out,
                                             hadamard_size=None, signs=None)
        q = quantize_with(jnp.moveaxis(xs, axis, -1), op, -1)
        got = jax.jit(xla_fp8.packed_window, static_argnums=1)(q, xla_fp8.RHS_CARRIER)
        chex.assert_trees_all_equal(got, want)
    assert not bool(want[1])  # the wide one is not exact


def test_a_nan_block_leaves_the_window_to_the_others():
    op = OperandRecipe(fmt=mxjax.MXFP4, scale_rule=ScaleRule.EVEN)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((8, 64)), jnp.float32)
    q = quantize_with(x.at[2, 3].set(jnp.nan), op, -1)
    t, exact = xla_fp8.packed_window(q, xla_fp8.RHS_CARRIER)
    chex.assert_trees_all_equal((t, exact), xla_fp8.packed_window(quantize_with(x, op, -1),
                                                                   xla_fp8.RHS_CARRIER))


@jax.jit(static_argnames=("dims", "recipe", "out_dtype", "gemm_name"))
def _both(a, b, key, *, dims, recipe, out_dtype=None, gemm_name=None):
    k_lhs, k_rhs, k_had = split_key(key if recipe.needs_key else None)
    signs = None if recipe.hadamard is None else rotation_signs(recipe.hadamard, k_had)
    kw = {"out_dtype": out_dtype, "gemm_name": gemm_name}
    primal = xla_fp8.mx_gemm_fp8(a, b, dims, recipe, k_lhs, k_rhs, signs, **kw)
    q = _canonical_q(a, b, dims, recipe, key)
    packed = xla_fp8.mx_gemm_fp8_packed_rhs(a, q, b.shape, dims, recipe, k_lhs, signs, **kw)
    return primal, packed


@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_the_packed_rhs_gemm_is_the_routes_gemm_bit_for_bit(gemm):
    a, b = normal_operands()
    recipe = getattr(policies.get("mxfp4_all_h16"), gemm)
    primal, packed = _both(a, b, None, dims=_MM, recipe=recipe, gemm_name=gemm)
    chex.assert_trees_all_equal(primal, packed)


def test_the_emulation_branch_is_the_same_for_a_wide_or_nan_rhs():
    a, b = normal_operands()
    rng = np.random.default_rng(2)
    wide = b * jnp.asarray(2.0 ** rng.integers(-40, 40, size=(1, 80)), jnp.bfloat16)
    recipe = policies.get("mxfp4_all_h16").wgrad
    for rhs in (wide, b.at[3, 5].set(jnp.nan)):
        primal, packed = _both(a, rhs, None, dims=_MM, recipe=recipe)
        chex.assert_trees_all_equal(primal, packed)
    k = jnp.asarray(xla_fp8.packed_window(_canonical_q(a, wide, _MM, recipe, None),
                                          xla_fp8.RHS_CARRIER)[1])
    assert not bool(k)  # the wide rhs really took the emulation


@_SLOW
def test_batch_axes_a_contraction_not_last_and_a_bf16_result():
    a, b = normal_operands((2, 48, 40), (2, 24, 48), jnp.float32)
    dims = (((1,), (2,)), ((0,), (0,)))
    for out_dtype in (None, jnp.bfloat16):
        primal, packed = _both(a, b, None, dims=dims,
                               recipe=policies.get("mxfp4_all_h16").wgrad, out_dtype=out_dtype)
        chex.assert_trees_all_equal(primal, packed)


@_SLOW
@pytest.mark.parametrize("preset", ["tseng", "mxfp4_all_sr"])
def test_the_backward_recipes_of_randomized_presets_with_their_keys(preset):
    assert_randomized_backward_recipes_are_the_gemms(_both, preset, _MM)


def test_the_packed_rhs_gemm_refuses_other_formats_and_layouts():
    a, b = normal_operands()
    recipe = policies.get("mxfp4_all_h16").wgrad
    with pytest.raises(ValueError, match="q: expected an MXFP4 MXArray"):
        xla_fp8.mx_gemm_fp8_packed_rhs(a, mxjax.quantize(jnp.ones((96, 80)), mxjax.MXFP4,
                                                         axis=0), b.shape, _MM, recipe,
                                       None, None)
    with pytest.raises(ValueError, match="q: expected the canonical operand of shape"):
        xla_fp8.mx_gemm_fp8_packed_rhs(a, quantize_with(jnp.ones((64, 96)), recipe.rhs, -1),
                                       b.shape, _MM, recipe, None, mxjax.fixed_signs(0, 16))
    with pytest.raises(ValueError, match="the 'xla_fp8' backend takes MXFP4"):
        xla_fp8.mx_gemm_fp8_packed_rhs(a, None, b.shape, _MM, policies.get("nvfp4").wgrad,
                                       None, None)


@_SLOW
def test_dot_generals_gradients_on_the_route_are_the_same_with_packed_residuals(monkeypatch):
    x = jax.random.normal(jax.random.key(2), (3, 37, 50), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), (50, 45), jnp.float32) * 0.2  # f32, cast
    assert_packed_gradients_are_the_bf16_residuals(
        policies.get("mxfp4_all_h16@xla_fp8"), x, w, (((2,), (0,)), ((), ())), None,
        monkeypatch)
