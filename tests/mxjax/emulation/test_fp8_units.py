"""FP8 GEMMs on FP8 tensor cores (mxjax/emulation/fp8_units.py), checked on this CPU machine.

* The f8 operands the CUDA form hands to the GEMM are bit-identical to an independent
  numpy / ml_dtypes quantizer (per-tensor FP8: correctly rounded ``x / t`` in f64, then
  ml_dtypes' round-to-nearest-even cast; MXFP8: tests/reference.py's codes and scale
  bytes), ties, f8 subnormals, saturation and f32-subnormal inputs included.
* The CUDA form's GEMM, run here (XLA:CPU contracts f8 operands exactly, accumulating
  in f32), is within docs/NUMERICS.md's bound of the CPU emulation and of the exact
  product of the quantized operands.
* The rounding survives: the CPU emulation's values equal the reference's rounded values
  (so no f32 -> f8 -> f32 round trip was folded away), and the program exported for
  CUDA has f8 x f8 dots for every quantized GEMM (tests/accelerators/test_fp8_gemm.py
  checks XLA's optimized GPU program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mxjax
from bench.costmodel import export_shape as es
from mxjax import OperandRecipe, ScaleRule, _bits, policies, scaling
from mxjax.dimensions import Dims
from mxjax.emulation import forms, fp8_units
from mxjax.quantization import fake_quantize_with
from mxjax.recipes import GemmRecipe
from tests import reference as ref

U32 = 2.0 ** -24  # f32 unit roundoff
FP8 = {"fp8_e4m3": (mxjax.FP8_E4M3, ml_dtypes.float8_e4m3fn, 448.0),
       "fp8_e5m2": (mxjax.FP8_E5M2, ml_dtypes.float8_e5m2, 57344.0)}


def _grid_and_midpoints(f8) -> np.ndarray:
    """Every finite f8 value and every midpoint between neighbours (the ties), both signs."""
    v = np.arange(256, dtype=np.uint8).view(f8).astype(np.float64)
    v = np.unique(v[np.isfinite(v) & (v >= 0)])
    mids = (v[1:] + v[:-1]) / 2
    out = np.concatenate([v, mids, mids * (1 + 2.0 ** -20), mids * (1 - 2.0 ** -20)])
    return np.concatenate([out, -out]).astype(np.float32)


def _cases(name: str) -> dict[str, np.ndarray]:
    fmt, f8, _ = FP8[name]
    rng = np.random.default_rng(0)
    ties = _grid_and_midpoints(f8)  # amax = max_normal: tensor scale 1, y = x exactly
    general = (rng.standard_normal(4096) * np.exp(rng.uniform(-12, 12, 4096))).astype(np.float32)
    # amax tiny: the tensor scale is the floor 2^-117 (E4M3) / 2^-110 (E5M2), and f32
    # subnormal inputs round to nonzero elements (XLA:CPU flushes subnormal operands:
    # the quantizer must not lose them).
    floor = 2.0 ** (-126 + fmt.element.mbits - fmt.element.emin)
    tiny = (np.array([1.5, 1.0, 0.75, 0.5, 0.25, 3.0, -1.5, -0.75, 0.0, -0.0], np.float64)
            * floor * 2.0 ** fmt.element.emin).astype(np.float32)
    # f32 subnormals beside normal values (tensor scale >= 2^-100): they round to signed
    # zero, also where XLA:CPU divides them as zeros.
    subnormals = np.float32([1e-40, -1e-40, 1.4e-45, -3e-39, 1.1754942e-38])
    mixed = np.concatenate([general[:64], subnormals])
    return {"ties": ties, "general": general.reshape(64, 64), "tiny": tiny, "mixed": mixed}


def _reference_f8(x: np.ndarray, name: str):
    """(f8 array, f32 tensor scale) by numpy / ml_dtypes, independently of mxjax."""
    fmt, f8, max_normal = FP8[name]
    floor = np.float32(2.0 ** (-126 + fmt.element.mbits - fmt.element.emin))
    t = ref._tensor_scale(x.astype(np.float32), np.float32(max_normal), floor)
    # f64 division then f32 rounding is the correctly rounded f32 quotient (53 >= 2*24 + 2).
    y = (x.astype(np.float64) / np.float64(t)).astype(np.float32)
    return np.clip(y, -max_normal, max_normal).astype(f8), np.float32(t)


OPERAND_CASES = ("ties", "general", "tiny", "mixed")


def check_f8_operand_bits(name: str, case: str):
    """`fp8_units.f8_operand` of an adversarial case (on the default device) against the
    numpy reference: the f8 bits, their dtype and the one factor. Returns (x, q, q_ref)."""
    fmt, f8, _ = FP8[name]
    x = _cases(name)[case]
    q, factors = jax.jit(fp8_units.f8_operand, static_argnums=1)(
        jnp.asarray(x), OperandRecipe(fmt=fmt), None)
    q_ref, t_ref = _reference_f8(x, name)
    assert q.dtype == f8
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))
    assert len(factors) == 1 and np.float32(factors[0]) == t_ref
    return x, q, q_ref


@pytest.mark.parametrize("name", sorted(FP8))
@pytest.mark.parametrize("case", OPERAND_CASES)
def test_per_tensor_f8_operands_are_the_reference_bits(name, case):
    fmt = FP8[name][0]
    x, q, q_ref = check_f8_operand_bits(name, case)
    # mxjax's element codes are the OCP f8 bits (tests/reference.py's encoder agrees).
    codes = ref.quantize(x, fmt.name).codes
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), codes)
    if case == "tiny":  # the f32-subnormal inputs did give nonzero elements
        assert np.count_nonzero(q_ref.astype(np.float32)) >= 6


def test_cpu_emulation_keeps_the_f8_rounding():
    """fake_quantize on XLA:CPU (the emulation's operands) equals the reference's rounded values."""
    for name, (fmt, _, _) in FP8.items():
        for case, x in _cases(name).items():
            got = np.asarray(jax.jit(mxjax.fake_quantize, static_argnums=1)(jnp.asarray(x), fmt))
            q_ref, t_ref = _reference_f8(x, name)
            want = (q_ref.astype(np.float32) * t_ref).astype(np.float32)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                          err_msg=f"{name} {case}")


def test_exact_div_is_correctly_rounded():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(1 << 14) * np.exp(rng.uniform(-40, 40, 1 << 14))).astype(np.float32)
    x = np.concatenate([x, np.float32([np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-42])])
    for d in (np.float32(0.0123456), np.float32(3.0), np.float32(2.0 ** -117)):
        got = np.asarray(jax.jit(_bits.exact_div)(x, d))
        with np.errstate(all="ignore"):
            want = (x.astype(np.float64) / np.float64(d)).astype(np.float32)
        normal = np.abs(want) >= 2.0 ** -126  # the contract: where the quotient is normal
        np.testing.assert_array_equal(got[normal].view(np.uint32), want[normal].view(np.uint32))


def test_cuda_tensor_division_is_correctly_rounded_where_the_grid_can_see_it():
    """The CUDA per-tensor division (one scalar rescue, no elementwise bit ops) gives the
    correctly rounded quotient wherever it is normal, for ordinary and tiny tensor scales
    (d < 2^-100 takes the 2^64 rescale); smaller quotients round to zero on every FP8 grid."""
    rng = np.random.default_rng(4)
    div = jax.jit(scaling._cuda_tensor_div)
    for d, lo, hi in ((np.float32(0.0123456), -40, 40), (np.float32(3.0), -40, 40),
                      (np.float32(2.0 ** -117), -86, -62)):
        x = (rng.standard_normal(1 << 14) * np.exp2(rng.uniform(lo, hi, 1 << 14)))
        x = np.concatenate([x.astype(np.float32), np.float32([np.inf, -np.inf, 0.0, -0.0])])
        got = np.asarray(div(x, d))
        with np.errstate(all="ignore"):
            want = (x.astype(np.float64) / np.float64(d)).astype(np.float32)
        normal = np.abs(want) >= 2.0 ** -126
        assert normal.sum() > (1 << 13), d  # the case is exercised
        np.testing.assert_array_equal(got[normal].view(np.uint32), want[normal].view(np.uint32))
    # For d >= 2^-100 a subnormal x cannot reach an FP8 grid: |x / d| < 2^-26.
    assert 2.0 ** -126 / scaling._SUBNORMALS_ROUND_TO_ZERO <= 2.0 ** -26


def test_mxfp8_operands_are_the_reference_codes_and_scale_bytes():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((2, 24, 80)) * np.exp(rng.uniform(-20, 20, (2, 24, 1))))
    x = x.astype(np.float32)
    x[0, 3, 5] = np.nan  # a NaN block: scale byte 0xFF
    x[1, 4, :] = 0.0  # all-zero blocks: scale byte 127
    op = OperandRecipe(fmt=mxjax.MXFP8_E4M3, scale_rule=ScaleRule.RCEIL)
    elems, scales = jax.jit(fp8_units.block_scaled_operand, static_argnums=1)(
        jnp.asarray(x), op, None)
    r = ref.quantize(x, "mxfp8_e4m3", scale_rule="rceil")
    assert elems.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float8_e8m0fnu
    assert elems.shape == (2, 24, 96) and scales.shape == (2, 24, 3)  # K padded to 96
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint8), r.scales)
    got = np.asarray(elems).view(np.uint8)
    specified = ~np.asarray(r.nan_elems)
    np.testing.assert_array_equal(got[specified], r.codes[specified])
    assert np.asarray(scales).view(np.uint8)[0, 3, 0] == 0xFF
    # The pair means what scaled_matmul reads: element (an ml_dtypes E4M3) times 2^(byte - 127).
    v = got.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    s = np.asarray(scales).view(np.uint8).astype(np.float64)
    deq = v * np.repeat(2.0 ** (s - 127), 32, axis=-1)
    want = np.asarray(mxjax.fake_quantize(jnp.asarray(x), mxjax.MXFP8_E4M3, scale_rule="rceil"))
    ok = np.isfinite(want)
    np.testing.assert_array_equal(deq[..., :80][ok], want[ok].astype(np.float64))


def _operands(k: int = 320):
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((3, 40, k)) * 0.02).astype(np.float32)
    b = (rng.standard_normal((k, 56)) * np.exp(rng.uniform(-2, 2, (1, 56)))).astype(np.float32)
    return jnp.asarray(a, jnp.bfloat16), jnp.asarray(b)


def _abs_product(aq, bq):
    return np.abs(aq.astype(np.float64)) @ np.abs(bq.astype(np.float64))


@pytest.mark.parametrize("name", ["fp8", "mxfp8"])
def test_f8_gemm_is_within_the_bound_of_the_emulation(name):
    """docs/NUMERICS.md: |C_f8 - C_emul| <= (2K + 8) u |A_q| |B_q| and |C_f8 - A_q B_q| <=
    (K + 4) u |A_q| |B_q| (u = 2^-24), for the GEMM as XLA:CPU runs the f8 operands."""
    a, b = _operands()
    k = a.shape[-1]
    dims = Dims(((2,), (0,)), ((), ()))
    recipe = policies.get(name).dgrad if name == "fp8" else policies.get(name).fprop
    f8 = jax.jit(lambda a, b: forms._cuda_f8_form(a, b, dims, recipe, None, None, None))(a, b)
    emul = jax.jit(lambda a, b: forms._canonical_cpu_form(a, b, dims, recipe, None, None, None))(
        a, b)
    aq = np.asarray(fake_quantize_with(a.astype(jnp.float32), recipe.lhs, -1))
    bq = np.asarray(fake_quantize_with(b.T, recipe.rhs, -1)).T
    mag = _abs_product(aq, bq).reshape(np.asarray(f8).shape)
    exact = (aq.astype(np.float64) @ bq.astype(np.float64)).reshape(mag.shape)
    f8, emul = np.asarray(f8, np.float64), np.asarray(emul, np.float64)
    assert np.all(np.abs(f8 - emul) <= (2 * k + 8) * U32 * mag)
    assert np.all(np.abs(f8 - exact) <= (k + 4) * U32 * mag)
    # The bound is tight enough to see the rounding: the unquantized product is outside it
    # (a GEMM whose f8 rounding was folded away would fail the asserts above).
    plain = (np.asarray(a, np.float64) @ np.asarray(b, np.float64)).reshape(mag.shape)
    assert np.mean(np.abs(plain - exact) > (k + 4) * U32 * mag) > 0.5


@pytest.mark.parametrize("name", ["fp8", "mxfp8"])
def test_exported_cuda_program_has_f8_gemms_for_every_quantized_gemm(name):
    fn, args = es_dot_program(name)
    text = _export_text(fn, args, "cuda")
    q = es.analyze(text).quantized
    if name == "fp8":  # dot_general f8 x f8 -> f32: E4M3 fprop, E5M2 x E4M3 dgrad, and
        # wgrad as X x dY (E4M3 x E5M2: its operands swapped, the result laid out as W's)
        assert sorted((d.lhs, d.rhs, d.out) for d in q) == [
            ("f8E4M3FN", "f8E4M3FN", "f32"), ("f8E4M3FN", "f8E5M2", "f32"),
            ("f8E5M2", "f8E4M3FN", "f32")], [d.signature for d in q]
    else:  # three scaled_matmul calls on E4M3 elements and E8M0 scales, no dot_general
        assert q == ()
        calls = [line for line in text.splitlines() if "@__op$block_scaled_dot(" in line]
        assert len(calls) == 3
        assert all(line.count("xf8E4M3FN>") == 2 and line.count("xf8E8M0FNU>") == 2
                   for line in calls), calls
    # Lowered for TPU or ROCm: the emulation, no f8 operand.
    for platform in ("tpu", "rocm"):
        other = _export_text(fn, args, platform)
        assert "f8E" not in other and len(es.analyze(other).quantized) == 3, platform


def _export_text(fn, args, platform: str) -> str:
    # jax.export refuses custom calls without a stability guarantee; scaled_matmul's
    # `__op$block_scaled_dot` (MXFP8 on CUDA) is one (docs/NUMERICS.md).
    checks = [jax.export.DisabledSafetyCheck.custom_call("__op$block_scaled_dot")]
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)
    return exported(*args).mlir_module()


def es_dot_program(name: str):
    policy = policies.get(name)

    def f(a, b):
        def loss(a, b):
            y = mxjax.dot_general(a, b, (((1,), (0,)), ((), ())), policy=policy)
            return jnp.sum(jnp.square(y.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1))(a, b)

    return f, (jax.ShapeDtypeStruct((64, 96), jnp.bfloat16),
               jax.ShapeDtypeStruct((96, 128), jnp.bfloat16))


def test_f8_operand_rejects_other_formats():
    with pytest.raises(ValueError, match="op: expected a per-tensor FP8"):
        fp8_units.f8_operand(jnp.ones((4, 4)), OperandRecipe(fmt=mxjax.MXFP4), None)
    with pytest.raises(ValueError, match="recipe: expected MXFP8"):
        r = GemmRecipe(lhs=OperandRecipe(fmt=mxjax.FP8_E4M3), rhs=OperandRecipe(fmt=mxjax.FP8_E4M3))
        fp8_units.block_scaled_dot(jnp.ones((1, 4, 32)), jnp.ones((1, 4, 32)), r, None, None)


@pytest.mark.parametrize("dims,a_shape,b_shape", [
    (Dims(((0, 1), (0, 1)), ((), ())), (2, 24, 40), (2, 24, 56)),  # a wgrad's contraction
    (Dims(((2,), (2,)), ((0,), (0,))), (3, 24, 40), (3, 16, 40)),  # with a batch axis
])
def test_swapped_f8_gemm_is_the_same_gemm(dims, a_shape, b_shape):
    """The wgrad's CUDA form, dot(b, a) transposed back, has the shape and (as XLA:CPU runs
    it) the bits of dot(a, b): same f8 operands, same factors in the same order."""
    rng = np.random.default_rng(5)
    a = jnp.asarray(rng.standard_normal(a_shape), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(b_shape) * 3, jnp.float32)
    recipe = policies.get("fp8").wgrad

    def run(swap):
        return np.asarray(jax.jit(lambda a, b: forms._cuda_f8_form(
            a, b, dims, recipe, None, None, None, swap=swap))(a, b))

    plain, swapped = run(False), run(True)
    assert swapped.shape == plain.shape
    np.testing.assert_array_equal(swapped.view(np.uint32), plain.view(np.uint32))
