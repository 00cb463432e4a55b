"""The emulated GEMM's GPU/TPU form (mxjax.emulation.in_place), run here on CPU.

* In-place MX operand values equal the numpy reference quantizer (tests/reference.py)
  applied to the rotated operand along its own contraction axis, and equal the CPU
  form's canonical values (``fake_quantize_parts`` of the canonical operand), bit for
  bit: every scale rule, every rounding (stochastic rounding with the CPU form's
  uniforms), Hadamard sizes, input dtypes, contraction axes anywhere (merged,
  transposed, with batch axes), sizes not divisible by 32 or by h, ties, saturation,
  zero blocks, NaN and Inf blocks.
* The bit-view butterflies equal the flat ones and an independent float32 numpy
  butterfly, bit for bit.
* The TPU kernel (Pallas interpreter) gives the GPU form's values.
* The power-of-two scalings by f32 multiplies are exact in IEEE float32 (numpy keeps
  subnormals, as GPUs do); where XLA:CPU flushes subnormals only tiny blocks differ.
"""

from __future__ import annotations

import importlib
import itertools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mxjax
from mxjax import rotation
from mxjax.dimensions import Dims
from mxjax.emulation import in_place, in_place_values
from mxjax.quantization import fake_quantize_parts_with, quantize_with
from mxjax.scaling import SR_UNSCALE
from tests import reference as ref

dg = importlib.import_module("mxjax.emulation.forms")
ops = importlib.import_module("mxjax.operands")

# (shape, batch axes, contracting axes): contraction last, first, in the middle with
# batch axes, two adjacent axes, two axes out of order (a transpose), K not a multiple
# of 32 (or of h).
LAYOUTS = (
    ((8, 96), (), (1,)),
    ((96, 8), (), (0,)),
    ((2, 3, 40, 5), (0,), (2,)),
    ((4, 6, 24), (), (0, 1)),
    ((6, 5, 7), (), (2, 0)),
    ((3, 20), (), (1,)),
)


def _adversarial(rng, shape, dtype=np.float32, exp=0):
    """Normal values, grid points and midpoints (after the scale), saturating values,
    a zero block, one NaN and one Inf (in different blocks of the flat layout)."""
    x = np.clip(rng.standard_normal(shape), -3.0, 3.0).astype(np.float32)
    flat = x.reshape(-1)
    flat[:8] = [0.25, 0.75, 1.25, 2.5, -5.0, 3.5, -0.75, 6.0]
    flat[8:16] = [-6.0, 7.0, 1e4, -3e4, 0.5, 1.75, -2.25, 3.0]
    flat[64:128] = 0.0
    if flat.size > 400:
        flat[300] = np.nan
        flat[400] = np.inf
    return (x * np.float32(2.0**exp)).astype(dtype)


def _canonical_values(x, batch, contract, op, h, signs, key):
    """The CPU form's operand values: canonical layout [batch..., F, K_h]."""
    x3 = ops._to_canonical(x, batch, contract)
    if h is not None:
        pad = (-x3.shape[-1]) % h
        if pad:
            x3 = jnp.pad(x3, [(0, 0)] * (x3.ndim - 1) + [(0, pad)])
        x3 = mxjax.hadamard(x3, h, axis=-1, signs=signs)
    values, _ = fake_quantize_parts_with(x3, op, -1, key=key)
    return values


def _in_place_values(x, batch, contract, op, h, signs, key, form="gpu"):
    view = in_place.contraction_view(x, batch, contract)
    k = view.x.shape[view.axis]
    kw = {"k_out": k if h is None else -(-k // h) * h, "hadamard_size": h, "signs": signs,
          "key": key}
    if form == "tpu":
        return in_place.mx_operand_values_tpu(view, op, interpret=True, **kw), view
    return in_place.mx_operand_values(view, op, **kw), view


def _to_canonical_layout(v, view, batch, contract, x_shape):
    """In-place values (view layout) moved to the canonical [batch..., F, K] layout."""
    v = np.moveaxis(np.asarray(v.astype(jnp.float32)), view.axis, -1)
    kept = [i for i in range(len(x_shape)) if i not in contract]
    order = [kept.index(i) for i in tuple(batch) + tuple(
        i for i in kept if i not in batch)]
    v = np.transpose(v, order + [v.ndim - 1])
    nb = len(batch)
    return v.reshape(v.shape[:nb] + (-1, v.shape[-1]))


CASES = [  # (recipe kwargs, hadamard size, signs seed, input dtype)
    ({"scale_rule": "even"}, 16, None, ml_dtypes.bfloat16),
    ({"scale_rule": "floor"}, None, None, np.float16),
    ({"scale_rule": "ceil", "rounding": "nearest_away"}, 32, 3, np.float32),
    ({"scale_rule": "rceil", "rounding": "toward_zero"}, 64, None, ml_dtypes.bfloat16),
    ({"scale_rule": "even", "rounding": "stochastic"}, 16, 1, np.float32),
    ({"scale_rule": "floor", "rounding": "stochastic", "sr_prescale": True}, None, None,
     ml_dtypes.bfloat16),
]


def _all_layouts(xs, op, h, signs, key):
    """(in-place values, CPU-form values, rotated canonical operand) for every layout."""
    out = []
    for x, (_, batch, contract) in zip(xs, LAYOUTS):
        got, _ = _in_place_values(x, batch, contract, op, h, signs, key)
        want = _canonical_values(x, batch, contract, op, h, signs, key)
        x3 = ops._to_canonical(x, batch, contract)
        if h is not None:
            x3 = jnp.pad(x3, [(0, 0)] * (x3.ndim - 1) + [(0, (-x3.shape[-1]) % h)])
            x3 = mxjax.hadamard(x3, h, axis=-1, signs=signs)
        out.append((got, want, x3))
    return out


# One case in the default run (RNE with H16 from bf16, every layout); the other rules,
# roundings (stochastic rounding with signs), sizes and dtypes under `make test-slow`.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("case", [0] + [pytest.param(c, marks=_SLOW) for c in (1, 2, 3, 4, 5)])
def test_in_place_values_equal_the_cpu_form_and_the_reference(case, np_rng):
    kw, h, seed, dtype = CASES[case]
    op = mxjax.OperandRecipe(fmt=mxjax.MXFP4, **kw)
    signs = None if seed is None else mxjax.fixed_signs(seed, h)
    key = jax.random.key(11) if op.needs_key else None
    xs = [jnp.asarray(_adversarial(np_rng, shape, dtype)) for shape, _, _ in LAYOUTS]
    results = jax.jit(lambda xs: _all_layouts(xs, op, h, signs, key))(xs)
    for (shape, batch, contract), (got, want, x3) in zip(LAYOUTS, results):
        view = in_place.contraction_view(np.zeros(shape, np.float32), batch, contract)
        assert got.dtype == jnp.bfloat16
        got_c = _to_canonical_layout(got, view, batch, contract, shape)
        np.testing.assert_array_equal(got_c, np.asarray(want), err_msg=f"{shape} {contract}")
        if op.rounding is mxjax.Rounding.STOCHASTIC:
            continue  # the reference is given no uniforms; the CPU form's are the contract
        expect = ref.fake_quantize(np.asarray(x3), "mxfp4", axis=-1,
                                   scale_rule=op.scale_rule.value, rounding=op.rounding.value)
        np.testing.assert_array_equal(got_c, expect, err_msg=f"{shape} {contract}")


def _np_butterfly(x: np.ndarray, h: int, signs) -> np.ndarray:
    """float32 numpy fast Walsh-Hadamard along the last axis (lower a + b, upper a - b)."""
    xb = x.reshape(x.shape[:-1] + (x.shape[-1] // h, h)).astype(np.float32)
    if signs is not None:
        xb = xb * np.asarray(signs, np.float32)
    s = 1
    while s < h:
        v = xb.reshape(xb.shape[:-1] + (h // (2 * s), 2, s))
        a, b = v[..., 0, :], v[..., 1, :]
        xb = np.stack([a + b, a - b], axis=-2).reshape(xb.shape)
        s *= 2
    return (xb * np.float32(1.0 / np.sqrt(h))).reshape(x.shape)


@pytest.mark.parametrize("h", rotation.HADAMARD_SIZES)
def test_bit_view_butterflies_equal_flat_and_numpy(h, np_rng):
    x = (np_rng.standard_normal((3, 2 * h)) * np.exp2(np_rng.integers(-60, 60, (3, 2 * h))))
    x = x.astype(np.float32)
    x[0, :3] = [-0.0, 0.0, -0.0]
    x[1, 5] = np.inf
    x[2, 7] = np.nan
    for signs in (None, np.asarray(mxjax.fixed_signs(h, h))):
        args = (jnp.asarray(x),) if signs is None else (jnp.asarray(x), jnp.asarray(signs))
        flat = jax.jit(lambda *a: rotation._hadamard_last(
            *a, h=h, stages_per_pass=rotation.CPU_STAGES_PER_PASS))(*args)
        bits = jax.jit(lambda *a: rotation._hadamard_last(*a, h=h))(*args)
        with np.errstate(invalid="ignore"):
            want = _np_butterfly(x, h, signs)
        for got in (np.asarray(bits), np.asarray(flat)):
            keep = ~np.isnan(want)  # a NaN's sign and payload are the hardware's
            np.testing.assert_array_equal(np.isnan(got), ~keep)
            np.testing.assert_array_equal(got[keep].view(np.uint32), want[keep].view(np.uint32))


def test_bit_view_rejects_bad_layouts():
    with pytest.raises(ValueError, match="multiple of 2"):
        rotation.bit_view(jnp.zeros((3, 24)), 1, 4)
    with pytest.raises(ValueError, match="bit axes"):
        rotation.hadamard_bit_view(jnp.zeros((3, 2, 2)), 16, 2)
    with pytest.raises(ValueError, match="signs"):
        rotation.hadamard_bit_view(jnp.zeros((1, 2, 2, 2, 2)), 16, 4, signs=jnp.ones(8))


TPU_LAYOUTS = (((128, 256), (), (1,)), ((2, 64, 128), (0,), (1,)), ((64, 128), (), (0,)))


# The kernel's round-to-nearest-even (the rotation's 1/sqrt(h) folded into its multiply)
# with H16, with no rotation and with H32 (1/sqrt(32) is not a power of two); the other
# roundings (scaled first, `values_from_amax`) with H32 and signs, and SR.
TPU_CASES = [CASES[0], CASES[1][:3] + (None,), ({"scale_rule": "rceil"}, 32, 2, None),
             pytest.param(CASES[2], marks=_SLOW), pytest.param(CASES[4], marks=_SLOW)]


@pytest.mark.parametrize("case", TPU_CASES, ids=lambda c: f"{c[0]}-h{c[1]}-signs{c[2]}")
def test_tpu_kernel_values_equal_the_gpu_form(case, np_rng):
    kw, h, seed, _ = case
    op = mxjax.OperandRecipe(fmt=mxjax.MXFP4, **kw)
    signs = None if seed is None else mxjax.fixed_signs(seed, h)
    key = jax.random.key(5) if op.needs_key else None
    from mxjax.emulation import in_place_tpu

    xs = [jnp.asarray(_adversarial(np_rng, shape, ml_dtypes.bfloat16))
          for shape, _, _ in TPU_LAYOUTS]

    def both(xs):
        return [(_in_place_values(x, batch, contract, op, h, signs, key, "tpu")[0],
                 _in_place_values(x, batch, contract, op, h, signs, key)[0])
                for x, (_, batch, contract) in zip(xs, TPU_LAYOUTS)]

    with in_place_tpu.record_kernels() as specs:
        results = jax.jit(both)(xs)
    # every operand tiled into the kernel (none took the fallback), with this rotation
    assert len(specs) == len(TPU_LAYOUTS)
    assert all(s.hadamard_size == h and s.has_signs == (signs is not None) for s in specs)
    for tpu, gpu in results:
        chex.assert_trees_all_equal(tpu, gpu)


def test_tpu_form_falls_back_when_the_operand_does_not_tile(np_rng):
    from mxjax.emulation import in_place_tpu

    op = mxjax.OperandRecipe(fmt=mxjax.MXFP4, scale_rule="even")
    x = jnp.asarray(_adversarial(np_rng, (8, 96), ml_dtypes.bfloat16))
    with in_place_tpu.record_kernels() as specs:
        tpu, gpu = jax.jit(lambda v: (_in_place_values(v, (), (1,), op, 16, None, None, "tpu")[0],
                                      _in_place_values(v, (), (1,), op, 16, None, None)[0]))(x)
    assert specs == []
    chex.assert_trees_all_equal(tpu, gpu)


def test_power_of_two_scalings_are_exact_in_ieee_float32():
    """The f32 multiplies of values_from_amax against exact ldexp, in numpy (IEEE, with
    subnormals, like GPU f32 units): every E2M1/E4M3/E5M2 grid value times 2^s for
    every E8M0 exponent s the quantizer can pick, and the down-scaling r * 2^-s of
    values from 2^-149 up (a subnormal result is flushed to zero there, and rounds to
    zero on every element grid)."""
    from mxjax.formats import E2M1, E4M3, E5M2
    from mxjax.scaling import max_scale_exponent

    for elem, (n, dtype) in ((E2M1, (16, ml_dtypes.float4_e2m1fn)),
                             (E4M3, (256, ml_dtypes.float8_e4m3fn)),
                             (E5M2, (256, ml_dtypes.float8_e5m2))):
        grid = np.abs(np.arange(n, dtype=np.uint8).view(dtype).astype(np.float64))
        q = np.unique(grid[np.isfinite(grid)]).astype(np.float32)
        for s in range(-127, max_scale_exponent(jnp.float32, elem, False) + 1):
            half = np.float32(0.5 if s < -126 else 1.0)
            got = (q * half) * np.float32(2.0 ** max(s, -126))
            np.testing.assert_array_equal(got.astype(np.float64),
                                          np.ldexp(q.astype(np.float64), s),
                                          err_msg=f"{elem.name} {s}")
    r = np.concatenate([np.float32(2.0**-149) * np.arange(1, 64, dtype=np.float32),
                        np.geomspace(1e-38, 1e38, 2000).astype(np.float32)])
    for s in range(-127, 126):
        with np.errstate(over="ignore"):
            y = r * np.float32(2.0**-s)
        exact = np.ldexp(r.astype(np.float64), -s)
        normal = (exact >= 2.0**-126) & (exact <= np.finfo(np.float32).max)
        np.testing.assert_array_equal(y[normal].astype(np.float64), exact[normal])


def test_tiny_blocks_are_the_only_difference_under_flush_to_zero(np_rng):
    """Run here (XLA:CPU flushes subnormals) the f32 multiplies lose blocks whose values
    are f32 subnormals; every other block is exact (docs/NUMERICS.md)."""
    op = mxjax.OperandRecipe(fmt=mxjax.MXFP4, scale_rule="even")
    x = _adversarial(np_rng, (4, 64))
    x[3, :32] *= np.float32(2.0**-127)  # f32 subnormal inputs: scale 2^-127, subnormal values
    got = jax.jit(lambda v: _in_place_values(v, (), (1,), op, None, None, None)[0])(
        jnp.asarray(x))
    want = ref.fake_quantize(x, "mxfp4", axis=-1, scale_rule="even")
    got = np.asarray(got.astype(jnp.float32))
    tiny = np.zeros_like(x, bool)
    tiny[3, :32] = True
    np.testing.assert_array_equal(got[~tiny], want[~tiny])
    assert np.any(want[tiny] != 0) and np.all(np.abs(want[tiny]) < 2.0**-120)


def test_contraction_view_transposes_only_out_of_order_axes():
    for shape, batch, contract in LAYOUTS:
        jaxpr = jax.make_jaxpr(lambda v, b=batch, c=contract: in_place.contraction_view(
            v, b, c).x)(jnp.zeros(shape))
        names = {e.primitive.name for e in jaxpr.jaxpr.eqns}
        adjacent = contract == tuple(range(contract[0], contract[0] + len(contract)))
        assert ("transpose" in names) == (not adjacent), (shape, contract, names)


GEMM_SHAPES = (((24, 96), (96, 40), (((1,), (0,)), ((), ()))),
               ((2, 5, 64), (2, 64, 3), (((2,), (1,)), ((0,), (0,)))))


def _both_forms(a, b, dims, recipe, key):
    """(accelerator form, f32 GEMM of the CPU form's operand values times the unscales)."""
    k_lhs, k_rhs, k_had = ops.split_key(key if recipe.needs_key else None)
    acc = dg._accelerator_form(a, b, dims, recipe, k_lhs, k_rhs, k_had, form="gpu")
    h = None if recipe.hadamard is None else recipe.hadamard.block_size
    signs = None if recipe.hadamard is None else ops.rotation_signs(recipe.hadamard, k_had)
    (ca, cb), (ba, bb) = dims
    va = _canonical_values(a, ba, ca, recipe.lhs, h, signs, k_lhs)
    vb = _canonical_values(b, bb, cb, recipe.rhs, h, signs, k_rhs)
    out = jax.lax.dot_general(va, vb, dg.canonical_dimension_numbers(va.ndim - 2),
                              precision=jax.lax.Precision.HIGHEST)
    for op in (recipe.lhs, recipe.rhs):
        if op.sr_prescale:
            out = out * jnp.float32(SR_UNSCALE)
    return acc, out


@pytest.mark.parametrize("name", ["mxfp4_all_h16"] + [
    pytest.param(n, marks=_SLOW) for n in ("mxfp4_all_sr", "tseng")])
def test_accelerator_gemm_contracts_the_cpu_forms_values(name, np_rng):
    """All three GEMMs of a policy in the accelerator form (run here) equal the f32 GEMM
    of the CPU form's operand values times the SR 3/4 unscales: the same products,
    and at these magnitudes every partial sum is exact, so summation order cannot show."""
    policy = mxjax.policies.get(name)
    key = jax.random.key(2) if policy.needs_key else None
    cases = [(getattr(policy, g), s) for g, s in itertools.product(
        ("fprop", "dgrad", "wgrad"), GEMM_SHAPES) if not getattr(policy, g).is_passthrough]
    operands = [tuple(jnp.asarray(np.clip(np_rng.standard_normal(s), -3, 3).astype(
        ml_dtypes.bfloat16)) for s in shapes[:2]) for _, shapes in cases]

    def run(operands):
        return [_both_forms(a, b, shapes[2], recipe, key)
                for (a, b), (recipe, shapes) in zip(operands, cases)]

    for acc, cpu in jax.jit(run)(operands):
        chex.assert_trees_all_equal(acc, cpu)


def _blocks_at_every_scale(rng, elem_max: float) -> np.ndarray:
    """[nb, 32] f32 blocks at block exponents -100..127: normal values, the block's grid
    points and midpoints (ties), values past saturation, the f32 top binade (scales above
    2^64 take the rescaled path), a zero block, a NaN block and an Inf block."""
    exps = np.arange(-100, 128)
    x = np.clip(rng.standard_normal((exps.size, 32)), -3, 3) * np.exp2(exps)[:, None]
    step = np.exp2(exps - 2.0)[:, None]  # ~ an E2M1 grid step at the block's scale
    x[:, :4] = np.array([0.5, 1.5, 2.5, 3.5]) * step  # ties on the coarsest grids
    x[:, 4] = 2 * elem_max * np.exp2(exps - 2.0)  # saturates
    with np.errstate(over="ignore"):
        x = x.astype(np.float32)
    x[~np.isfinite(x)] = np.float32(3.0e38)
    x = np.concatenate([x, np.zeros((1, 32), np.float32), x[:2].copy(), x[:1].copy()])
    x[-3, 7], x[-2, 3], x[-1, 9] = 0.0, np.nan, -np.inf
    return x


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"])
@pytest.mark.parametrize("prescale", [1.0, 0.25, float(np.float32(1 / np.sqrt(32)))])
def test_nearest_even_values_equal_the_reference(fmt, prescale, np_rng):
    """`nearest_even_values` (the TPU kernel's rounding in place) against the numpy
    reference quantizer of ``x * prescale``, bit for bit: every scale rule, block scales
    2^-100 to the top (those above 2^64 rescaled), ties, saturation, zero/NaN/Inf blocks;
    with and without jit; and against `values_from_amax`."""
    fmt_obj = {"mxfp4": mxjax.MXFP4, "mxfp8_e4m3": mxjax.MXFP8_E4M3,
               "mxfp8_e5m2": mxjax.MXFP8_E5M2}[fmt]
    x = _blocks_at_every_scale(np_rng, fmt_obj.element.max_normal)
    pre = np.float32(prescale)
    with np.errstate(over="ignore", invalid="ignore"):
        y = x * pre
    for rule in ("even", "floor", "ceil", "rceil"):
        op = mxjax.OperandRecipe(fmt=fmt_obj, scale_rule=rule)
        want = ref.fake_quantize(y, fmt, axis=-1, scale_rule=rule)

        def values(v, op=op):
            amax = jnp.max(in_place_values._bits.f32_bits(v) & 0x7FFFFFFF, axis=-1,
                           keepdims=True)
            scaled = in_place_values._bits.f32_bits(
                in_place_values._bits.bits_f32(amax) * jnp.float32(pre))
            return in_place_values.nearest_even_values(v, scaled, op, prescale=prescale)

        for fn in (values, jax.jit(values)):
            got = np.asarray(fn(jnp.asarray(x)))
            np.testing.assert_array_equal(got, want, err_msg=f"{fmt} {rule}")
            finite = np.isfinite(want)
            np.testing.assert_array_equal(got[finite].view(np.uint32),
                                          want[finite].view(np.uint32))
        amax = jnp.max(in_place_values._bits.f32_bits(jnp.asarray(y)) & 0x7FFFFFFF,
                       axis=-1, keepdims=True)
        old = in_place_values.values_from_amax(jnp.asarray(y), amax, op, None)
        chex.assert_trees_all_equal(values(jnp.asarray(x)), old)


def test_nearest_even_values_rejects_other_roundings():
    op = mxjax.OperandRecipe(fmt=mxjax.MXFP4, scale_rule="even", rounding="toward_zero")
    with pytest.raises(ValueError, match="nearest-even"):
        in_place_values.nearest_even_values(jnp.zeros((1, 32)), jnp.zeros((1, 1), jnp.uint32),
                                               op)


# mx_gemm with its rhs given quantized (a quantized residual): the rhs's canonical operand,
# quantized as the GEMM would, read back in b's contraction view: the same dot_general.
_PACKED_CASES = [((128, 256), (256, 128), (((1,), (0,)), ((), ()))),
                 ((2, 64, 128), (2, 96, 128), (((2,), (2,)), ((0,), (0,))))]


@pytest.mark.parametrize("form", ["gpu", "tpu"])
@pytest.mark.parametrize("preset,gemm", [("mxfp4_all_h16", "wgrad"),
                                         pytest.param("mxfp4_all_sr", "dgrad", marks=_SLOW)])
def test_mx_gemm_with_the_rhs_given_quantized_is_mx_gemm(form, preset, gemm, np_rng):
    from mxjax import operands

    recipe = getattr(mxjax.policies.get(preset), gemm)
    key = jax.random.key(7) if recipe.needs_key else None

    def both(a, b, dims):
        k_lhs, k_rhs, k_had = operands.split_key(key)
        signs = operands.rotation_signs(recipe.hadamard, k_had) if recipe.hadamard else None
        want = in_place.mx_gemm(a, b, dims, recipe, k_lhs, k_rhs, signs, form=form,
                                interpret=True, operand_dtypes=(jnp.bfloat16, None))
        _, b3 = operands.rotate(*operands.canonical_operands(a, b, Dims(*dims)), recipe, k_had)
        q = quantize_with(b3, recipe.rhs, -1, key=k_rhs)
        return want, in_place.mx_gemm_packed_rhs(a, q, b.shape, dims, recipe, k_lhs, signs,
                                                 form=form, interpret=True,
                                                 operand_dtype=jnp.bfloat16)

    for shape_a, shape_b, dims in _PACKED_CASES:
        a = jnp.asarray(_adversarial(np_rng, shape_a, np.float32))
        b = jnp.asarray(_adversarial(np_rng, shape_b, ml_dtypes.bfloat16))
        want, got = jax.jit(both, static_argnums=2)(a, b, dims)
        chex.assert_trees_all_equal(want, got)


# --------------------------------------------------------------------------- row chunks
_CHUNK_LAYOUTS = {
    # lhs, rhs, dims; the larger operand's largest free axis is the one cut
    "xw": ((3, 40, 96), (96, 24), (((2,), (0,)), ((), ()))),  # a's axis 1 (40 rows)
    "batched": ((2, 36, 64), (2, 64, 8), (((2,), (1,)), ((0,), (0,)))),
    "lhs_transposed": ((64, 30), (64, 12), (((0,), (0,)), ((), ()))),  # free axis after K
    "rhs_larger": ((6, 64), (2, 64, 45), (((1,), (1,)), ((), ()))),  # b's axis 2
}


def _small_ints(shape, seed, scale, dtype=jnp.bfloat16):
    return jax.random.randint(jax.random.key(seed), shape, -8, 9).astype(dtype) * scale


# 7 divides none of the axes: the largest divisor is taken. Two cases in the default run.
_PIECES = [(layout, chunks) if (layout, chunks) in {("xw", 4), ("rhs_larger", 7)}
           else pytest.param(layout, chunks, marks=_SLOW)
           for layout in sorted(_CHUNK_LAYOUTS) for chunks in (4, 7)]


@pytest.mark.parametrize("layout,chunks", _PIECES)
def test_mx_gemm_in_pieces_is_the_whole_gemm(layout, chunks):
    """Small integers: every summation order gives the exact sum, so the GEMM computed on
    pieces of its larger operand (quantized piece by piece, H16 along K) must give the whole
    GEMM's bits, cast to bf16 (jit and eager)."""
    sa, sb, dims = _CHUNK_LAYOUTS[layout]
    a, b = _small_ints(sa, 1, 0.5, jnp.float32), _small_ints(sb, 2, 0.25)
    recipe = mxjax.policies.get("mxfp4_all_h16").fprop
    signs = mxjax.fixed_signs(0, 16)

    def gemm(a, b, chunks):
        return in_place.mx_gemm(a, b, dims, recipe, None, None, signs, out_dtype=jnp.bfloat16,
                                operand_dtypes=(jnp.bfloat16, None), row_chunks=chunks)

    whole = jax.jit(gemm, static_argnums=2)(a, b, 1)
    chex.assert_shape(whole, jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims),
                                            a, b).shape)
    chex.assert_trees_all_equal(jax.jit(gemm, static_argnums=2)(a, b, chunks), whole)
    chex.assert_trees_all_equal(gemm(a, b, chunks), whole)


def test_an_operand_with_a_rounding_key_is_never_cut():
    """Stochastic rounding draws for the whole operand: only the others are cut, the larger
    first (its loop outside)."""
    sa, sb, dims = _CHUNK_LAYOUTS["xw"]  # a is the larger; a's axis 1, b's axis 1
    a, b, key = jnp.ones(sa), jnp.ones(sb), jax.random.key(0)
    assert in_place._pieces(8, dims, (a, None), (b, None)) == [(0, 1, 8), (1, 1, 8)]
    assert in_place._pieces(8, dims, (a, key), (b, None)) == [(1, 1, 8)]
    assert in_place._pieces(8, dims, (a, key), (b, key)) == []
    assert in_place._pieces(1, dims, (a, None), (b, None)) == []


def _dots(jaxpr, depth=0):
    """(loop depth, result shape) of every dot_general in a jaxpr and its sub-jaxprs."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            out.append((depth, e.outvars[0].aval.shape))
        loop = e.primitive.name in ("while", "scan")
        for v in e.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                out += _dots(inner, depth + loop)
    return out


def test_mx_gemm_in_pieces_holds_one_piece_at_a_time():
    sa, sb, dims = _CHUNK_LAYOUTS["xw"]
    jaxpr = jax.make_jaxpr(lambda a, b: in_place.mx_gemm(
        a, b, dims, mxjax.policies.get("mxfp4_all").fprop, None, None, None,
        out_dtype=jnp.bfloat16, row_chunks=8))(jnp.ones(sa), jnp.ones(sb))
    assert jaxpr.out_avals[0].shape == (3, 40, 24)
    # two loops: 8 pieces of a's 40 rows, inside them 8 pieces of b's 24 columns
    assert _dots(jaxpr.jaxpr) == [(2, (3, 5, 3))]


@pytest.mark.parametrize("case", [
    ((8, 64), (64, 40), (((1,), (0,)), ((), ()))),  # q the larger: 5 pieces of its 40 rows
    pytest.param(((2, 4, 64), (2, 3, 5, 64), (((2,), (3,)), ((0,), (0,)))),  # batch, 2 free
                 marks=_SLOW),
    pytest.param(((48, 64), (64, 40), (((1,), (0,)), ((), ()))),  # the lhs the larger
                 marks=_SLOW),
])
def test_mx_gemm_packed_rhs_in_row_pieces_is_the_whole_dot(case):
    """Small integers: every summation order gives the exact sum, so q dequantized and
    contracted in row pieces (or the lhs quantized in pieces, when it is the larger) must
    give the whole dot's bits (bf16 result, H16, 4/3 SR unscale of the rhs)."""
    from mxjax import operands

    shape_a, shape_b, dims = case
    recipe = mxjax.GemmRecipe(
        lhs=mxjax.OperandRecipe(fmt="mxfp4", scale_rule="even"), hadamard=16,
        rhs=mxjax.OperandRecipe(fmt="mxfp4", scale_rule="even", rounding="stochastic",
                                sr_prescale=True))
    ka, kb, kq = jax.random.split(jax.random.key(3), 3)
    a = jax.random.randint(ka, shape_a, -8, 9).astype(jnp.float32)
    b = jax.random.randint(kb, shape_b, -8, 9).astype(jnp.bfloat16)
    signs = mxjax.fixed_signs(0, 16)
    _, b3 = operands.rotate(*operands.canonical_operands(a, b, Dims(*dims)), recipe, None)
    q = quantize_with(b3, recipe.rhs, -1, key=kq)

    def run(chunks):
        return jax.jit(lambda a, q: in_place.mx_gemm_packed_rhs(
            a, q, shape_b, dims, recipe, None, signs, out_dtype=jnp.bfloat16,
            row_chunks=chunks))(a, q)

    whole = run(1)
    chex.assert_shape(whole, jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims),
                                            a, b).shape)
    chex.assert_trees_all_equal(run(7), whole)
    chex.assert_trees_all_equal(run(2), whole)
