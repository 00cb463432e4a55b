"""The 'xla_fp8' backend: MXFP4 values carried exactly in FP8 (mxjax.routes.xla_fp8).

References are independent: ml_dtypes for what FP8 holds, tests/reference.py (numpy) for
the MXFP4 values, float64 numpy for the GEMM.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mxjax
from mxjax import policies
from mxjax.backends import capabilities_for, mx_dot
from mxjax.chips import Chip
from mxjax.emulation import in_place
from mxjax.routes import xla_fp4
from mxjax.routes import xla_fp8 as M
from tests import reference as ref

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _holds(dtype, values: np.ndarray) -> np.ndarray:
    """Which float64 values the ml_dtypes type represents exactly (and finitely)."""
    back = values.astype(dtype).astype(np.float64)
    return np.isfinite(back) & (back == values)


@pytest.mark.parametrize("name,dtype", [("e4m3", ml_dtypes.float8_e4m3fn),
                                        ("e5m2", ml_dtypes.float8_e5m2)])
def test_carrier_window_is_what_ml_dtypes_holds(name, dtype):
    carrier = M.CARRIERS[name]
    signed = np.concatenate([E2M1_VALUES, -E2M1_VALUES])
    for d in range(carrier.lowest, carrier.top + 1):
        assert _holds(dtype, signed * 2.0**d).all(), d
    # One binade more on either side loses a value: the window is as wide as it can be.
    assert not _holds(dtype, signed * 2.0 ** (carrier.top + 1)).all()
    assert not _holds(dtype, signed * 2.0 ** (carrier.lowest - 1)).all()
    assert carrier.span == {"e4m3": 14, "e5m2": 28}[name]


def _block_values(scale_exps: np.ndarray, rng) -> np.ndarray:
    """[rows, 32 * len(scale_exps)] MXFP4 values: random E2M1 codes times 2^scale per block,
    each block's largest element 4 or 6 (as a floor-rule block's is)."""
    rows, nb = 4, len(scale_exps)
    q = rng.choice(np.concatenate([E2M1_VALUES, -E2M1_VALUES]), size=(rows, nb, 32))
    q[:, :, 0] = rng.choice([4.0, 6.0, -6.0], size=(rows, nb))
    return (q * 2.0 ** scale_exps[None, :, None]).reshape(rows, nb * 32)


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_encoding_is_exact_inside_the_window_and_flagged_outside(name, extra):
    carrier = M.CARRIERS[name]
    op = policies.get("mxfp4_all").fprop.lhs
    rng = np.random.default_rng(extra)
    top = 10
    # Spans up to the window exactly, then `extra` binades past it (extra=0: inside).
    exps = np.array([top, top - 3, top - carrier.span - extra + (extra == 0) * 0, top - 1])
    v = _block_values(exps, rng).astype(np.float32)
    # The operand's own quantization (amax bits as the in-place form computes them).
    blocks = np.abs(v).reshape(4, -1, 32).max(-1)
    amax_bits = jnp.asarray(blocks.astype(np.float32).view(np.uint32))[..., None]
    t, exact = M.carrier_window(amax_bits, op, carrier)
    assert int(t) == top - carrier.top
    assert bool(exact) == (extra == 0)
    q = np.asarray(M.encode_exact(jnp.asarray(v), t, carrier)).astype(np.float64)
    inside = np.repeat(exps >= top - carrier.span, 32)[None, :].repeat(4, 0)
    np.testing.assert_array_equal((q * 2.0 ** int(t))[inside], v.astype(np.float64)[inside])


def test_zero_and_nan_blocks_do_not_narrow_the_window():
    carrier = M.LHS_CARRIER
    op = policies.get("mxfp4_all").fprop.lhs
    amax = np.array([[6.0 * 2**20, 0.0, np.nan, np.inf, 6.0]], np.float32)
    t, exact = M.carrier_window(jnp.asarray(amax.view(np.uint32)), op, carrier)
    assert bool(exact)  # 2^20 over 1: inside E5M2's 28 binades; zero/NaN/Inf blocks ignored
    assert int(t) == 20 - carrier.top  # the 6 * 2^20 block's scale is 2^20 (floor rule)
    _, exact = M.carrier_window(jnp.asarray(np.zeros((1, 3), np.uint32)), op, carrier)
    assert bool(exact)


def _recipe(preset: str, backend: str = "xla_fp8"):
    return dataclasses.replace(policies.get(preset).fprop, backend=backend)


DIMS = {  # name: (lhs shape, rhs shape, lax dimension numbers)
    "xw": ((48, 200), (200, 40), (((1,), (0,)), ((), ()))),  # K=200: not a multiple of 32
    "xT_w": ((96, 24), (96, 40), (((0,), (0,)), ((), ()))),  # contraction on axis 0
    "batched": ((2, 16, 64), (2, 64, 24), (((2,), (1,)), ((0,), (0,)))),
    "two_contract": ((8, 4, 16), (4, 16, 12), (((1, 2), (0, 1)), ((), ()))),
}


def _operands(shape_a, shape_b, seed=0, dtype=jnp.float32):
    ka, kb = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(ka, shape_a, jnp.float32).astype(dtype),
            jax.random.normal(kb, shape_b, jnp.float32).astype(dtype))


def _reference_gemm(a, b, dims, preset: str, signs) -> np.ndarray:
    """float64 GEMM of tests/reference.py's MXFP4 values of the rotated operands."""
    (ca, cb), (ba, bb) = dims
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    fa = [i for i in range(a.ndim) if i not in ca + ba]
    fb = [i for i in range(b.ndim) if i not in cb + bb]
    a3 = np.transpose(a, ba + tuple(fa) + ca)
    b3 = np.transpose(b, bb + tuple(fb) + cb)
    k = int(np.prod([a.shape[i] for i in ca]))
    a3 = a3.reshape(a3.shape[:len(ba) + len(fa)] + (k,))
    b3 = b3.reshape(b3.shape[:len(bb) + len(fb)] + (k,))
    h16 = preset.endswith("h16")
    if h16:
        kp = -(-k // 16) * 16
        pad = [(0, 0)] * (a3.ndim - 1) + [(0, kp - k)]
        a3 = ref.hadamard(np.pad(a3, pad), 16, -1, np.asarray(signs))
        pad = [(0, 0)] * (b3.ndim - 1) + [(0, kp - k)]
        b3 = ref.hadamard(np.pad(b3, pad), 16, -1, np.asarray(signs))
    qa = ref.fake_quantize(a3.astype(np.float32), "mxfp4", -1, scale_rule="even")
    qb = ref.fake_quantize(b3.astype(np.float32), "mxfp4", -1, scale_rule="even")
    return np.einsum("...ik,...jk->...ij", np.asarray(qa, np.float64),
                     np.asarray(qb, np.float64)), np.einsum(
        "...ik,...jk->...ij", np.abs(np.asarray(qa, np.float64)),
        np.abs(np.asarray(qb, np.float64)))


def _route(a, b, dims, recipe, signs):
    return M.mx_gemm_fp8(a, b, dims, recipe, None, None, signs)


def _emulation(a, b, dims, recipe, signs):
    return in_place.mx_gemm(a, b, dims, recipe, None, None, signs, form="gpu")


def _emulation_keyed(a, b, dims, recipe, signs, k1, k2):
    return in_place.mx_gemm(a, b, dims, recipe, k1, k2, signs, form="gpu")


@pytest.mark.parametrize("layout", sorted(DIMS))
@pytest.mark.parametrize("preset", ["mxfp4_all", "mxfp4_all_h16"])
def test_route_is_the_exact_gemm_within_f32_summation(layout, preset):
    shape_a, shape_b, dims = DIMS[layout]
    a, b = _operands(shape_a, shape_b)
    recipe = _recipe(preset)
    signs = mxjax.fixed_signs(0, 16)
    out = jax.jit(_route, static_argnums=(2, 3))(a, b, dims, recipe, signs)
    exact, mag = _reference_gemm(a, b, dims, preset, signs)
    k = -(-math.prod(shape_a[i] for i in dims[0][0]) // 16) * 16
    bound = 2 * k * 2.0**-24 * mag.reshape(out.shape)
    err = np.abs(np.asarray(out, np.float64) - exact.reshape(out.shape))
    assert np.all(err <= bound), float(np.max(err - bound))
    # The bound sees the quantization: the unquantized product is far outside it.
    assert np.mean(err + bound < np.abs(exact.reshape(out.shape))) > 0.5


def test_route_matches_the_emulation_bit_for_bit_on_cpu_with_and_without_jit():
    shape_a, shape_b, dims = DIMS["xw"]
    a, b = _operands(shape_a, shape_b, seed=3, dtype=jnp.bfloat16)
    recipe = _recipe("mxfp4_all_h16")
    signs = mxjax.fixed_signs(0, 16)
    ref_out = jax.jit(_emulation, static_argnums=(2, 3))(a, b, dims, recipe, signs)
    jitted = jax.jit(_route, static_argnums=(2, 3))(a, b, dims, recipe, signs)
    eager = _route(a, b, dims, recipe, signs)
    # XLA:CPU computes the f8 dot at HIGHEST from exact f32 products, as it does the bf16
    # one: the same sums.
    chex.assert_trees_all_equal(jitted, ref_out)
    chex.assert_trees_all_equal(eager, ref_out)


def test_wide_span_takes_the_emulation_bit_for_bit():
    """The fallback is the emulation's operands and dot, computed in the fallback's pieces
    (`in_place.mx_gemm`'s ``row_chunks``: the bits of that computation), each element
    within f32 summation of the float64 GEMM of the reference's quantized operands."""
    shape_a, shape_b, dims = DIMS["xw"]
    a, b = _operands(shape_a, shape_b, seed=1)
    a = a.at[0, :32].multiply(2.0**40)  # one block 2^40 above the rest: past E5M2's window
    b = b.at[:32, 3].multiply(2.0**-20)  # and one far below: past E4M3's
    recipe = _recipe("mxfp4_all_h16")
    signs = mxjax.fixed_signs(0, 16)
    out = jax.jit(_route, static_argnums=(2, 3))(a, b, dims, recipe, signs)
    emu = jax.jit(lambda a, b: in_place.mx_gemm(
        a, b, dims, recipe, None, None, signs, form="gpu",
        row_chunks=M.FALLBACK_ROW_CHUNKS))(a, b)
    chex.assert_trees_all_equal(out, emu)
    exact, mag = _reference_gemm(a, b, dims, "mxfp4_all_h16", signs)
    k = -(-shape_a[1] // 16) * 16
    err = np.abs(np.asarray(out, np.float64) - exact)
    assert np.all(err <= 2 * k * 2.0**-24 * mag)
    # ...and the flag is what sent it there.
    view = in_place.contraction_view(a, (), (1,))
    _, (_, exact) = in_place.mx_operand_values(
        view, recipe.lhs, k_out=208, hadamard_size=16, signs=signs, key=None,
        finish=lambda v, ab: (v, M.carrier_window(ab, recipe.lhs, M.LHS_CARRIER)))
    assert not bool(exact)


def test_nan_and_zero_operands():
    shape_a, shape_b, dims = DIMS["xw"]
    a, b = _operands(shape_a, shape_b, seed=2)
    a = a.at[5, 7].set(jnp.nan).at[6].set(0.0)
    recipe = _recipe("mxfp4_all")
    out = np.asarray(_route(a, b, dims, recipe, None))
    emu = np.asarray(_emulation(a, b, dims, recipe, None))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(emu))
    assert np.isnan(out[5]).all() and not np.isnan(np.delete(out, 5, 0)).any()
    np.testing.assert_array_equal(out[6], 0.0)
    zero = _route(jnp.zeros(shape_a), b, dims, recipe, None)
    np.testing.assert_array_equal(np.asarray(zero), 0.0)


def test_stochastic_rounding_recipe_uses_the_emulations_draws():
    shape_a, shape_b, dims = DIMS["xw"]
    a, b = _operands(shape_a, shape_b, seed=4)
    recipe = _recipe("mxfp4_all_sr")
    k1, k2 = jax.random.split(jax.random.key(7))
    out = M.mx_gemm_fp8(a, b, dims, recipe, k1, k2, None)
    emu = in_place.mx_gemm(a, b, dims, recipe, k1, k2, None, form="gpu")
    chex.assert_trees_all_equal(out, emu)


def test_narrow_result_exact_bounds():
    # fp8 carriers: nonzero products in [2^-25, 2^25); K = 4096 adds 12 bits and a binade
    # of margin: 2^(e - 25) >= 2^-126 and e + 25 + 12 + 1 <= 127.
    ok = [bool(M.narrow_result_exact(jnp.int32(e), 4096, M.CARRIER_PRODUCT_EXPONENTS))
          for e in (-102, -101, 0, 89, 90)]
    assert ok == [False, True, True, True, False]
    assert bool(M.narrow_result_exact(jnp.int32(89), 4097, M.CARRIER_PRODUCT_EXPONENTS)) is False
    assert M.narrow_result(_recipe("mxfp4_all_h16"), jnp.bfloat16)
    assert not M.narrow_result(_recipe("mxfp4_all_h16"), jnp.float32)
    assert not M.narrow_result(_recipe("mxfp4_all_h16"), None)
    sr = policies.get("tseng").dgrad  # SR with the 3/4 pre-scale: its unscale follows
    assert any(op.sr_prescale for op in (sr.lhs, sr.rhs))
    assert not M.narrow_result(sr, jnp.bfloat16)


@pytest.mark.parametrize("backend", ["xla_fp8", "xla_fp4"])
@pytest.mark.parametrize("scale", [0, -55, 60])
def test_bf16_results_are_the_emulations_rounded_once(backend, scale):
    """out_dtype bf16: the carriers' GEMM rounds its f32 sums to bf16 itself (the route's
    bytes), the emulation rounds the f32 result; the same bits. Where 2^(t_a + t_b) could
    take a result out of bf16's normal range (scale -55: t_a + t_b = -129 for xla_fp8;
    scale 60: +101) the route hands the GEMM to the emulation."""
    from mxjax.routes import xla_fp4

    shape_a, shape_b, dims = DIMS["xw"]
    a, b = _operands(shape_a, shape_b, seed=21)
    a, b = a * jnp.float32(2.0**scale), b * jnp.float32(2.0**scale)
    recipe = _recipe("mxfp4_all_h16", backend)
    signs = mxjax.fixed_signs(0, 16)
    route = M.mx_gemm_fp8 if backend == "xla_fp8" else xla_fp4.mx_gemm_fp4
    out = jax.jit(lambda a, b: route(a, b, dims, recipe, None, None, signs,
                                     out_dtype=jnp.bfloat16))(a, b)
    emu = jax.jit(_emulation, static_argnums=(2, 3))(a, b, dims, recipe, signs)
    assert out.dtype == jnp.bfloat16
    chex.assert_trees_all_equal(out, emu.astype(jnp.bfloat16).reshape(out.shape))


@pytest.mark.parametrize("backend", [pytest.param("xla_fp8", marks=pytest.mark.slow), "xla_fp4"])
def test_backend_through_the_policy_fwd_and_bwd_equals_the_emulation_on_cpu(backend):
    # XLA:CPU contracts the carriers (and expands xla_fp4's block-scaled dot) into exact
    # f32 products summed in f32, as the emulation's dot: the same values here.
    x, w = _operands((64, 96), (96, 48), seed=5, dtype=jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))

    def grads(policy):
        def loss(x, w):
            y = mxjax.dot_general(x, w, dims, policy=policy)
            return jnp.sum(jnp.square(y.astype(jnp.float32)))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

    chex.assert_trees_all_equal(grads(policies.get(f"mxfp4_all_h16@{backend}")),
                                grads(policies.get("mxfp4_all_h16")))


# A carriers' dot; StableHLO omits the precision attribute where it is DEFAULT.
_F8_DOT = re.compile(r"stablehlo\.dot_general [^:]*?(?:precision = \[(\w+), \w+\] )?: "
                     r"\(tensor<\w+xf8E5M2>, tensor<\w+xf8E4M3FN>\) -> tensor<(\w+)x\w+>")


@pytest.mark.slow
def test_accumulation_per_gemm_in_the_program_exported_for_an_h200():
    """The policy's GEMM names reach the route: fprop's carriers' dot at precision DEFAULT
    (cuBLASLt fast accumulation), dgrad's and wgrad's at HIGHEST (promoted), as fp8's
    (mxjax.emulation.f8_accumulation). Exported for CUDA from this CPU, the target an H200."""
    from bench.costmodel import export_shape as es

    policy = policies.get("mxfp4_all_h16@xla_fp8")

    def train(x, w):
        def loss(x, w):
            y = mxjax.dot_general(x, w, (((1,), (0,)), ((), ())), policy=policy)
            return jnp.sum(jnp.square(y.astype(jnp.float32)))
        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                      platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    args = (jax.ShapeDtypeStruct((64, 96), jnp.bfloat16),
            jax.ShapeDtypeStruct((96, 80), jnp.bfloat16))
    with jax.sharding.use_abstract_mesh(mesh):
        text = es.export_text(train, args, "cuda")
    # The result's shape names the GEMM: fprop [64, 80], dgrad [64, 96], wgrad [80, 96].
    found = {shape: precision or "DEFAULT" for precision, shape in _F8_DOT.findall(text)}
    assert found == {"64x80": "DEFAULT", "64x96": "HIGHEST", "80x96": "HIGHEST"}, found


def test_a_gemm_outside_a_policys_three_gets_promoted_accumulation():
    assert M._accumulation_name("fprop") == "fprop"
    assert M._accumulation_name("wgrad") == "wgrad"
    assert M._accumulation_name("gemm") is None  # mxjax.gemm's default name


def test_rejects_other_formats():
    with pytest.raises(ValueError, match="xla_fp8.*MXFP4"):
        M.mx_gemm_fp8(jnp.ones((4, 32)), jnp.ones((32, 4)), (((1,), (0,)), ((), ())),
                      _recipe("nvfp4"), None, None, None)
    with pytest.raises(ValueError, match="implements MXFP4 x MXFP4 only"):
        policy = policies.get("mxfp8").with_backend("xla_fp8")
        jax.jit(lambda x, w: mxjax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                               policy=policy))(jnp.ones((4, 32)),
                                                               jnp.ones((32, 4)))


@pytest.mark.parametrize("axes", [(1, 0), (0, 1), (1, 1)])
def test_mx_dot_xla_fp8_on_mxarrays(axes):
    la, ra = axes
    a = jax.random.normal(jax.random.key(0), (40, 200) if la == 1 else (200, 40))
    b = jax.random.normal(jax.random.key(1), (200, 24) if ra == 0 else (24, 200))
    lq = mxjax.quantize(a, mxjax.MXFP4, axis=la)
    rq = mxjax.quantize(b, mxjax.MXFP4, axis=ra)
    out = jax.jit(lambda p, q: mx_dot(p, q, backend="xla_fp8"))(lq, rq)
    want = jax.jit(lambda p, q: mx_dot(p, q, backend="xla"))(lq, rq)
    chex.assert_shape(out, (40, 24))
    chex.assert_trees_all_close(out, want, rtol=1e-6, atol=1e-6)
    wide = mxjax.quantize(a.at[0, :32].multiply(2.0**40) if la == 1
                          else a.at[:32, 0].multiply(2.0**40), mxjax.MXFP4, axis=la)
    chex.assert_trees_all_close(mx_dot(wide, rq, backend="xla_fp8"),
                                mx_dot(wide, rq, backend="xla"), rtol=1e-6)


@pytest.mark.parametrize("kind,cc,ok", [
    ("NVIDIA H200", (9, 0), True), ("NVIDIA B200", (10, 0), True),
    ("NVIDIA L4", (8, 9), True), ("NVIDIA A100-SXM4-80GB", (8, 0), False),
    ("", None, False), ("AMD Instinct MI355X", None, False)])
def test_capabilities_of_xla_fp8(kind, cc, ok):
    caps = capabilities_for(Chip(platform="gpu", device_kind=kind, compute_capability=cc))
    assert caps.can_run("xla_fp8") == ok, caps.reason("xla_fp8")
    assert capabilities_for(Chip(platform="cpu", device_kind="cpu")).can_run("xla_fp8")
    assert not capabilities_for(Chip(platform="tpu", device_kind="TPU v5 lite")).can_run(
        "xla_fp8")


def test_policy_at_backend_names():
    p = policies.get("mxfp4_all_h16@xla_fp8")
    assert p.name == "mxfp4_all_h16@xla_fp8"
    assert {p.fprop.backend, p.dgrad.backend, p.wgrad.backend} == {"xla_fp8"}
    q = policies.resolve("mxfp4_fprop@auto")
    assert (q.fprop.backend, q.dgrad.backend, q.wgrad.backend) == ("auto", "xla", "xla")
    assert q.dgrad.is_passthrough
    assert policies.get("mxfp4_all").with_backend("xla").fprop == policies.get(
        "mxfp4_all").fprop
    with pytest.raises(ValueError, match="backend: expected one of .*, got 'bogus'"):
        policies.get("mxfp4_all@bogus")
    with pytest.raises(ValueError, match="unknown preset 'nope@xla'"):
        policies.resolve("nope@xla")


# --- 'xla_fp4' in place: the same operands written as NVFP4 for the block-scaled dot ------


# The default run: H16 on K = 200 and two contractions, SR on K = 200; the rest is slow.
@pytest.mark.parametrize("preset,layout", [
    (p, d) if (p, d) in {("mxfp4_all_h16", "xw"), ("mxfp4_all_h16", "two_contract"),
                         ("mxfp4_all_sr", "xw")}
    else pytest.param(p, d, marks=pytest.mark.slow)
    for p in ("mxfp4_all_h16", "mxfp4_all_sr") for d in sorted(DIMS)])
def test_fp4_route_takes_the_block_scaled_dot_and_equals_the_emulation_on_cpu(preset, layout):
    shape_a, shape_b, dims = DIMS[layout]
    a, b = _operands(shape_a, shape_b, seed=10, dtype=jnp.bfloat16)
    recipe = _recipe(preset, "xla_fp4")
    signs = mxjax.fixed_signs(0, 16) if recipe.hadamard else None
    k1, k2 = jax.random.split(jax.random.key(11)) if recipe.needs_key else (None, None)
    out = jax.jit(lambda a, b: xla_fp4.mx_gemm_fp4(a, b, dims, recipe, k1, k2, signs))(a, b)
    emu = _emulation_keyed(a, b, dims, recipe, signs, k1, k2)
    # XLA:CPU expands scaled_matmul to exact f32 products summed in f32: the same sums.
    chex.assert_trees_all_equal(out, emu.reshape(out.shape))
    # ...through the block-scaled dot: its operands are exact for these tensors.
    view = in_place.contraction_view(a, dims[1][0], dims[0][0])
    k = view.x.shape[view.axis]
    _, (_, _, exact) = in_place.mx_operand_values(
        view, recipe.lhs, k_out=-(-k // 32) * 32, hadamard_size=16 if signs is not None else None,
        signs=signs, key=k1, finish=functools.partial(xla_fp4._fp4_finish, op=recipe.lhs))
    assert bool(exact)


def test_fp4_route_past_the_window_or_with_nan_takes_the_emulation():
    shape_a, shape_b, dims = DIMS["xw"]
    a, b = _operands(shape_a, shape_b, seed=12)
    recipe = _recipe("mxfp4_all_h16", "xla_fp4")
    signs = mxjax.fixed_signs(0, 16)
    wide = a.at[0, :32].multiply(2.0**30)  # 30 binades: past NVFP4 scales' 18
    nan = a.at[3, 5].set(jnp.nan)
    for x in (wide, nan):
        out = jax.jit(lambda a, b: xla_fp4.mx_gemm_fp4(a, b, dims, recipe, None, None, signs))(x, b)
        emu = _emulation(x, b, dims, recipe, signs)
        chex.assert_trees_all_equal(out, emu.reshape(out.shape))
