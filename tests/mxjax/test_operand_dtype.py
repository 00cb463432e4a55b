"""``dot_general(..., operand_dtype=d)`` is ``dot_general(lhs.astype(d), rhs.astype(d), ...)``.

Bit for bit, in the value and in both cotangents (dtypes included), for every kind of
policy (pass-through, MXFP4 with and without a Hadamard, stochastic rounding, NVFP4,
FP8), mixed operand dtypes, ``preferred_element_type``, with and without jit, and for
second derivatives. The TPU kernel that takes the cast into its quantize pass (it
reads f32 and rounds to bf16 itself) is checked in the Pallas interpreter against the
GPU form of operands cast by ml_dtypes (an independent bf16 rounding), on f32 values
chosen to round in every way: ties to even both ways, past bf16's largest finite
value, f32 subnormals, NaN and Inf.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mxjax
from mxjax.emulation import in_place, in_place_tpu
from mxjax.interceptor import dot_general, observe

DN = (((1,), (0,)), ((), ()))


def _f32_rounding_cases(rng, shape) -> np.ndarray:
    """f32 values whose bf16 roundings differ from truncation in every way."""
    x = np.clip(rng.standard_normal(shape), -3, 3).astype(np.float32)
    flat = x.reshape(-1)
    bits = flat.view(np.uint32)
    # halfway between two bf16 values: ties to even, down (even) and up (odd)
    bits[0:4] = [0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000]
    bits[4:6] = [0x3F808001, 0x3F807FFF]  # just above / below the tie
    bits[6:8] = [0x7F7FFFFF, 0xFF7F8000]  # f32 max: bf16 rounds it to +-Inf
    bits[8:10] = [0x00000001, 0x80400000]  # f32 subnormals
    if flat.size > 700:
        flat[600] = np.nan
        flat[700] = -np.inf
    return x


def _bf16_by_ml_dtypes(x) -> jax.Array:
    return jnp.asarray(np.asarray(x).astype(ml_dtypes.bfloat16))


TPU_LAYOUTS = (((128, 256), (), (1,)), ((256, 128), (), (0,)), ((2, 64, 128), (0,), (1,)))


@pytest.mark.parametrize("recipe_kw,h", [({"scale_rule": "even"}, 16), ({"scale_rule": "floor"},
                                                                          None)])
def test_tpu_kernel_rounds_f32_operands_to_bf16_itself(recipe_kw, h, np_rng):
    op = mxjax.OperandRecipe(fmt=mxjax.MXFP4, **recipe_kw)
    xs = [jnp.asarray(_f32_rounding_cases(np_rng, s)) for s, _, _ in TPU_LAYOUTS]
    cast = [_bf16_by_ml_dtypes(x) for x in xs]

    def values(x, batch, contract, form, operand_dtype=None):
        view = in_place.contraction_view(x, batch, contract)
        k = view.x.shape[view.axis]
        kw = {"k_out": k if h is None else -(-k // h) * h, "hadamard_size": h, "signs": None,
              "key": None}
        if form == "tpu":
            return in_place.mx_operand_values_tpu(view, op, interpret=True,
                                                     operand_dtype=operand_dtype, **kw)
        return in_place.mx_operand_values(view, op, **kw)

    def run(xs, cast):
        return [(values(x, b, c, "tpu", jnp.bfloat16), values(xc, b, c, "gpu"))
                for x, xc, (_, b, c) in zip(xs, cast, TPU_LAYOUTS)]

    with in_place_tpu.record_kernels() as specs:
        results = jax.jit(run)(xs, cast)
    # every operand went through the kernel, reading f32 and rounding it there
    assert [(s.dtype, s.bf16_cast) for s in specs] == [("float32", True)] * len(TPU_LAYOUTS)
    for got, want in results:
        chex.assert_trees_all_equal(got, want)
        assert np.isnan(np.asarray(got, np.float32)).any()  # the NaN/Inf blocks came through


def test_tpu_kernel_cast_falls_back_when_the_operand_does_not_tile(np_rng):
    op = mxjax.OperandRecipe(fmt=mxjax.MXFP4, scale_rule="even")
    x = jnp.asarray(_f32_rounding_cases(np_rng, (8, 96)))

    def both(x, xc):
        kw = {"k_out": 96, "hadamard_size": 16, "signs": None, "key": None}
        got = in_place.mx_operand_values_tpu(in_place.contraction_view(x, (), (1,)), op,
                                                interpret=True, operand_dtype=jnp.bfloat16,
                                                **kw)
        return got, in_place.mx_operand_values(in_place.contraction_view(xc, (), (1,)),
                                                  op, **kw)

    with in_place_tpu.record_kernels() as specs:
        got, want = jax.jit(both)(x, _bf16_by_ml_dtypes(x))
    assert specs == []
    chex.assert_trees_all_equal(got, want)


def test_tpu_kernel_rejects_a_bf16_cast_of_a_non_f32_operand():
    op = mxjax.OperandRecipe(fmt=mxjax.MXFP4)
    with pytest.raises(ValueError, match="bf16_cast: needs a float32 x3"):
        in_place_tpu.mx_values_tpu(jnp.zeros((1, 128, 128), jnp.bfloat16), op,
                                      hadamard_size=16, signs=None, u=None, bf16_cast=True)


@pytest.mark.slow  # ~9 s; the kernel's cast is also checked by the value tests above
@pytest.mark.parametrize("name", ["mxfp4_all_h16", "mxfp4_all_sr"])
def test_tpu_form_gemm_with_operand_dtypes_equals_the_cast_gemm(name, np_rng):
    """All three GEMMs' TPU form (kernels in the interpreter), f32 operands cast inside."""
    policy = mxjax.policies.get(name)
    key = jax.random.key(3)
    a = jnp.asarray(_f32_rounding_cases(np_rng, (128, 256)))
    b = jnp.asarray(_f32_rounding_cases(np_rng, (256, 128)))
    dims = mxjax.dimensions.normalize_dimension_numbers(DN, a.shape, b.shape)
    ab, bb = _bf16_by_ml_dtypes(a), _bf16_by_ml_dtypes(b)

    def run(a, b, ab, bb):
        out = []
        for recipe in (policy.fprop, policy.dgrad, policy.wgrad):
            k_lhs, k_rhs, k_had = mxjax.operands.split_key(key)
            signs = None if recipe.hadamard is None else mxjax.operands.rotation_signs(
                recipe.hadamard, k_had)
            args = (dims, recipe, k_lhs, k_rhs, signs)
            out.append((in_place.mx_gemm(a, b, *args, form="tpu", interpret=True,
                                            operand_dtypes=(jnp.bfloat16, jnp.bfloat16)),
                        in_place.mx_gemm(ab, bb, *args, form="tpu", interpret=True),
                        in_place.mx_gemm(a, b, *args, form="gpu",
                                            operand_dtypes=(jnp.bfloat16, jnp.bfloat16))))
        return out

    # eagerly: XLA:CPU cannot run the jitted TPU form's bf16 GEMM (DotThunk: BF16 x BF16
    # = F32 is unimplemented for the layout it picks there)
    with in_place_tpu.record_kernels() as specs:
        results = run(a, b, ab, bb)
    assert any(s.bf16_cast for s in specs) and all(s.dtype == "float32" for s in specs
                                                   if s.bf16_cast)
    for tpu_cast, tpu_ref, gpu_cast in results:
        chex.assert_trees_all_equal(tpu_cast, tpu_ref)
        chex.assert_trees_all_equal(gpu_cast, tpu_ref)


_SLOW = pytest.mark.slow
# (policy, lhs dtype, rhs dtype, operand_dtype, preferred_element_type)
CALLS = [
    ("mxfp4_all_h16", jnp.bfloat16, jnp.float32, jnp.bfloat16, None),
    ("mxfp4_all_h16", jnp.float32, jnp.float32, jnp.bfloat16, jnp.float32),
    ("mxfp4_all_sr", jnp.bfloat16, jnp.float32, jnp.bfloat16, None),
    ("passthrough", jnp.bfloat16, jnp.float32, jnp.bfloat16, None),
    pytest.param(("nvfp4", jnp.float32, jnp.float32, jnp.float16, None), marks=_SLOW),
    pytest.param(("fp8", jnp.bfloat16, jnp.float32, jnp.bfloat16, jnp.float32), marks=_SLOW),
    pytest.param(("mxfp4_all_h16_wgrad", jnp.float32, jnp.bfloat16, jnp.float32, None),
                 marks=_SLOW),
]
# Without jit (each op dispatched on its own, ~20 s a quantizing call): a pass-through
# call and MXFP4 on fprop only in the default run.
EAGER_CALLS = [("passthrough", jnp.bfloat16, jnp.float32, jnp.bfloat16, None),
               ("mxfp4_fprop", jnp.bfloat16, jnp.float32, jnp.bfloat16, jnp.float32)] + [
    pytest.param(*(c.values if hasattr(c, "values") else (c,)), marks=_SLOW) for c in CALLS]


def _loss_pair(name, operand_dtype, pet):
    policy = mxjax.policies.get(name)
    key = jax.random.key(7) if policy.needs_key else None

    def cast_first(x, w):
        y = dot_general(x.astype(operand_dtype), w.astype(operand_dtype), DN,
                        preferred_element_type=pet, policy=policy, key=key)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), y

    def cast_inside(x, w):
        y = dot_general(x, w, DN, preferred_element_type=pet, policy=policy, key=key,
                        operand_dtype=operand_dtype)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), y

    return cast_first, cast_inside


def _check_value_and_cotangents(call, transform):
    name, lhs_dtype, rhs_dtype, operand_dtype, pet = call
    rng = np.random.default_rng(4)
    x = jnp.asarray(_f32_rounding_cases(rng, (24, 96)) * 0.5).astype(lhs_dtype)
    w = jnp.asarray(_f32_rounding_cases(rng, (96, 40))).astype(rhs_dtype)
    x = jnp.where(jnp.isfinite(x), x, -2.0)  # finite gradients to compare
    w = jnp.where(jnp.isfinite(w), w, 1.0)
    cast_first, cast_inside = _loss_pair(name, operand_dtype, pet)
    want = transform(jax.value_and_grad(cast_first, (0, 1), has_aux=True))(x, w)
    got = transform(jax.value_and_grad(cast_inside, (0, 1), has_aux=True))(x, w)
    chex.assert_trees_all_equal(got, want, strict=True)
    _, (gx, gw) = got
    assert gx.dtype == lhs_dtype and gw.dtype == rhs_dtype


@pytest.mark.parametrize("call", CALLS, ids=lambda c: f"{c[0]}-{c[3].__name__}")
def test_value_and_cotangents_equal_the_cast_call_with_jit(call):
    _check_value_and_cotangents(call, jax.jit)


@pytest.mark.parametrize("call", EAGER_CALLS, ids=lambda c: f"{c[0]}-{c[3].__name__}")
def test_value_and_cotangents_equal_the_cast_call_without_jit(call):
    _check_value_and_cotangents(call, lambda f: f)


def test_second_derivatives_equal_the_cast_call(np_rng):
    x = jnp.asarray(np_rng.standard_normal((8, 96)), jnp.bfloat16)
    w = jnp.asarray(np_rng.standard_normal((96, 16)), jnp.float32)
    cast_first, cast_inside = _loss_pair("mxfp4_all_h16", jnp.bfloat16, None)

    def hvp(loss):
        g = jax.grad(lambda w: loss(x, w)[0])
        return jax.jit(lambda w, v: jax.jvp(g, (w,), (v,))[1])(w, jnp.ones_like(w))

    chex.assert_trees_all_equal(hvp(cast_inside), hvp(cast_first))


def test_observers_see_the_cast_operands(np_rng):
    x = jnp.asarray(np_rng.standard_normal((8, 64)), jnp.bfloat16)
    w = jnp.asarray(np_rng.standard_normal((64, 32)), jnp.float32)
    seen = []

    def hook(call):
        seen.append((call.lhs.dtype, call.rhs.dtype))
        return call(call.lhs, call.rhs, call.key)

    with observe(hook):
        y = jax.jit(lambda x, w: dot_general(x, w, DN, policy=mxjax.policies.get("mxfp4_all"),
                                             operand_dtype=jnp.bfloat16))(x, w)
    assert seen == [(jnp.bfloat16, jnp.bfloat16)]
    assert y.dtype == jnp.bfloat16


@pytest.mark.parametrize("bad", [jnp.int8, "nonsense", jnp.float64])
def test_bad_operand_dtype_names_the_argument(bad):
    x = jnp.zeros((4, 32), jnp.float32)
    with pytest.raises(TypeError, match="operand_dtype: expected None, float32, bfloat16"):
        dot_general(x, x.T, DN, policy=mxjax.policies.get("mxfp4_all"), operand_dtype=bad)


def test_public_entry_points_pass_operand_dtype(np_rng):
    x = jnp.asarray(np_rng.standard_normal((8, 64)), jnp.bfloat16)
    w = jnp.asarray(_f32_rounding_cases(np_rng, (64, 32)))
    w = jnp.where(jnp.isfinite(w), w, 0.5)
    policy = mxjax.policies.get("mxfp4_all")

    @jax.jit
    def run(x, w):
        return (mxjax.dot_general(x, w, DN, policy="mxfp4_all", operand_dtype=jnp.bfloat16),
                policy.dot_general()(x, w, DN, operand_dtype=jnp.bfloat16),
                mxjax.dot_general(x, w.astype(jnp.bfloat16), DN, policy=policy))

    by_name, by_method, want = run(x, w)
    chex.assert_trees_all_equal(by_name, want, strict=True)
    chex.assert_trees_all_equal(by_method, want, strict=True)
