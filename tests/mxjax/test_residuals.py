"""Quantized residuals (mxjax.residuals): the forward saves the backward's rhs operands
packed, and the gradients stay bit for bit those of the bf16 residuals.

The reference is the same call with packing switched off (``saves_packed`` patched to
False in the interceptor): the path every backward GEMM took before. Shapes are not
multiples of 32 or 16 (the quantizer pads), and the dimension numbers cover a plain
activation x weight product, batch dimensions, and several non-trailing contractions.

Every block-scaled preset packs (its GPU and TPU branches take the packed rhs in their
in-place forms too) except MXFP8, which CUDA runs on FP8 tensor cores in no canonical
layout. Its CPU form still packs exactly, so the gradient tests pack as a program for CPUs
alone would (`_as_on_a_cpu`): every preset in `PACKING_ON_A_CPU`.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals's list

import mxjax
from mxjax import backends, interceptor, policies, residuals
from mxjax.dimensions import Dims, normalize_dimension_numbers
from mxjax.emulation import forms
from mxjax.gemm import gemm, gemm_packed_rhs
from mxjax.layout import canonical_dimension_numbers
from mxjax.operands import split_key
from mxjax.remat import PACKED_RESIDUAL, remat_policy
from mxjax.residuals import pack_rhs, saves_packed

# (lhs shape, rhs shape, dimension numbers): every GEMM axis somewhere else.
CASES = {
    "activation_weight": ((3, 37, 50), (50, 45), (((2,), (0,)), ((), ()))),
    "batched": ((2, 37, 50), (2, 45, 50), (((2,), (2,)), ((0,), (0,)))),
    "two_contractions": ((6, 37, 5), (5, 45, 6), (((0, 2), (2, 0)), ((), ()))),
}
KEY = jax.random.key(1)


def _cpu_form(recipe, platform):
    del platform
    return forms.emulates_packed_rhs(recipe, "cpu")


def _as_on_a_cpu(m):
    """Packing decided as for a program lowered for CPUs alone: the emulation's CPU form
    (canonical for every block-scaled recipe) on every platform."""
    m.setattr(residuals, "emulates_packed_rhs", _cpu_form)


def _packs(name) -> bool:
    p = policies.get(name)
    return saves_packed(p.dgrad) or saves_packed(p.wgrad)


PACKING = tuple(n for n in policies.names() if _packs(n))
with mock.patch.object(residuals, "emulates_packed_rhs", _cpu_form):
    PACKING_ON_A_CPU = tuple(n for n in policies.names() if _packs(n))


def _inputs(case, dtype=jnp.bfloat16):
    ls, rs, dims = CASES[case]
    x = jax.random.normal(jax.random.key(2), ls, jnp.float32).astype(dtype)
    w = (jax.random.normal(jax.random.key(3), rs, jnp.float32) * 0.2).astype(dtype)
    return x, w, dims


def _loss(policy, dims, **kw):
    def loss(x, w):
        y = mxjax.dot_general(x, w, dims, policy=policy, key=KEY, **kw)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))
    return loss


def _grads(policy, case, jit, packed, monkeypatch, **kw):
    x, w, dims = _inputs(case)
    with monkeypatch.context() as m:
        _as_on_a_cpu(m)
        if not packed:
            m.setattr(interceptor, "saves_packed", lambda recipe: False)
        g = jax.grad(_loss(policy, dims, **kw), argnums=(0, 1))
        return (jax.jit(g) if jit else g)(x, w)


def test_the_packing_presets():
    # Every platform's branch counts: MXFP8's CUDA form (FP8 tensor cores) takes no packed rhs.
    assert set(PACKING) == set(PACKING_ON_A_CPU) - {"mxfp8"}
    for name in ("nvfp4", "mxfp4_all_h16", "mxfp4_all_h16@auto"):
        p = policies.get(name)
        assert saves_packed(p.dgrad) and saves_packed(p.wgrad)
    assert set(PACKING_ON_A_CPU) == {
        "mxfp4_fprop_dgrad", "mxfp4_all", "mxfp4_all_sr", "mxfp4_all_rht16", "mxfp4_all_h16",
        "mxfp4_all_h32", "mxfp4_all_h16_wgrad", "mxfp8", "nvfp4", "tseng"}
    for name in ("passthrough", "fp8", "mxfp4_fprop"):
        assert name not in PACKING_ON_A_CPU
    # An explicit route with packed_rhs_gemm packs; one without keeps the bf16 residuals.
    p = policies.get("mxfp8").with_backend("xla_mxfp8")
    assert saves_packed(p.dgrad) and saves_packed(p.wgrad)
    p = policies.get("mxfp4_all_h16").with_backend("xla_fp8")
    assert saves_packed(p.dgrad) and saves_packed(p.wgrad)
    # A backend that cannot run on the target (triton on this CPU) is no obstacle: its
    # branch raises when lowered, packed or not (the accelerator tests lower it).
    p = policies.get("mxfp4_all_h16").with_backend("triton")
    assert saves_packed(p.dgrad) and saves_packed(p.wgrad)


# Two presets in the default run (MX with H16; NVFP4, with SR); tseng (randomized H64) is
# in the other GEMM-axis test below; every one under make test-slow.
_DEFAULT_PACKING = ("mxfp4_all_h16", "nvfp4")


@pytest.mark.parametrize("policy", [p if p in _DEFAULT_PACKING else
                                    pytest.param(p, marks=pytest.mark.slow)
                                    for p in PACKING_ON_A_CPU])
def test_gradients_bit_identical_to_bf16_residuals(policy, monkeypatch):
    got = _grads(policy, "activation_weight", True, True, monkeypatch)
    want = _grads(policy, "activation_weight", True, False, monkeypatch)
    chex.assert_trees_all_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["nvfp4"])
def test_gradients_bit_identical_without_jit(policy, monkeypatch):
    got = _grads(policy, "activation_weight", False, True, monkeypatch)
    want = _grads(policy, "activation_weight", False, False, monkeypatch)
    chex.assert_trees_all_equal(got, want)


# NVFP4 (tensor scale, fixed-sign H16) and tseng (SR prescale, randomized H64); every
# preset on every axis, eager and jitted, under make test-slow (below).
@pytest.mark.parametrize("policy,case", [("nvfp4", "batched"), ("tseng", "two_contractions")]
                         + [pytest.param(p, c, marks=pytest.mark.slow)
                            for p, c in (("nvfp4", "two_contractions"), ("tseng", "batched"))])
def test_gradients_bit_identical_on_every_gemm_axis(policy, case, monkeypatch):
    got = _grads(policy, case, True, True, monkeypatch)
    want = _grads(policy, case, True, False, monkeypatch)
    chex.assert_trees_all_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", ["activation_weight", "batched", "two_contractions"])
@pytest.mark.parametrize("policy", PACKING_ON_A_CPU)
def test_gradients_bit_identical_every_preset_and_axis(policy, case, jit, monkeypatch):
    got = _grads(policy, case, jit, True, monkeypatch)
    want = _grads(policy, case, jit, False, monkeypatch)
    chex.assert_trees_all_equal(got, want)


def test_operand_dtype_cast_and_f32_primals_bit_identical(monkeypatch):
    # f32 primals cast to bf16 inside (dot_general's operand_dtype): the residuals are the
    # cast operands, the cotangents come back in f32.
    ls, rs, dims = CASES["activation_weight"]
    x = jax.random.normal(jax.random.key(2), ls, jnp.float32)
    w = jax.random.normal(jax.random.key(3), rs, jnp.float32)

    def grads(packed):
        with monkeypatch.context() as m:
            _as_on_a_cpu(m)
            if not packed:
                m.setattr(interceptor, "saves_packed", lambda recipe: False)
            loss = _loss("mxfp4_all_h16", dims, operand_dtype=jnp.bfloat16)
            return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

    got, want = grads(True), grads(False)
    chex.assert_trees_all_equal(got, want)
    assert got[0].dtype == jnp.float32 and got[1].dtype == jnp.float32
    # X is saved packed (its cast copy replaced); W, read as stored, is not copied.
    _as_on_a_cpu(monkeypatch)
    res = _residual_dtypes(_loss("mxfp4_all_h16", dims, operand_dtype=jnp.bfloat16), x, w)
    assert (jnp.dtype(jnp.float32), x.shape) not in res
    codes = [s for d, s in res if d == jnp.uint8]
    assert (50, 64) in codes and (50, 32) not in codes, res


def _residual_dtypes(fn, *args):
    return [(r.dtype, r.shape) for r, _ in saved_residuals(fn, *args)]


def test_forward_saves_packed_codes_instead_of_the_bf16_primals(monkeypatch):
    _as_on_a_cpu(monkeypatch)
    x, w, dims = _inputs("activation_weight")
    packed = _residual_dtypes(_loss("mxfp4_all_h16", dims), x, w)
    plain = _residual_dtypes(_loss("mxfp4_fprop", dims), x, w)  # bf16 backward: primals kept
    assert (jnp.dtype(jnp.bfloat16), x.shape) in plain
    assert (jnp.dtype(jnp.bfloat16), x.shape) not in packed
    assert (jnp.dtype(jnp.bfloat16), w.shape) not in packed
    codes = [s for d, s in packed if d == jnp.uint8]
    assert codes, packed
    # X for wgrad: canonical [K=50, M=3*37=111], padded to 112 (H16), blocks of 32: 128
    # codes two per byte, 4 scales; W for dgrad: [K=50, N=45], padded to 48, then 64.
    assert (50, 64) in codes and (50, 4) in codes and (50, 32) in codes
    held = sum(np.prod(s) for d, s in packed if d == jnp.uint8)  # codes and scale bytes
    primals = x.size * 2 + w.size * 2  # the bf16 residuals they replace
    assert held < 0.45 * primals, (held, primals)


def test_remat_policy_keeps_the_packed_residuals_only(monkeypatch):
    x, w, dims = _inputs("activation_weight")
    loss = _loss("nvfp4", dims)
    keep = jax.checkpoint(loss, policy=remat_policy("quantized_residuals"))
    full = jax.checkpoint(loss, policy=remat_policy("full"))
    kept = saved_residuals(keep, x, w)
    names = [src for _, src in kept]
    packed = [r for r, src in kept if PACKED_RESIDUAL in src]
    assert packed and all(r.dtype in (jnp.uint8, jnp.float32) for r in packed), names
    assert not any(PACKED_RESIDUAL in src for _, src in saved_residuals(full, x, w))
    want = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    chex.assert_trees_all_equal(jax.jit(jax.grad(keep, argnums=(0, 1)))(x, w), want)
    chex.assert_trees_all_equal(jax.jit(jax.grad(full, argnums=(0, 1)))(x, w), want)


def test_unknown_remat_policy_names_the_choices():
    with pytest.raises(ValueError, match="quantized_residuals"):
        remat_policy("dots")


def test_second_derivative_across_a_jit_boundary_raises_a_clear_error():
    x, w, dims = _inputs("activation_weight", jnp.float32)
    loss = _loss("nvfp4", dims)
    v = jnp.ones_like(x)
    with pytest.raises(TypeError, match=r"jax.jit\(jax.grad\(jax.grad"):
        jax.grad(lambda z: jnp.vdot(jax.jit(jax.grad(loss))(z, w), v))(x)
    # Within one jit the forward keeps its primals: the straight-through rule applies.
    hvp = jax.jit(jax.grad(lambda z: jnp.vdot(jax.grad(loss)(z, w), v)))(x)
    assert float(jnp.max(jnp.abs(hvp))) > 0.0


def _abstract_mesh(kind, platform):
    dev = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)


@pytest.mark.parametrize("kind,platform,mx_packs,auto_packs", [
    ("NVIDIA H200", "gpu", False, False), ("NVIDIA B200", "gpu", False, True),
    ("TPU v5 lite", "tpu", False, False)])
def test_the_decision_follows_every_platforms_route_and_the_target(kind, platform, mx_packs,
                                                                   auto_packs):
    # Every platform's branch must take the packed rhs (the program may be lowered for any):
    # the emulation does on every platform; under 'auto' the GPU branch is the target's
    # route: 'xla_fp4' (B200) and 'xla_fp8' (H200) take it. The target then chooses: on an
    # H200 'xla_fp8' reads X and W in place (packing there cost memory without remat), as
    # the emulation's GPU and TPU forms keep MX operands in place; NVFP4 packs.
    target = _abstract_mesh(kind, platform)
    with jax.sharding.use_abstract_mesh(target):
        mx, auto = policies.get("mxfp4_all_h16"), policies.get("mxfp4_all_h16@auto")
        assert saves_packed(mx.wgrad) == saves_packed(mx.dgrad) == mx_packs
        assert saves_packed(auto.wgrad) == saves_packed(auto.dgrad) == auto_packs
        assert saves_packed(policies.get("nvfp4").wgrad)
        assert saves_packed(policies.get("nvfp4").dgrad)
        nv_auto = policies.get("nvfp4@auto")  # 'xla_nvfp4' on a B200 takes it too
        assert saves_packed(nv_auto.wgrad) and saves_packed(nv_auto.dgrad)


# NVFP4's canonical form in the default run (the MX in-place forms' packed GEMM is
# tests/mxjax/emulation/test_in_place.py's); every form and preset under make test-slow.
@pytest.mark.parametrize("platform,policy", [("gpu", "nvfp4")] + [
    pytest.param(pl, po, marks=pytest.mark.slow) for pl in ("gpu", "tpu")
    for po in ("nvfp4", "mxfp4_all_sr", "tseng") if (pl, po) != ("gpu", "nvfp4")])
def test_accelerator_form_from_the_residual_equals_the_emulations(policy, platform):
    # The GPU/TPU branch of the emulation's packed-rhs GEMM against the emulation's GPU/TPU
    # form of the primals (both run here: NVFP4's canonical form, the MX formats' in-place
    # forms; bf16 operands, f32 accumulation).
    from mxjax.emulation.forms import _accelerator_form, emulated_packed_rhs_gemm

    recipe = policies.get(policy).wgrad
    a = jax.random.normal(jax.random.key(4), (45, 111), jnp.float32)
    b = jax.random.normal(jax.random.key(5), (50, 111), jnp.float32)
    key = jax.random.key(6)
    k_lhs, k_rhs, k_had = split_key(key)
    dims = Dims(*canonical_dimension_numbers(0))
    got = emulated_packed_rhs_gemm(a, pack_rhs(b, dims, recipe, key).q, b.shape, dims, recipe,
                                   key, platform=platform)
    want = _accelerator_form(a, b, dims, recipe, k_lhs, k_rhs, k_had, form=platform)
    chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize("operand_dtypes,pet", [(None, None), ((None, jnp.bfloat16), jnp.float32)])
@pytest.mark.parametrize("case", list(CASES))
def test_gemm_packed_rhs_is_the_gemm_of_the_primal(case, operand_dtypes, pet):
    # lax.dot_general's layout and result dtype, gemm's bits, with the rhs given packed.
    x, w, dims = _inputs(case, jnp.float32)
    dims = normalize_dimension_numbers(dims, x.shape, w.shape)
    recipe = policies.get("nvfp4").fprop
    kw = {"preferred_element_type": pet, "gemm_name": "fprop", "operand_dtypes": operand_dtypes}
    want = jax.jit(lambda x, w: gemm(x, w, dims, recipe, KEY, **kw))(x, w)
    cast = None if operand_dtypes is None else operand_dtypes[1]
    packed = pack_rhs(w, dims, recipe, KEY, cast)
    got = jax.jit(lambda x, q: gemm_packed_rhs(x, q, packed.primal, dims, recipe, KEY, **kw))(
        x, packed.q)
    assert got.shape == want.shape and got.dtype == want.dtype
    chex.assert_trees_all_equal(got, want)


def test_a_route_without_packed_rhs_gemm_keeps_the_bf16_residuals(monkeypatch):
    # The emulation's route with its packed_rhs_gemm removed: nothing is saved packed, and
    # the gradients are those of the bf16 residuals.
    x, w, dims = _inputs("activation_weight")
    want = _grads("mxfp4_all_h16", "activation_weight", True, True, monkeypatch)
    monkeypatch.setitem(backends.ROUTES, "xla",
                        dataclasses.replace(backends.ROUTES["xla"], packed_rhs_gemm=None))
    assert not any(saves_packed(policies.get(n).dgrad) or saves_packed(policies.get(n).wgrad)
                   for n in policies.names())
    res = _residual_dtypes(_loss("mxfp4_all_h16", dims), x, w)
    assert (jnp.dtype(jnp.bfloat16), x.shape) in res and (jnp.dtype(jnp.bfloat16), w.shape) in res
    assert not [s for d, s in res if d == jnp.uint8], res
    chex.assert_trees_all_equal(
        _grads("mxfp4_all_h16", "activation_weight", True, True, monkeypatch), want)


def test_another_route_takes_the_packed_rhs_through_the_registry(monkeypatch):
    # A route other than the emulation (here 'xla_fp8' made to compute the emulation's GEMM)
    # that declares a packed_rhs_gemm gets the packed residual, per platform, with no change
    # to the interceptor; platforms where the backend cannot run are no obstacle.
    from mxjax.routes import xla

    calls = []

    def spy(a, packed_q, **kw):
        calls.append((kw["platform"], kw["gemm_name"], type(packed_q).__name__))
        return xla.ROUTE.packed_rhs_gemm(a, packed_q, **kw)

    policy = policies.get("mxfp4_all_h16")
    fake = dataclasses.replace(xla.ROUTE, name="xla_fp8", formats=("mxfp4",),
                               runs_on=backends.ROUTES["xla_fp8"].runs_on, packed_rhs_gemm=spy)
    want = _grads(policy, "activation_weight", True, True, monkeypatch)
    monkeypatch.setitem(backends.ROUTES, "xla_fp8", fake)
    p8 = policy.with_backend("xla_fp8")
    assert saves_packed(p8.dgrad) and saves_packed(p8.wgrad)
    got = _grads(p8, "activation_weight", True, True, monkeypatch)
    chex.assert_trees_all_equal(got, want)
    assert ("cpu", "dgrad", "MXArray") in calls and ("cpu", "wgrad", "MXArray") in calls, calls


def test_the_registry_refuses_a_packed_rhs_for_a_route_without_it(monkeypatch):
    recipe = policies.get("mxfp4_all").with_backend("xla_fp8").wgrad
    a = jnp.ones((8, 64), jnp.float32)
    dims = Dims(*canonical_dimension_numbers(0))
    q = pack_rhs(jnp.ones((16, 64), jnp.float32), dims, recipe, None).q
    monkeypatch.setitem(backends.ROUTES, "xla_fp8",
                        dataclasses.replace(backends.ROUTES["xla_fp8"], packed_rhs_gemm=None))
    with pytest.raises(ValueError, match="'xla_fp8' has no packed_rhs_gemm"):
        backends.run_packed_rhs_gemm(a, q, b_shape=(16, 64), dims=dims, recipe=recipe, key=None,
                                     gemm_name="wgrad")
