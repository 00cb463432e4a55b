"""Kernel correctness on a CUDA GPU (compiled, not interpreted). Run by bench/device/gpu.py.

Same contracts as the interpret-mode tests: fused quantize bit-identical to
mxjax.quantize (on the same GPU), the packed-operand GEMMs of the routes that run here
within the stated tolerance of the XLA reference, NaN rows propagate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import OperandRecipe
from mxjax import formats as F
from mxjax.backends import capabilities, mx_dot
from mxjax.kernels import QuantSpec, fused_quantize
from tests.mxjax.kernels._kernel_testutil import (
    BLOCKED_BY_LAX_ROUND,
    assert_gemm_close,
    assert_same_mx,
    hadamard,
    hard_matrix,
    quantize,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu",
                       reason="needs a CUDA GPU (bench/device/gpu.py runs these on a GPU)"),
]


def _kernels_here():
    caps = capabilities()
    return [b for b in ("xla_fp8", "triton") if caps.can_run(b)]


def test_capabilities_on_gpu():
    caps = capabilities()
    assert caps.platform == "gpu" and caps.compute_capability is not None
    print(caps)


@BLOCKED_BY_LAX_ROUND
@pytest.mark.parametrize("h", [None, 16, 32])
def test_fused_quantize_bit_exact(np_rng, h):
    x = jnp.asarray(hard_matrix(np_rng, (1024, 2048)), jnp.bfloat16)
    spec = QuantSpec(recipe=OperandRecipe(fmt=F.MXFP4, scale_rule="even"), hadamard=h)
    signs = mxjax.fixed_signs(0, h) if h else None
    row, col = jax.jit(lambda v: fused_quantize(v, row=spec, col=spec, row_signs=signs,
                                                col_signs=signs))(x)
    xr = hadamard(x, h, axis=1, signs=signs) if h else x
    xc = hadamard(x, h, axis=0, signs=signs) if h else x
    assert_same_mx(row, quantize(xr, F.MXFP4, axis=1, scale_rule="even"))
    assert_same_mx(col, quantize(xc, F.MXFP4, axis=0, scale_rule="even"))


@BLOCKED_BY_LAX_ROUND
def test_fused_quantize_stochastic(np_rng):
    x = jnp.asarray(hard_matrix(np_rng, (512, 1024)))
    spec = QuantSpec(recipe=OperandRecipe(fmt=F.MXFP4, rounding="stochastic"))
    k = jax.random.key(3)
    row, _ = fused_quantize(x, row=spec, row_key=k)
    assert_same_mx(row, quantize(x, F.MXFP4, axis=1, rounding="stochastic", key=k))


@pytest.mark.parametrize("shape", [(512, 384, 1024), (300, 200, 700)])
def test_gemm_backends_within_tolerance(np_rng, shape):
    m, n, k = shape
    a = hard_matrix(np_rng, (m, k), spread=3.0, specials=False)
    b = hard_matrix(np_rng, (k, n), spread=3.0, specials=False)
    a[5, 17] = np.nan
    lq = quantize(jnp.asarray(a), F.MXFP4, axis=1, scale_rule="even")
    rq = quantize(jnp.asarray(b), F.MXFP4, axis=0, scale_rule="even")
    f = jax.jit(mx_dot, static_argnames="backend")
    ref = f(lq, rq, backend="xla")
    backends = _kernels_here()
    assert "xla_fp8" in backends
    for backend in backends:
        assert_gemm_close(f(lq, rq, backend=backend), ref, lq, rq, k)


def test_batched_xla_fp8(np_rng):
    a = jnp.asarray(np_rng.standard_normal((4, 128, 256)), jnp.float32)
    b = jnp.asarray(np_rng.standard_normal((4, 64, 256)), jnp.float32)
    lq, rq = quantize(a, F.MXFP4), quantize(b, F.MXFP4)
    f = jax.jit(functools.partial(mx_dot, backend="xla_fp8"))
    out = np.asarray(f(lq, rq))
    ref = np.asarray(mx_dot(lq, rq, backend="xla"))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("e2m1_cvt", [False, True])
@pytest.mark.parametrize("shape", [(256, 384), (4096, 4096)])
def test_fp4_operand_pair_is_the_xla_forms_on_device(np_rng, shape, e2m1_cvt):
    """The 'xla_fp4' route's one-pass kernel, compiled: both directions' NVFP4 operands
    (elements, E4M3 scales, shift, exactness) equal the XLA form's on the same GPU, and
    the packed nibble order survives XLA's u8 -> f4e2m1fn bitcast there; with PTX's cvt
    to E2M1 (Blackwell only: the route's conversion there) as with the integer one."""
    from mxjax import policies
    from mxjax.chips import target_chip
    from mxjax.emulation import in_place
    from mxjax.routes import xla_fp4
    from mxjax.routes.xla_fp4_kernel import has_e2m1_cvt

    if e2m1_cvt and not has_e2m1_cvt(target_chip("gpu").compute_capability):
        pytest.skip("PTX's cvt.rn.satfinite.e2m1x2.f32 needs sm_100a or later")
    op = policies.get("mxfp4_all_h16").fprop.lhs
    x = jnp.asarray(hard_matrix(np_rng, shape, spread=3.0, specials=False), jnp.bfloat16)
    for axis in (1, 0):
        def both(x, axis=axis):
            got = xla_fp4.kernel_operand(x, axis, op, hadamard_size=16, signs=None,
                                         k_out=x.shape[axis], pair=True, e2m1_cvt=e2m1_cvt)
            view = in_place.contraction_view(x, (), (axis,))
            want = xla_fp4.in_place_operand(view, op, None, k_out=x.shape[axis],
                                            hadamard_size=16, signs=None)
            return got, want

        (q, sc, t, exact), (q2, sc2, t2, exact2) = jax.jit(both)(x)
        assert bool(exact) and bool(exact2) and int(t) == int(t2)
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint4)),
                                      np.asarray(jax.lax.bitcast_convert_type(q2, jnp.uint4)))
        np.testing.assert_array_equal(np.asarray(sc).view(np.uint8),
                                      np.asarray(sc2).view(np.uint8))


@pytest.mark.parametrize("axis", [1, 0])
def test_nvfp4_stochastic_rounding_in_the_kernel_is_the_xla_forms_on_device(np_rng, axis):
    """The NVFP4 kernel's in-kernel draws (threefry from the key, PTX's division),
    compiled: dY's codes, scale bytes and tensor scale are `nvfp4_operand`'s (the XLA
    form's: jax.random.uniform of the canonical operand) on the same GPU; axis 0 with
    wgrad's fixed-sign H16."""
    from mxjax import policies
    from mxjax.routes import xla_nvfp4, xla_nvfp4_kernel

    op = policies.get("nvfp4").wgrad.lhs
    h = 16 if axis == 0 else None
    signs = mxjax.fixed_signs(0, 16) if h else None
    x = jnp.asarray(hard_matrix(np_rng, (4096, 1024), spread=3.0, specials=False),
                    jnp.bfloat16)
    key = jax.random.key(9)

    def both(x, key):
        got = xla_nvfp4_kernel.nvfp4_operand(x, axis, op, hadamard_size=h, signs=signs,
                                             compiled=True, key=key)
        x3 = (x if axis == 1 else x.T).astype(jnp.float32)[None]
        if h:
            x3 = mxjax.hadamard(x3, h, axis=-1, signs=signs)
        want = xla_nvfp4.nvfp4_operand(x3, op, key)
        return got, want

    (codes, scales, t), (e, sc, t2) = jax.jit(both)(x, key)
    assert int(jax.lax.bitcast_convert_type(t, jnp.uint32)) == int(
        jax.lax.bitcast_convert_type(t2, jnp.uint32))
    k = np.asarray(scales).shape[1]
    np.testing.assert_array_equal(np.asarray(scales),
                                  np.asarray(sc).view(np.uint8)[0, :, :k])
    want_codes = np.asarray(jax.lax.bitcast_convert_type(e, jnp.uint4))[0].reshape(
        e.shape[1], -1, 2)
    got_codes = np.asarray(codes)
    np.testing.assert_array_equal(got_codes & 0xF, want_codes[:, :k * 8, 0])
    np.testing.assert_array_equal(got_codes >> 4, want_codes[:, :k * 8, 1])


@pytest.mark.parametrize("f8_cvt", [False, True])
def test_mxfp8_kernel_is_the_in_place_form_on_device(np_rng, f8_cvt):
    """The 'xla_mxfp8' route's one-pass kernel, compiled, in both directions of a pair,
    with PTX's FP8 cvt (the route's conversion from sm_89 on) and without: the f8 codes
    and E8M0 bytes of the in-place XLA form on the same GPU."""
    from mxjax import policies
    from mxjax.chips import target_chip
    from mxjax.emulation import in_place
    from mxjax.routes import xla_mxfp8
    from mxjax.routes.xla_mxfp8_kernel import has_f8_cvt

    if f8_cvt and not has_f8_cvt(target_chip("gpu").compute_capability):
        pytest.skip("PTX's cvt.rn.satfinite.e4m3x2.f32 needs sm_89 or later")
    op = policies.get("mxfp8").fprop.lhs
    x = jnp.asarray(hard_matrix(np_rng, (4096, 4096), spread=3.0, specials=False),
                    jnp.bfloat16)
    for axis in (1, 0):
        def both(x, axis=axis):
            got = xla_mxfp8.kernel_operand(x, axis, op, hadamard_size=None, signs=None,
                                           pair=True, f8_cvt=f8_cvt)
            view = in_place.contraction_view(x, (), (axis,))
            want = xla_mxfp8.in_place_operand(view, op, None, k_out=x.shape[axis],
                                              hadamard_size=None, signs=None)
            return got, want

        (q, sc), (q2, sc2) = jax.jit(both)(x)
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8),
                                      np.asarray(q2).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(sc).view(np.uint8),
                                      np.asarray(sc2).view(np.uint8))
