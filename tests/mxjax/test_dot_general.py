"""mxjax.dot_general: each GEMM against a hand-written quantize -> dequantize -> dot.

The references below quantize each operand with `mxjax.quantize` along the axis
that GEMM contracts (fprop: K, dgrad: N, wgrad: M), dequantize, and contract
with `jnp.einsum` in f32 at HIGHEST precision. Keys follow the documented
derivation: split(key, 3) -> (fprop, dgrad, wgrad); split(gemm_key, 3) ->
(lhs rounding, rhs rounding, Hadamard signs).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax import lax

import mxjax
from mxjax import interceptor as DG
from mxjax import policies
from mxjax.dimensions import backward_dimension_numbers, normalize_dimension_numbers
from mxjax.formats import BF16, MXFP4
from mxjax.policies import PrecisionPolicy
from mxjax.quantization import dequantize, quantize
from mxjax.recipes import GemmRecipe, Hadamard, OperandRecipe
from mxjax.rotation import fixed_signs, hadamard, random_signs

HI = lax.Precision.HIGHEST
F32 = jnp.float32


# ----------------------------------------------------------------------------- reference
def _qdq(x, recipe: OperandRecipe, axis: int, key):
    """quantize -> dequantize with mxjax.quantize (pass-through: unchanged)."""
    x = x.astype(F32)
    if recipe.is_passthrough:
        return x
    q = quantize(x, recipe.fmt, axis=axis, scale_rule=recipe.scale_rule,
                 rounding=recipe.rounding, key=key if recipe.needs_key else None,
                 sr_prescale=recipe.sr_prescale)
    return dequantize(q, F32)


def _pad_axis(x, axis, mult):
    pad = (-x.shape[axis]) % mult
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def ref_gemm(spec, a, a_axis, b, b_axis, recipe: GemmRecipe, key):
    """One GEMM by hand: (Hadamard) -> quantize/dequantize each operand -> einsum in f32."""
    kl, kr, kh = jax.random.split(key, 3) if key is not None else (None, None, None)
    a, b = a.astype(F32), b.astype(F32)
    if recipe.hadamard is not None:
        h = recipe.hadamard.block_size
        a, b = _pad_axis(a, a_axis, h), _pad_axis(b, b_axis, h)
        if recipe.hadamard.randomized:
            signs = random_signs(kh, h)
        elif recipe.hadamard.seed is not None:
            signs = fixed_signs(recipe.hadamard.seed, h)
        else:
            signs = None
        a = hadamard(a, h, axis=a_axis, signs=signs)
        b = hadamard(b, h, axis=b_axis, signs=signs)
    a = _qdq(a, recipe.lhs, a_axis, kl)
    b = _qdq(b, recipe.rhs, b_axis, kr)
    return jnp.einsum(spec, a, b, precision=HI, preferred_element_type=F32)


def _keys(key):
    return jax.random.split(key, 3) if key is not None else (None, None, None)


# Each case: lhs/rhs shapes, dimension numbers, and the three hand-written GEMMs
# as functions of (x, w, g, policy, (kf, kd, kw)).
def _case_2d():
    def ref(x, w, g, p, ks):
        y = ref_gemm("mk,kn->mn", x, 1, w, 0, p.fprop, ks[0])
        dx = ref_gemm("mn,kn->mk", g, 1, w, 1, p.dgrad, ks[1])
        dw = ref_gemm("mn,mk->kn", g, 0, x, 0, p.wgrad, ks[2])
        return y, dx, dw
    return (64, 96), (96, 80), (((1,), (0,)), ((), ())), ref


def _case_attention():
    # q [b, h, t, d] · k [b, h, s, d] -> [b, h, t, s]; t = 72 is not a multiple of 16/32/64.
    def ref(q, k, g, p, ks):
        y = ref_gemm("bhtd,bhsd->bhts", q, 3, k, 3, p.fprop, ks[0])
        dq = ref_gemm("bhts,bhsd->bhtd", g, 3, k, 2, p.dgrad, ks[1])
        dk = ref_gemm("bhts,bhtd->bhsd", g, 2, q, 2, p.wgrad, ks[2])
        return y, dq, dk
    return (2, 2, 72, 64), (2, 2, 64, 64), (((3,), (3,)), ((0, 1), (0, 1))), ref


def _case_two_contracting():
    # x [m, h, d] · w [h, d, n]: the contraction (h, d) is flattened row-major to 96.
    def ref(x, w, g, p, ks):
        x2, w2 = x.reshape(64, 96), w.reshape(96, 64)
        y = ref_gemm("mk,kn->mn", x2, 1, w2, 0, p.fprop, ks[0])
        dx = ref_gemm("mn,kn->mk", g, 1, w2, 1, p.dgrad, ks[1]).reshape(x.shape)
        dw = ref_gemm("mn,mk->kn", g, 0, x2, 0, p.wgrad, ks[2]).reshape(w.shape)
        return y, dx, dw
    return (64, 4, 24), (4, 24, 64), (((1, 2), (0, 1)), ((), ())), ref


def _case_non_trailing():
    # x [k, m] contracted on its first axis, w [k, n] on its first axis.
    def ref(x, w, g, p, ks):
        y = ref_gemm("km,kn->mn", x, 0, w, 0, p.fprop, ks[0])
        dx = ref_gemm("mn,kn->km", g, 1, w, 1, p.dgrad, ks[1])
        dw = ref_gemm("mn,km->kn", g, 0, x, 1, p.wgrad, ks[2])
        return y, dx, dw
    return (96, 64), (96, 72), (((0,), (0,)), ((), ())), ref


CASES = {
    "2d": _case_2d(),
    "attention": _case_attention(),
    "two_contracting": _case_two_contracting(),
    "non_trailing": _case_non_trailing(),
}
# mxfp4_all on every case but the 2-D one, which VariantsTest checks bit for bit under
# mxfp4_all (with and without jit); Hadamard (with padding: t = 72) and random H64 + SR +
# 3/4 pre-scale on the attention case (batch axes, padding: a superset of the 2-D case;
# H16 on a 2-D GEMM stays in test_contraction_shorter_than_the_hadamard_is_zero_padded);
# the other presets on the 2-D case. `make test-slow` adds the 2-D case to the first three.
FULL_POLICIES = ("mxfp4_all",)
FULL_CASES = ("attention", "two_contracting", "non_trailing")
SOME_CASES = {"tseng": ("attention",), "mxfp4_all_h16": ("attention",)}
TWO_D_POLICIES = ("mxfp4_all_sr", "fp8", "nvfp4", "mxfp4_all_h16_wgrad")


def _inputs(case, dtype=F32, seed=0, integer=False):
    """x, w, g for a case. `integer`: values in [-14, 14] with amax exactly 14, so a
    per-tensor FP8 scale is a power of two and every f32 sum is exact (makes the FP8
    check independent of the summation order)."""
    lshape, rshape, dims, _ = CASES[case]
    keys = jax.random.split(jax.random.key(seed), 3)
    out_shape = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dims),
                               jax.ShapeDtypeStruct(lshape, F32),
                               jax.ShapeDtypeStruct(rshape, F32)).shape

    def draw(k, shape):
        if integer:
            v = jax.random.randint(k, shape, -14, 15).astype(F32)
            return v.reshape(-1).at[0].set(14.0).reshape(shape).astype(dtype)
        return jax.random.normal(k, shape, F32).astype(dtype)

    return draw(keys[0], lshape), draw(keys[1], rshape), draw(keys[2], out_shape), dims


def _vjp_all(fn, x, w, g):
    y, vjp = jax.vjp(fn, x, w)
    dx, dw = vjp(g)
    return y, dx, dw


def _ours_and_reference(policy, cases, key):
    """One jitted function per policy: {case: (ours, reference)} for every case."""
    p = policies.get(policy)

    @jax.jit
    def run(inputs):
        out = {}
        for case, (x, w, g) in inputs.items():
            dims = CASES[case][2]
            f = functools.partial(mxjax.dot_general, dimension_numbers=dims, policy=p, key=key)
            out[case] = (_vjp_all(f, x, w, g), CASES[case][3](x, w, g, p, _keys(key)))
        return out

    return run({c: _inputs(c, integer=policy == "fp8")[:3] for c in cases})


def _assert_same(got, want, label):
    for name, a, b in zip(("fprop", "dgrad", "wgrad"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (label, name, a.shape, b.shape)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{label} {name}")


# ----------------------------------------------------------------------------- bitwise
# The default run: every case of one policy, H16 and NVFP4; the rest under make test-slow.
_DEFAULT_HAND_WRITTEN = ("mxfp4_all", "mxfp4_all_h16", "nvfp4")


@pytest.mark.parametrize("policy", [
    p if p in _DEFAULT_HAND_WRITTEN else pytest.param(p, marks=pytest.mark.slow)
    for p in FULL_POLICIES + tuple(SOME_CASES) + TWO_D_POLICIES])
def test_each_gemm_equals_hand_written(policy):
    cases = FULL_CASES if policy in FULL_POLICIES else SOME_CASES.get(policy, ("2d",))
    _check_each_gemm(policy, cases)


@pytest.mark.slow
@pytest.mark.parametrize("policy", FULL_POLICIES + tuple(SOME_CASES))
def test_each_gemm_equals_hand_written_2d(policy):
    _check_each_gemm(policy, ("2d",))


def _check_each_gemm(policy, cases):
    key = jax.random.key(7) if policies.get(policy).needs_key else None
    for case, (got, want) in _ours_and_reference(policy, cases, key).items():
        if policy == "tseng":
            # The 3/4 pre-scale makes dequantized values (code * 2^s / 0.75) inexact
            # in f32, so the dot's f32 sums depend on XLA's summation order. Any
            # different rounding decision would move an element by ~1e-1.
            for name, a, b in zip(("fprop", "dgrad", "wgrad"), got, want):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5,
                                           err_msg=f"{policy}/{case} {name}")
        else:
            _assert_same(got, want, f"{policy}/{case}")


class VariantsTest(chex.TestCase):
    """The same checks without jit (eager custom_vjp) and with jit."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_2d_mxfp4_all_equals_hand_written(self):
        # Square operands: eager mode compiles each quantizer op once for all six.
        p = policies.get("mxfp4_all")
        k = jax.random.split(jax.random.key(3), 3)
        x, w, g = (jax.random.normal(ki, (64, 64)) for ki in k)
        dims = CASES["2d"][2]
        got = self.variant(lambda x, w, g: _vjp_all(
            lambda a, b: mxjax.dot_general(a, b, dims, policy=p), x, w, g))(x, w, g)
        want = jax.jit(lambda x, w, g: CASES["2d"][3](x, w, g, p, _keys(None)))(x, w, g)
        _assert_same(got, want, "mxfp4_all/2d")

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(dtype=("float32", "bfloat16"), preferred=(None, "float32"))
    def test_bf16_policy_is_lax_bit_for_bit(self, dtype, preferred):
        pet = None if preferred is None else jnp.dtype(preferred)
        for case in CASES:
            x, w, g, dims = _inputs(case, jnp.dtype(dtype))
            g = g.astype(pet or g.dtype)

            ours_fn = functools.partial(mxjax.dot_general, dimension_numbers=dims,
                                        preferred_element_type=pet, policy="passthrough")
            lax_fn = functools.partial(lax.dot_general, dimension_numbers=dims,
                                       preferred_element_type=pet)

            @self.variant
            def run(x, w, g, ours_fn=ours_fn, lax_fn=lax_fn):
                return _vjp_all(ours_fn, x, w, g), _vjp_all(lax_fn, x, w, g)

            ours, theirs = run(x, w, g)
            for a, b in zip(ours, theirs):
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=case)


@pytest.mark.parametrize("policy", ["mxfp4_fprop", "tseng"])
def test_pass_through_gemm_inside_a_mixed_policy_is_lax(policy):
    # mxfp4_fprop: dgrad/wgrad pass through; tseng: fprop passes through.
    p = policies.get(policy)
    x, w, g, dims = _inputs("attention", jnp.bfloat16)
    key = jax.random.key(1)

    @jax.jit
    def run(x, w, g):
        ours = _vjp_all(lambda a, b: mxjax.dot_general(a, b, dims, policy=p, key=key), x, w, g)
        theirs = _vjp_all(lambda a, b: lax.dot_general(a, b, dims), x, w, g)
        return ours, theirs

    ours, theirs = run(x, w, g)
    same = [0] if policy == "tseng" else [1, 2]
    for i in same:
        np.testing.assert_array_equal(np.asarray(ours[i]), np.asarray(theirs[i]))
    for i in set(range(3)) - set(same):
        assert not np.array_equal(np.asarray(ours[i]), np.asarray(theirs[i]))


# ----------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("preferred", [None, jnp.float32])
def test_dtypes_preferred_element_type_and_cotangents(preferred):
    x, w, g, dims = _inputs("2d", jnp.bfloat16)
    g = g.astype(preferred or jnp.bfloat16)

    @jax.jit
    def run(x, w, g):
        f = lambda a, b: mxjax.dot_general(a, b, dims, preferred_element_type=preferred,
                                        policy="mxfp4_all")
        y32 = mxjax.dot_general(x.astype(F32), w.astype(F32), dims, policy="mxfp4_all")
        return _vjp_all(f, x, w, g), y32

    (y, dx, dw), y32 = run(x, w, g)
    assert y.dtype == (preferred or jnp.bfloat16)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    # bf16 inputs are exact in f32: the same f32 values, then cast to the output dtype.
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y32.astype(y.dtype)))


def test_mixed_operand_dtypes_follow_lax_promotion():
    x = jnp.ones((32, 32), jnp.bfloat16)
    w = jnp.ones((32, 16), F32)
    dims = (((1,), (0,)), ((), ()))
    y = jax.jit(lambda x, w: mxjax.dot_general(x, w, dims, policy="mxfp4_all"))(x, w)
    assert y.dtype == lax.dot_general(x, w, dims).dtype == F32
    np.testing.assert_array_equal(np.asarray(y), 32.0)


# ----------------------------------------------------------------------------- hadamard
def test_hadamard_without_quantization_is_the_plain_dot():
    g = GemmRecipe(lhs=BF16, rhs=BF16, hadamard=Hadamard(block_size=32, seed=5))
    p = PrecisionPolicy(fprop=g, dgrad=g, wgrad=g)

    @jax.jit
    def run(inputs):
        out = {}
        for case, (x, w, gy) in inputs.items():
            dims = CASES[case][2]
            out[case] = (
                _vjp_all(functools.partial(mxjax.dot_general, dimension_numbers=dims, policy=p),
                         x, w, gy),
                _vjp_all(functools.partial(lax.dot_general, dimension_numbers=dims, precision=HI),
                         x, w, gy))
        return out

    for case, (ours, plain) in run({c: _inputs(c)[:3] for c in CASES}).items():
        for a, b in zip(ours, plain):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5,
                                       err_msg=case)


def test_contraction_shorter_than_the_hadamard_is_zero_padded():
    # 8 tokens, 8 features, 12 outputs: every GEMM's contraction is shorter than H16.
    p = policies.get("mxfp4_all_h16")
    x = jax.random.normal(jax.random.key(0), (8, 8))
    w = jax.random.normal(jax.random.key(1), (8, 12))
    g = jax.random.normal(jax.random.key(2), (8, 12))
    dims = (((1,), (0,)), ((), ()))
    run = jax.jit(lambda x, w, g: (
        _vjp_all(lambda a, b: mxjax.dot_general(a, b, dims, policy=p), x, w, g),
        CASES["2d"][3](x, w, g, p, _keys(None))))
    got, want = run(x, w, g)
    _assert_same(got, want, "short contraction")


def test_hadamard_reduces_the_error_of_an_outlier_channel():
    # An outlier channel: H16 spreads it over the block, reducing the MXFP4 error.
    x = jax.random.normal(jax.random.key(0), (64, 128)).at[:, 3].mul(40.0)
    w = jax.random.normal(jax.random.key(1), (128, 64))
    dims = (((1,), (0,)), ((), ()))
    run = jax.jit(lambda x, w: [mxjax.dot_general(x, w, dims, policy=n)
                                for n in ("mxfp4_all", "mxfp4_all_h16")]
                  + [lax.dot_general(x, w, dims, precision=HI)])
    plain, h16, exact = map(np.asarray, run(x, w))
    assert np.abs(h16 - exact).mean() < np.abs(plain - exact).mean()


# ----------------------------------------------------------------------------- keys
@pytest.mark.parametrize("name", ["mxfp4_all_sr", "mxfp4_all_rht16"])
def test_randomized_policies_same_key_same_result_different_key_different(name):
    x, w, g, dims = _inputs("2d")
    f = jax.jit(lambda k: _vjp_all(
        lambda a, b: mxjax.dot_general(a, b, dims, policy=name, key=k), x, w, g))
    a, b, c = f(jax.random.key(1)), f(jax.random.key(1)), f(jax.random.key(2))
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b[i]))
    for i, r in enumerate(policies.get(name).gemms.values()):
        if r.needs_key:
            assert not np.array_equal(np.asarray(a[i]), np.asarray(c[i])), (name, i)
        else:
            np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(c[i]))


def test_raw_uint32_keys_work_like_typed_keys():
    x, w, _, dims = _inputs("2d")
    f = jax.jit(lambda k: mxjax.dot_general(x, w, dims, policy="mxfp4_all_rht16", key=k))
    np.testing.assert_array_equal(np.asarray(f(jax.random.key(3))),
                                  np.asarray(f(jax.random.PRNGKey(3))))


def test_gemms_never_share_noise():
    # The same SR recipe on all three GEMMs, and dgrad quantizes g = x along the same
    # axis fprop quantized x: only the per-GEMM keys make the two results differ.
    sr = OperandRecipe(fmt=MXFP4, rounding="stochastic")
    gr = GemmRecipe(lhs=sr, rhs=BF16)
    p = PrecisionPolicy(fprop=gr, dgrad=gr, wgrad=gr)
    x = jax.random.normal(jax.random.key(0), (64, 64))
    eye = jnp.eye(64)

    @jax.jit
    def run(x):
        y, vjp = jax.vjp(lambda a: mxjax.dot_general(a, eye, (((1,), (0,)), ((), ())), policy=p,
                                                  key=jax.random.key(4)), x)
        return y, vjp(x)[0]

    y, dx = run(x)
    assert not np.array_equal(np.asarray(y), np.asarray(dx))


def test_stochastic_rounding_with_prescale_is_unbiased():
    x, w, g, dims = _inputs("2d")

    @jax.jit
    def grads(keys):
        return jax.vmap(lambda k: jax.vjp(
            lambda a: mxjax.dot_general(a, w, dims, policy="tseng", key=k), x)[1](g)[0])(keys)

    dx = grads(jax.random.split(jax.random.key(0), 64))
    exact = lax.dot_general(g, w, (((1,), (1,)), ((), ())), precision=HI)
    one = np.abs(np.asarray(dx[0] - exact)).mean()
    mean = np.abs(np.asarray(dx.mean(0) - exact)).mean()
    assert mean < one / 4  # the error of the average shrinks like 1/sqrt(64)


# ----------------------------------------------------------------------------- transforms
def test_grad_vmap_scan_remat_agree():
    p = policies.get("mxfp4_all")
    dims = (((1,), (0,)), ((), ()))
    ws = jax.random.normal(jax.random.key(1), (2, 32, 32)) * 0.2
    x = jax.random.normal(jax.random.key(0), (2, 16, 32))

    def layer(h, w):
        return jnp.tanh(mxjax.dot_general(h, w, dims, policy=p)), None

    def loss_unrolled(ws, x):
        h = x
        for i in range(ws.shape[0]):
            h, _ = layer(h, ws[i])
        return jnp.sum(h**2)

    def loss_scan(ws, x, remat=False):
        body = jax.checkpoint(layer) if remat else layer
        return jnp.sum(lax.scan(body, x, ws)[0] ** 2)

    def loss_exact(ws, x):
        return jnp.sum(lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0] ** 2)

    @jax.jit
    def run(ws, x):
        vm = lambda f: jax.vmap(jax.grad(f), in_axes=(None, 0))(ws, x)
        return (jax.grad(loss_unrolled)(ws, x[1]), vm(loss_scan),
                vm(lambda w, x: loss_scan(w, x, True)), jax.grad(loss_exact)(ws, x[1]))

    g_ref, g_scan, g_remat, exact = run(ws, x)
    np.testing.assert_allclose(np.asarray(g_scan[1]), np.asarray(g_ref), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_remat[1]), np.asarray(g_ref), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(g_scan[0]), np.asarray(g_scan[1]))
    # The policy acts: the quantized gradient differs from the exact one.
    assert not np.allclose(np.asarray(g_ref), np.asarray(exact), rtol=1e-3)


def test_drop_in_signatures_and_flax_kwargs():
    x, w, _, dims = _inputs("2d")
    dg = policies.get("mxfp4_all").dot_general()

    @jax.jit
    def run(x, w):
        return (dg(x, w, dims, None, None, out_sharding=None),
                mxjax.dot_general(x, w, dims, policy="mxfp4_all"),
                jnp.einsum("mk,kn->mn", x, w, _dot_general=dg))

    y1, y2, y3 = run(x, w)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y3))
    assert dg.policy == policies.get("mxfp4_all")


MATMUL_DIMS = (((1,), (0,)), ((), ()))


def test_without_an_observer_the_interceptor_traces_the_plain_program():
    """mxjax.diagnostics plugs in through DG.observe; outside it nothing is added."""
    pol = policies.get("mxfp4_all_h16")
    x = jnp.ones((32, 32), jnp.float32)
    w = jnp.ones((32, 32), jnp.float32)
    st = DG._Static(normalize_dimension_numbers(MATMUL_DIMS, x.shape, w.shape), None, None, pol)
    plain = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(DG._policy_dot(x, w, None, st))))(w)
    public = jax.make_jaxpr(
        jax.grad(lambda w: jnp.sum(mxjax.dot_general(x, w, MATMUL_DIMS, policy=pol))))(w)
    assert str(public) == str(plain)


def test_observe_sees_each_quantized_call_once_and_keeps_values():
    seen = []

    def hook(call):
        seen.append((call.dims, call.policy.name))
        return call(call.lhs, call.rhs, call.key)

    x = jax.random.normal(jax.random.key(0), (4, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (32, 8), jnp.float32)

    def loss(w, name):
        return jnp.sum(jnp.sin(mxjax.dot_general(x, w, MATMUL_DIMS, policy=name)))

    def step():  # a fresh jit each time: traced (and so observed) on every call
        return jax.jit(jax.value_and_grad(loss), static_argnums=1)

    want = step()(w, "mxfp4_all")
    with DG.observe(hook):
        got = step()(w, "mxfp4_all")
        jax.make_jaxpr(jax.value_and_grad(loss), static_argnums=1)(w, "passthrough")  # unseen
    chex.assert_trees_all_equal(got, want)
    assert seen == [(normalize_dimension_numbers(MATMUL_DIMS, x.shape, w.shape), "mxfp4_all")]
    with pytest.raises(TypeError, match="hook: expected a callable"), DG.observe(None):
        pass

_SHARDING_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import mxjax
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (64, 64))
    w = jax.random.normal(jax.random.key(1), (64, 64))
    dims = (((1,), (0,)), ((), ()))
    def loss(x, w):
        return jnp.sum(jnp.sin(mxjax.dot_general(x, w, dims, policy="mxfp4_all_h16")))
    f = jax.jit(jax.value_and_grad(loss, (0, 1)))
    ref = f(x, w)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    out = f(xs, ws)
    assert out[1][0].sharding.num_devices == 8
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # fprop quantizes along the unsharded K: bit for bit.
    y = jax.jit(lambda x, w: mxjax.dot_general(x, w, dims, policy="mxfp4_all_h16"))
    np.testing.assert_array_equal(np.asarray(y(xs, ws)), np.asarray(y(x, w)))
    print("SHARDING_OK")
    """
)


def _xla_flags_with_8_devices() -> str:
    """The session's XLA_FLAGS (tests/conftest.py's compile level) plus 8 CPU devices."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()


def test_named_sharding_over_8_fake_cpu_devices():
    env = dict(os.environ, XLA_FLAGS=_xla_flags_with_8_devices(),
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _SHARDING_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0 and "SHARDING_OK" in r.stdout, r.stderr[-3000:]


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "lshape, rshape, dims, exc, match",
    [
        ((4, 8), (6, 5), (((1,), (0,)), ((), ())), ValueError, "contracting sizes differ"),
        ((4, 8), (8, 5), ((1, 0), ((), ())), TypeError, "sequence of ints"),
        ((4, 8), (8, 5), (((1,), (0,)),), TypeError, "expected"),
        ((4, 8), (8, 5), (((1,), (0, 1)), ((), ())), ValueError, "contracting dims"),
        ((4, 8), (8, 5), (((2,), (0,)), ((), ())), ValueError, "out of range"),
        ((3, 4, 8), (2, 8, 5), (((2,), (1,)), ((0,), (0,))), ValueError, "batch sizes differ"),
        ((4, 8), (8, 5), (((1,), (0,)), ((1,), (0,))), ValueError, "distinct"),
        ((4, 8), (8, 5), (((1.0,), (0,)), ((), ())), TypeError, "ints"),
    ],
)
def test_bad_dimension_numbers(lshape, rshape, dims, exc, match):
    with pytest.raises(exc, match=match):
        mxjax.dot_general(jnp.ones(lshape), jnp.ones(rshape), dims, policy="mxfp4_all")


def test_bad_operands_policies_and_keys():
    dims = (((1,), (0,)), ((), ()))
    x, w = jnp.ones((32, 32)), jnp.ones((32, 32))
    with pytest.raises(TypeError, match="lhs: .*floating"):
        mxjax.dot_general(jnp.ones((32, 32), jnp.int32), w, dims, policy="mxfp4_all")
    with pytest.raises(TypeError, match="rhs: .*floating"):
        mxjax.dot_general(x, jnp.ones((32, 32), jnp.int8), dims, policy="passthrough")
    with pytest.raises(ValueError, match="unknown preset 'mxfp9'; did you mean 'mxfp8'"):
        mxjax.dot_general(x, w, dims, policy="mxfp9")
    with pytest.raises(TypeError, match="policy"):
        mxjax.dot_general(x, w, dims, policy=None)
    with pytest.raises(ValueError, match="key"):
        mxjax.dot_general(x, w, dims, policy="mxfp4_all_sr")
    with pytest.raises(ValueError, match="key"):
        policies.get("tseng").dot_general()
    with pytest.raises(TypeError, match="preferred_element_type"):
        mxjax.dot_general(x, w, dims, preferred_element_type=jnp.int32, policy="mxfp4_all")


def test_backward_dimension_numbers_match_jax_transpose_rule():
    # Cross-check the derived backward GEMMs with JAX's own VJP of lax.dot_general
    # on a random general case (batch dims in the middle, unsorted contracting dims).
    x = jax.random.normal(jax.random.key(0), (3, 5, 2, 4, 6))  # batch axis 2, contract (4, 3)
    w = jax.random.normal(jax.random.key(1), (6, 4, 7, 2))
    dims = (((4, 3), (0, 1)), ((2,), (3,)))
    g = jax.random.normal(jax.random.key(2), jax.eval_shape(
        lambda a, b: lax.dot_general(a, b, dims), x, w).shape)
    (dd, dp), (wd, wp) = backward_dimension_numbers(
        normalize_dimension_numbers(dims, x.shape, w.shape), x.ndim, w.ndim)

    @jax.jit
    def run(x, w, g):
        dx = jnp.transpose(lax.dot_general(g, w, dd.as_lax(), precision=HI), dp)
        dw = jnp.transpose(lax.dot_general(g, x, wd.as_lax(), precision=HI), wp)
        _, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims, precision=HI), x, w)
        return (dx, dw), vjp(g)

    (dx, dw), (rx, rw) = run(x, w, g)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(rx))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(rw))
