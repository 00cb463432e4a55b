"""'xla_fp4' with its rhs given quantized (a quantized residual), checked on this CPU machine.

* `packed_operand` of the canonical MXFP4 operand (`mxjax.quantize_with`) is the in-place
  operand the route would make of the primal, bit for bit: E2M1 elements, E4M3 scales, the
  shift t and ``exact`` (every scale rule, stochastic rounding with its key, Hadamard 16 to
  64, both contraction directions, f32 and bf16, K not a multiple of 32, all-zero blocks,
  blocks so small every code rounds to zero, 2^30 outliers). A block holding NaN or Inf
  makes both inexact (the emulation's branch): nothing else of theirs is read then.
* `mx_gemm_fp4_packed_rhs` is `mx_gemm_fp4` bit for bit: both branches (the block-scaled
  dot, and the emulation when an operand spans more than E4M3's window or holds NaN),
  batch axes, a contraction not last, a bf16 result, the lhs by the one-pass kernel
  (Pallas interpreter), and the recipes of every MXFP4 preset's backward GEMMs.
* `kernel_packed` (the residual by the one-pass kernel, in one or both directions) is the
  canonical operand, MXArray for MXArray.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals's list

import mxjax
from mxjax import OperandRecipe, Rounding, ScaleRule, policies
from mxjax.emulation import in_place
from mxjax.operands import rotation_signs, split_key
from mxjax.quantization import quantize_with
from mxjax.recipes import GemmRecipe
from mxjax.rotation import hadamard
from mxjax.routes import xla_fp4
from tests.mxjax.routes._packed_rhs_testutil import (
    assert_randomized_backward_recipes_are_the_gemms,
    normal_operands,
)

MXFP4 = OperandRecipe(fmt=mxjax.MXFP4, scale_rule=ScaleRule.EVEN)
_SLOW = pytest.mark.slow


def _signs(h, seed=1):
    if h is None:
        return None
    return jnp.asarray(np.where(np.random.default_rng(seed).random(h) < 0.5, -1.0, 1.0),
                       jnp.float32)


def _canonical_q(b, dims, recipe, k_rhs, signs):
    """The rhs as the backward GEMM quantizes it: canonical, rotated, quantized."""
    b3 = _canonical_rhs(b, dims)
    h = recipe.hadamard
    if h is not None:
        pad = (-b3.shape[-1]) % h.block_size
        b3 = jnp.pad(b3, [(0, 0)] * (b3.ndim - 1) + [(0, pad)])
        b3 = hadamard(b3, h.block_size, axis=-1, signs=signs)
    return quantize_with(b3, recipe.rhs, -1, key=k_rhs)


def _canonical_rhs(b, dims):
    (_, cb), (_, bb) = dims
    free = [i for i in range(b.ndim) if i not in cb and i not in bb]
    shape = tuple(b.shape[i] for i in bb) + (int(np.prod([b.shape[i] for i in free])),
                                             int(np.prod([b.shape[i] for i in cb])))
    return jnp.transpose(b, tuple(bb) + tuple(free) + tuple(cb)).reshape(shape).astype(jnp.float32)


def _bits(parts):
    elements, scales, t, exact = parts
    bits = jax.lax.bitcast_convert_type
    return bits(elements, jnp.uint4).astype(jnp.uint8), bits(scales, jnp.uint8), t, exact


def _operands(x, contract, op, h, key):
    view = in_place.contraction_view(x, (), contract)
    k_pad = xla_fp4._k_pad(view.x.shape[view.axis], h)
    signs = _signs(h)
    in_place_parts = xla_fp4.in_place_operand(view, op, key, k_out=k_pad, hadamard_size=h,
                                              signs=signs)
    dims = (((contract[0],), (contract[0],)), ((), ()))
    had = None if h is None else mxjax.Hadamard(block_size=h)
    recipe = GemmRecipe(lhs=op, rhs=op, hadamard=had)
    q = _canonical_q(x, dims, recipe, key, signs)
    return in_place_parts, xla_fp4.packed_operand(q)


def _adversarial(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 100)).astype(np.float32)
    x[:, :32] = 0.0                   # all-zero blocks (either direction)
    x[3, 32:64] = 1e-44               # every code rounds to zero; exponent clamped at -127
    x[5, 64:96] *= 2.0 ** 30          # outliers
    x[9, 40] = -0.0
    return jnp.asarray(x, dtype)


# Both directions, H16 and none, in the default run; bf16 and H32/H64 under make test-slow.
@pytest.mark.parametrize("dtype,contract,h", [
    (jnp.float32, (1,), None), (jnp.float32, (0,), 16)] + [
    pytest.param(d, c, h, marks=_SLOW) for d in (jnp.float32, jnp.bfloat16)
    for c in ((1,), (0,)) for h in (None, 16, 32, 64)
    if (d, c, h) not in ((jnp.float32, (1,), None), (jnp.float32, (0,), 16))])
def test_packed_operand_is_the_in_place_operand_bit_for_bit(dtype, contract, h):
    in_place_parts, packed = _operands(_adversarial(dtype), contract, MXFP4, h, None)
    chex.assert_trees_all_equal(_bits(in_place_parts), _bits(packed))


@pytest.mark.parametrize("rule", [ScaleRule.FLOOR] + [
    pytest.param(r, marks=_SLOW) for r in ScaleRule if r != ScaleRule.FLOOR])
def test_packed_operand_under_every_scale_rule(rule):
    op = OperandRecipe(fmt=mxjax.MXFP4, scale_rule=rule)
    in_place_parts, packed = _operands(_adversarial(jnp.float32), (1,), op, None, None)
    chex.assert_trees_all_equal(_bits(in_place_parts), _bits(packed))


@pytest.mark.parametrize("h", [None, 16])
def test_packed_operand_with_stochastic_rounding_and_its_key(h):
    op = OperandRecipe(fmt=mxjax.MXFP4, rounding=Rounding.STOCHASTIC, sr_prescale=True)
    in_place_parts, packed = _operands(_adversarial(jnp.float32), (0,), op, h,
                                       jax.random.key(4))
    chex.assert_trees_all_equal(_bits(in_place_parts), _bits(packed))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_block_makes_both_forms_inexact(bad):
    x = np.asarray(_adversarial(jnp.float32)).copy()
    x[7, 3] = bad
    in_place_parts, packed = _operands(jnp.asarray(x), (1,), MXFP4, None, None)
    # Neither's elements, scales nor shift are read then: the GEMM is the emulation's.
    assert not bool(in_place_parts[3]) and not bool(packed[3])


def test_packed_operand_rejects_what_is_not_a_canonical_mxfp4_operand():
    with pytest.raises(ValueError, match="q: expected an MXFP4 MXArray"):
        xla_fp4.packed_operand(mxjax.quantize(jnp.ones((4, 32)), mxjax.NVFP4))
    with pytest.raises(ValueError, match="q: expected an MXFP4 MXArray"):
        xla_fp4.packed_operand(mxjax.quantize(jnp.ones((64, 4)), mxjax.MXFP4, axis=0))


# --------------------------------------------------------------------------- the GEMM
_MM = (((1,), (0,)), ((), ()))


@jax.jit(static_argnames=("dims", "recipe", "out_dtype", "kernel"))
def _both(a, b, key, *, dims, recipe, out_dtype=None, kernel=False):
    k_lhs, k_rhs, k_had = split_key(key if recipe.needs_key else None)
    signs = None if recipe.hadamard is None else rotation_signs(recipe.hadamard, k_had)
    kw = {"out_dtype": out_dtype, "kernel": kernel, "interpret": kernel}
    primal = xla_fp4.mx_gemm_fp4(a, b, dims, recipe, k_lhs, k_rhs, signs, **kw)
    q = _canonical_q(b, dims, recipe, k_rhs, signs)
    packed = xla_fp4.mx_gemm_fp4_packed_rhs(a, q, b.shape, dims, recipe, k_lhs, signs, **kw)
    return primal, packed


def _h16(gemm="wgrad"):
    return getattr(policies.get("mxfp4_all_h16"), gemm)


@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_the_packed_rhs_gemm_is_the_routes_gemm_bit_for_bit(gemm):
    a, b = normal_operands()
    primal, packed = _both(a, b, None, dims=_MM, recipe=_h16(gemm))
    chex.assert_trees_all_equal(primal, packed)


def test_the_emulation_branch_is_the_same_for_a_wide_or_nan_rhs():
    a, b = normal_operands()
    rng = np.random.default_rng(2)
    wide = b * jnp.asarray(2.0 ** rng.integers(-40, 40, size=(1, 80)), jnp.bfloat16)
    for rhs in (wide, b.at[3, 5].set(jnp.nan)):
        primal, packed = _both(a, rhs, None, dims=_MM, recipe=_h16())
        chex.assert_trees_all_equal(primal, packed)


def test_batch_axes_a_contraction_not_last_and_a_bf16_result():
    a, b = normal_operands((2, 48, 40), (2, 24, 48), jnp.float32)
    dims = (((1,), (2,)), ((0,), (0,)))
    for out_dtype in (None, jnp.bfloat16):
        primal, packed = _both(a, b, None, dims=dims, recipe=_h16(), out_dtype=out_dtype)
        chex.assert_trees_all_equal(primal, packed)


@_SLOW
def test_the_lhs_by_the_one_pass_kernel():
    a, b = normal_operands((64, 64), (64, 32))
    primal, packed = _both(a, b, None, dims=_MM, recipe=_h16("dgrad"), kernel=True)
    chex.assert_trees_all_equal(primal, packed)


@pytest.mark.parametrize("preset", ["tseng", pytest.param("mxfp4_all_sr", marks=_SLOW),
                                    pytest.param("mxfp4_all_rht16", marks=_SLOW)])
def test_the_backward_recipes_of_randomized_presets_with_their_keys(preset):
    assert_randomized_backward_recipes_are_the_gemms(_both, preset, _MM)


def test_the_packed_rhs_gemm_rejects_a_q_of_another_contraction():
    a, b = normal_operands()
    q = quantize_with(jnp.ones((80, 64)), MXFP4, -1)
    with pytest.raises(ValueError, match="q: its contraction"):
        xla_fp4.mx_gemm_fp4_packed_rhs(a, q, b.shape, _MM, _h16(), None, _signs(16))
    with pytest.raises(ValueError, match="the 'xla_fp4' backend takes MXFP4"):
        xla_fp4.mx_gemm_fp4_packed_rhs(a, q, b.shape, _MM, policies.get("nvfp4").wgrad,
                                       None, None)


# ------------------------------------------------------------ the residual by the kernel
@pytest.mark.parametrize("axis,h,pair", [(0, 16, True), pytest.param(1, 16, False, marks=_SLOW),
                                         pytest.param(1, 32, True, marks=_SLOW),
                                         pytest.param(0, None, False, marks=_SLOW)])
def test_kernel_packed_is_the_canonical_operand_bit_for_bit(axis, h, pair):
    # Paired: both sizes whole blocks; single: the adversarial 40 x 100 (K padded inside).
    x = _adversarial(jnp.float32)[:, :96] if pair else _adversarial(jnp.float32)
    x = x[:32] if pair else x
    signs = _signs(h)
    got = jax.jit(lambda x: xla_fp4.kernel_packed(x, axis, MXFP4, hadamard_size=h, signs=signs,
                                                  pair=pair, bf16_values=True,
                                                  interpret=True))(x)
    recipe = GemmRecipe(lhs=MXFP4, rhs=MXFP4,
                        hadamard=None if h is None else mxjax.Hadamard(block_size=h))
    dims = (((axis,), (axis,)), ((), ()))
    want = _canonical_q(x.astype(jnp.bfloat16), dims, recipe, None, signs)
    chex.assert_trees_all_equal(got, want)


# ------------------------------------------------- the route in mxjax.dot_general's backward
_CALLS = {
    "activation_weight": ((3, 37, 50), (50, 45), (((2,), (0,)), ((), ()))),
    "two_contractions": ((6, 37, 5), (5, 45, 6), (((0, 2), (2, 0)), ((), ()))),
}


def _route_grads(case, packed, monkeypatch):
    from mxjax import interceptor

    ls, rs, dims = _CALLS[case]
    x = jax.random.normal(jax.random.key(2), ls, jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), rs, jnp.float32) * 0.2  # f32, cast to bf16
    policy = policies.get("mxfp4_all_h16@xla_fp4")

    def loss(x, w):
        y = mxjax.dot_general(x, w, dims, policy=policy, operand_dtype=jnp.bfloat16)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    with monkeypatch.context() as m:
        if not packed:
            m.setattr(interceptor, "saves_packed", lambda recipe: False)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
        residuals = [(r.dtype, r.shape) for r, _ in saved_residuals(loss, x, w)]
    return grads, residuals


@pytest.mark.slow
@pytest.mark.parametrize("case", ["activation_weight",
                                  pytest.param("two_contractions", marks=_SLOW)])
def test_dot_generals_gradients_on_the_route_are_the_same_with_packed_residuals(case,
                                                                                 monkeypatch):
    from mxjax.residuals import saves_packed

    recipe = policies.get("mxfp4_all_h16@xla_fp4")
    assert saves_packed(recipe.dgrad) and saves_packed(recipe.wgrad)
    got, packed = _route_grads(case, True, monkeypatch)
    want, plain = _route_grads(case, False, monkeypatch)
    chex.assert_trees_all_equal(got, want)
    x_shape = _CALLS[case][0]
    assert (jnp.dtype(jnp.bfloat16), x_shape) in plain
    assert (jnp.dtype(jnp.bfloat16), x_shape) not in packed  # X saved as codes and scales
    assert any(d == jnp.uint8 for d, _ in packed)


@pytest.mark.parametrize("gemm", ["dgrad", pytest.param("wgrad", marks=_SLOW)])
def test_the_routes_kernel_pack_is_the_canonical_pack(gemm):
    # Route.pack_rhs (a GPU's: the one-pass kernel, here in the Pallas interpreter) against
    # mxjax.residuals' canonical pack: W [64, 96] f32 cast to bf16 for dgrad (contracted
    # along its N), X [2, 32, 64] for wgrad (contracted along its tokens).
    from mxjax.residuals import _canonical_pack, _PackSpec

    recipe = getattr(policies.get("mxfp4_all_h16@xla_fp4"), gemm)
    rng = np.random.default_rng(9)
    if gemm == "dgrad":
        b, dims, dtype = jnp.asarray(rng.standard_normal((64, 96)), jnp.float32), \
            (((1,), (1,)), ((), ())), jnp.bfloat16
    else:
        b, dims, dtype = jnp.asarray(rng.standard_normal((2, 32, 64)), jnp.bfloat16), \
            (((0, 1), (0, 1)), ((), ())), None
    got = jax.jit(lambda b: xla_fp4.ROUTE.pack_rhs(b, dims=dims, recipe=recipe, key=None,
                                                    operand_dtype=dtype, interpret=True))(b)
    want = jax.jit(lambda b: _canonical_pack(b, None, _PackSpec(dims, recipe, dtype)))(b)
    chex.assert_trees_all_equal(got, want)
