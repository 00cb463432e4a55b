"""The emulated GEMM's two forms: CPU bit-identical to before, accelerator form exact.

* CPU: ``mxjax.dot_general`` (forward, dgrad, wgrad) equals, bit for bit, the
  composition the interceptor used before it had per-platform forms (Hadamard ->
  ``fake_quantize`` -> f32 ``dot_general`` at HIGHEST), written out here.
* Accelerator form (run on CPU by calling it directly): the same GEMM from bf16
  operands with per-tensor factors applied to the f32 result.
* The bf16-exactness claims of docs/NUMERICS.md, checked against ml_dtypes on
  every element value times every scale.
"""

from __future__ import annotations

import functools
import importlib

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import mxjax
from mxjax import formats as F
from mxjax import policies
from mxjax.quantization import fake_quantize_parts
from mxjax.scaling import SR_UNSCALE

dg = importlib.import_module("mxjax.emulation.forms")
ops = importlib.import_module("mxjax.operands")
dims_mod = importlib.import_module("mxjax.dimensions")

M, K, N = 24, 96, 40  # K = 3 MX blocks, 6 H16 blocks, 6 NVFP4 blocks


def _adversarial(rng, shape, exp, amax, dtype=jnp.bfloat16):
    """Normal values times 2^exp, a zero row, grid points and midpoints, |x| max = amax*2^exp.

    The magnitude is per tensor (not per row), so each contraction's partial sums
    stay exact in f32 and the comparison does not hinge on summation order; an
    amax of 448 / 57344 / 2688 (FP8 E4M3 / E5M2 max, 6 * 448) times 2^exp makes
    the per-tensor scales powers of two.
    """
    x = np.clip(rng.standard_normal(shape), -3.0, 3.0).astype(np.float32)
    x[1] = 0.0
    x[2, :8] = [0.25, 0.75, 1.25, 2.5, -5.0, 3.5, -0.75, 6.0]
    x[3, 3] = -amax
    return jnp.asarray(x * np.float32(2.0**exp), dtype)


def _main_xla_gemm(a3, b3, recipe, key):
    """mxjax's `_xla_gemm` in its earlier form (one barrier per operand pair)."""
    k_lhs, k_rhs, k_had = jax.random.split(key, 3) if key is not None else (None,) * 3
    had = recipe.hadamard
    if had is not None:
        pad = (-a3.shape[-1]) % had.block_size
        if pad:
            widths = [(0, 0)] * (a3.ndim - 1) + [(0, pad)]
            a3, b3 = jnp.pad(a3, widths), jnp.pad(b3, widths)
        if had.randomized:
            signs = mxjax.random_signs(k_had, had.block_size)
        elif had.seed is not None:
            signs = mxjax.fixed_signs(had.seed, had.block_size)
        else:
            signs = None
        a3, b3 = lax.optimization_barrier(
            (mxjax.hadamard(a3, had.block_size, axis=-1, signs=signs),
             mxjax.hadamard(b3, had.block_size, axis=-1, signs=signs)))

    def q(v, op, k):
        return mxjax.fake_quantize(v, op.fmt, axis=-1, scale_rule=op.scale_rule,
                                   rounding=op.rounding, key=k if op.needs_key else None,
                                   sr_prescale=op.sr_prescale)

    aq, bq = lax.optimization_barrier((q(a3, recipe.lhs, k_lhs), q(b3, recipe.rhs, k_rhs)))
    nb = a3.ndim - 2
    return lax.dot_general(aq, bq, (((nb + 1,), (nb + 1,)), (tuple(range(nb)),) * 2),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _main_gemm(a, b, dims, recipe, key, out_dtype):
    (ca, cb), (ba, bb) = dims
    out = _main_xla_gemm(ops._to_canonical(a, ba, ca), ops._to_canonical(b, bb, cb), recipe, key)
    fa = [a.shape[i] for i in range(a.ndim) if i not in ca + ba]
    fb = [b.shape[i] for i in range(b.ndim) if i not in cb + bb]
    return out.reshape(tuple(a.shape[i] for i in ba) + tuple(fa) + tuple(fb)).astype(out_dtype)


def _reference_vjp(policy, key, x, w, dims, g):
    """(y, dx, dw) the earlier way (same dimension numbers, keys and casts)."""
    kf, kd, kw = jax.random.split(key, 3) if key is not None else (None,) * 3
    dims = dims_mod.Dims(*dims)
    (d_dims, d_perm), (w_dims, w_perm) = dims_mod.backward_dimension_numbers(dims, x.ndim, w.ndim)
    y = _main_gemm(x, w, dims, policy.fprop, kf, x.dtype)
    dx = jnp.transpose(_main_gemm(g, w, d_dims, policy.dgrad, kd, x.dtype), d_perm)
    dw = jnp.transpose(_main_gemm(g, x, w_dims, policy.wgrad, kw, x.dtype), w_perm)
    return y, dx, dw


DIMS = (((1,), (0,)), ((), ()))


@functools.cache
def _vjp_all(names):
    """One jitted program: {preset: ((y, dx, dw), the same the earlier way)}."""
    @jax.jit
    def run(x, w, g, key):
        out = {}
        for name in names:
            policy = policies.get(name)
            k = key if policy.needs_key else None
            y, pull = jax.vjp(lambda a, b, p=policy, k=k: mxjax.dot_general(
                a, b, DIMS, policy=p, key=k), x, w)
            out[name] = ((y, *pull(g)), _reference_vjp(policy, k, x, w, DIMS, g))
        return out
    return run


# Every scaling scheme with the rotation in the default run; mxfp4_all (the same MX path
# as mxfp4_all_h16 without the rotation, and bit for bit against the hand-written
# reference on every layout in test_dot_general) in make test-slow.
@pytest.mark.parametrize("names", [("mxfp4_all_h16", "nvfp4", "fp8"),
                                   pytest.param(("mxfp4_all",), marks=pytest.mark.slow)],
                         ids=lambda n: "-".join(n))
@pytest.mark.parametrize("amax", [448.0, 57344.0, 2688.0])
def test_cpu_results_bit_identical_to_the_previous_emulation(amax, names, np_rng):
    x = _adversarial(np_rng, (M, K), -30, amax)
    w = _adversarial(np_rng, (N, K), 20, amax).T
    g = _adversarial(np_rng, (M, N), 35, amax)
    for name, (got, want) in _vjp_all(names)(x, w, g, jax.random.key(7)).items():
        assert all(np.isfinite(np.asarray(v, np.float32)).all() for v in got), name
        assert all(np.any(np.asarray(v) != 0) for v in got), name
        chex.assert_trees_all_equal(got, want, custom_message=name)


FORMATS = (F.MXFP4, F.MXFP8_E4M3, F.MXFP8_E5M2, F.NVFP4, F.FP8_E4M3, F.FP8_E5M2)


@pytest.mark.parametrize("prescale", [False, True])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_fake_quantize_parts_recombine_to_fake_quantize(fmt, prescale, np_rng):
    x = np.array(_adversarial(np_rng, (6, 64), 0, 6.0, jnp.float32))
    x[3, 5] = 1e-40  # f32 subnormal
    x[4, :3] = [3e38, -3.4e38, 1.7e38]
    xs = [x, x.copy()]
    xs[1][5, 7] = np.nan  # a non-finite block (MX) / tensor (NVFP4, FP8)
    kw = {"axis": -1, "sr_prescale": prescale}
    if prescale:  # the 3/4 pre-scale goes with stochastic rounding only
        kw |= {"rounding": mxjax.Rounding.STOCHASTIC, "key": jax.random.key(3)}
    parts = jax.jit(lambda a: fake_quantize_parts(a, fmt, **kw))
    whole = jax.jit(lambda a: mxjax.fake_quantize(a, fmt, **kw))
    for v in xs:
        values, t = parts(v)
        want = whole(v)
        got = values if t is None else values * t
        got = got * jnp.float32(SR_UNSCALE) if prescale else got
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert (t is None) == (not fmt.tensor_scale)


@pytest.mark.parametrize("rule", ["even", "ceil", "rceil"])
def test_fake_quantize_parts_caps_the_scale_by_the_input_dtype(rule):
    # fp16 60000 under EVEN/CEIL/RCEIL: the scale exponent is capped so that the
    # value stays finite in fp16 (49152), in the parts as in fake_quantize.
    x = jnp.asarray(np.array([[60000.0] + [1.0] * 31]), jnp.float16)
    values, t = fake_quantize_parts(x, F.MXFP4, scale_rule=rule)
    want = mxjax.fake_quantize(x, F.MXFP4, scale_rule=rule)
    assert t is None
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float16)), np.asarray(want))
    assert float(values[0, 0]) == 49152.0


def _scaled_grid(fmt):
    """Every |value| fake_quantize_parts can produce for `fmt` (f64, exact), finite in f32."""
    np_elem = {"e2m1": ml_dtypes.float4_e2m1fn, "e4m3": ml_dtypes.float8_e4m3fn,
               "e5m2": ml_dtypes.float8_e5m2}[fmt.element.name]
    codes = np.arange(2 ** fmt.element.bits, dtype=np.uint8)
    grid = np.abs(codes.view(np_elem).astype(np.float64))
    grid = np.unique(grid[np.isfinite(grid)])
    if fmt.scale == "e8m0":
        scales = np.exp2(np.arange(-127, 128, dtype=np.float64))
    elif fmt.scale == "e4m3":
        s = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        scales = np.unique(np.abs(s[np.isfinite(s)]))
    else:
        scales = np.ones(1)
    vals = np.unique(np.outer(grid, scales).ravel())
    return vals[vals <= np.finfo(np.float32).max]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_bf16_exactness_claims_against_ml_dtypes(fmt):
    """OperandRange's claims (and so the bf16-vs-f32 choice) hold value by value."""
    vals = _scaled_grid(fmt)
    assert (vals.astype(np.float32).astype(np.float64) == vals).all()  # f32 holds them all
    as_bf16 = vals.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    rng = dg.operand_range(mxjax.OperandRecipe(fmt=fmt))
    nonzero = vals[vals > 0]
    assert np.log2(nonzero.min()) == rng.min_exp
    assert (as_bf16 == vals).all() == rng.bf16_exact
    tiny = nonzero < 2.0**-126
    assert (not tiny.any()) == rng.bf16_normal
    recipe = mxjax.GemmRecipe(lhs=mxjax.OperandRecipe(fmt=fmt), rhs=mxjax.OperandRecipe(fmt=fmt))
    want = jnp.bfloat16 if rng.bf16_exact else jnp.float32
    assert dg.accelerator_operand_dtype(recipe) == want


def test_decisions_per_format():
    """The documented table: bf16 for MXFP4 (subnormals possible), NVFP4, FP8; f32 for MXFP8."""
    decided = {f.name: dg.operand_range(mxjax.OperandRecipe(fmt=f)) for f in FORMATS}
    assert {n: (r.bf16_exact, r.bf16_normal) for n, r in decided.items()} == {
        "mxfp4": (True, False), "mxfp8_e4m3": (False, False), "mxfp8_e5m2": (False, False),
        "nvfp4": (True, True), "fp8_e4m3": (True, True), "fp8_e5m2": (True, True)}
    bf16_op = mxjax.OperandRecipe(fmt=F.BF16)
    mixed = mxjax.GemmRecipe(lhs=bf16_op, rhs=mxjax.OperandRecipe(fmt=F.MXFP4))
    assert dg.accelerator_operand_dtype(mixed) == jnp.float32


@pytest.mark.parametrize("name", ["mxfp4_all_h16", "mxfp4_all", "nvfp4", "fp8"])
def test_accelerator_form_computes_the_same_gemm(name, np_rng):
    """`_accelerator_form` (bf16 operands, factors on the result) vs the CPU form, run here.

    MX: operands quantized in place (mxjax.emulation.in_place), the same exact products,
    summed in f32; with these magnitudes every partial sum is exact, so the results
    are equal bit for bit. NVFP4/FP8 (canonical operands, `_accelerator_gemm`): the
    tensor scales move from each operand to the result, so the two differ by
    rounding only: within 4 ulp(f32) of sum |a_k b_k| times the scales.
    """
    recipe = policies.get(name).fprop
    a = jnp.asarray(np_rng.standard_normal((M, K)), jnp.float32)
    b = jnp.asarray(np_rng.standard_normal((K, N)), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    keys = (jax.random.key(1), jax.random.key(2), None) if recipe.needs_key else (None,) * 3
    acc = jax.jit(lambda a, b: dg._accelerator_form(a, b, dims, recipe, *keys, form="gpu"))(a, b)
    cpu = jax.jit(lambda a, b: dg._canonical_cpu_form(a, b, dims, recipe, *keys))(a, b)
    if recipe.lhs.fmt.scale == "e8m0":
        chex.assert_trees_all_equal(acc, cpu)
        return
    a3, b3 = jax.jit(lambda a, b: ops.rotate(*ops.canonical_operands(a, b, dims), recipe, None))(
        a, b)
    qa, qb = jax.jit(lambda a, b: (dg._prepare_operand(a, recipe.lhs, keys[0]),
                                   dg._prepare_operand(b, recipe.rhs, keys[1])))(a3, b3)
    bound = 4 * 2.0**-23 * np.abs(np.asarray(qa, np.float64)) @ np.abs(np.asarray(qb, np.float64)).T
    assert (np.abs(np.asarray(acc, np.float64) - np.asarray(cpu, np.float64)) <= bound).all()
    assert not np.array_equal(np.asarray(acc), np.zeros_like(acc))
