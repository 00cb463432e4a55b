"""MXFP4 GEMMs of packed operands (`mxjax.backends.mx_dot`) against the XLA reference: the
routes with a packed-operand dot that run on CPU ('xla_fp8'; 'triton' runs in
test_triton_interpret.py).

Stated tolerance (mxjax.kernels.GEMM_TOLERANCE_DOC): |C - C_ref| <= 2*K*2^-24 *
(|A| @ |B|) with A, B the dequantized operands. Products of dequantized MXFP4
values are exact in fp32, so two correct GEMMs differ only by fp32 summation
order. All calls jitted; one compile per case.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxjax import formats as F
from mxjax.backends import mx_dot
from mxjax.kernels import gemm_error_bound
from tests.mxjax.kernels._kernel_testutil import (
    assert_gemm_close,
    dequantize_jit,
    exact_partial_sum_operands,
    hard_matrix,
    quantize,
)

KERNELS = ("xla_fp8",)


@functools.partial(jax.jit, static_argnames=("backend", "tiles"))
def _dot(lq, rq, backend, tiles=()):
    return mx_dot(lq, rq, backend=backend, **dict(tiles))


def _operands(rng, m, n, k, lhs_axis, rhs_axis, spread=3.0, specials=False):
    a = hard_matrix(rng, (m, k), spread=spread, specials=specials)
    b = hard_matrix(rng, (k, n), spread=spread, specials=False)
    a = a if lhs_axis == 1 else a.T
    b = b if rhs_axis == 0 else b.T
    return (quantize(jnp.asarray(a), F.MXFP4, axis=lhs_axis, scale_rule="even"),
            quantize(jnp.asarray(b), F.MXFP4, axis=rhs_axis, scale_rule="even"))


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize(("lhs_axis", "rhs_axis"), [(1, 0), (0, 1)])
def test_layouts_odd_sizes_within_tolerance(np_rng, backend, lhs_axis, rhs_axis):
    # K = 300: padded to 320 by quantize; odd M and N.
    m, n, k = 37, 45, 300
    lq, rq = _operands(np_rng, m, n, k, lhs_axis, rhs_axis)
    out = _dot(lq, rq, backend)
    ref = _dot(lq, rq, "xla")
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert_gemm_close(out, ref, lq, rq, k)


@pytest.mark.parametrize("backend", KERNELS)
def test_nan_block_gives_nan_row_not_zero(np_rng, backend):
    # jax.nn.scaled_dot_general('mxfp4') returns 0 for a NaN input row; mxjax must not.
    m, n, k = 24, 16, 128
    lq, rq = _operands(np_rng, m, n, k, 1, 0, specials=True)  # row 0 has a NaN, rows 1-2 Inf
    out = np.asarray(_dot(lq, rq, backend))
    ref = np.asarray(_dot(lq, rq, "xla"))
    assert np.isnan(out[:3]).all() and np.isnan(ref[:3]).all()
    assert_gemm_close(out, ref, lq, rq, k)


@pytest.mark.parametrize("backend", KERNELS)
def test_bit_exact_when_every_partial_sum_is_exact(np_rng, backend):
    # every fp32 partial sum is exact, so any summation order gives the same bits
    lq, rq = exact_partial_sum_operands(np_rng)
    out = np.asarray(_dot(lq, rq, backend))
    ref = np.asarray(_dot(lq, rq, "xla"))
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_reference_is_within_gamma_of_exact_product(np_rng):
    # The tolerance is two summation errors; the reference alone is within one.
    m, n, k = 16, 16, 512
    lq, rq = _operands(np_rng, m, n, k, 1, 0, spread=6.0)
    ref = np.asarray(_dot(lq, rq, "xla"), np.float64)
    a = np.asarray(dequantize_jit(lq), np.float64)
    b = np.asarray(dequantize_jit(rq), np.float64)
    exact = a @ b
    assert (np.abs(ref - exact) <= 0.5 * gemm_error_bound(np.abs(a) @ np.abs(b), k)).all()


@pytest.mark.parametrize("backend", KERNELS)
def test_batched_operands(np_rng, backend):
    a = jnp.asarray(np_rng.standard_normal((2, 3, 20, 70)), jnp.float32)
    b = jnp.asarray(np_rng.standard_normal((2, 3, 24, 70)), jnp.float32)
    lq, rq = quantize(a, F.MXFP4), quantize(b, F.MXFP4)
    out = np.asarray(_dot(lq, rq, backend))
    ref = np.asarray(_dot(lq, rq, "xla"))
    assert out.shape == (2, 3, 20, 24)
    bound = gemm_error_bound(
        np.abs(np.asarray(dequantize_jit(lq), np.float64))
        @ np.swapaxes(np.abs(np.asarray(dequantize_jit(rq), np.float64)), -1, -2), 70)
    assert (np.abs(out - ref) <= bound).all()


def test_xla_backend_takes_other_formats(np_rng):
    a = jnp.asarray(np_rng.standard_normal((8, 64)), jnp.float32)
    b = jnp.asarray(np_rng.standard_normal((64, 8)), jnp.float32)
    lq = quantize(a, F.MXFP8_E4M3, axis=1)
    rq = quantize(b, F.NVFP4, axis=0)
    want = np.asarray(dequantize_jit(lq), np.float64) @ np.asarray(dequantize_jit(rq), np.float64)
    got = np.asarray(mx_dot(lq, rq, backend="xla"), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # 'auto' may route formats its route lacks to 'xla'; an explicit route may not.
    np.testing.assert_array_equal(np.asarray(mx_dot(lq, rq, backend="auto")),
                                  got.astype(np.float32))
    with pytest.raises(ValueError, match="MXFP4 x MXFP4 only"):
        mx_dot(lq, rq, backend="xla_fp8")


def test_argument_errors():
    q = quantize(jnp.ones((4, 64)), F.MXFP4, axis=1)
    q3 = quantize(jnp.ones((4, 32)), F.MXFP4, axis=1)
    with pytest.raises(TypeError, match="lhs_q"):
        mx_dot(jnp.ones((4, 64)), q, backend="xla")
    with pytest.raises(ValueError, match="contraction lengths differ"):
        mx_dot(q, q3, backend="xla")
    with pytest.raises(ValueError, match="backend"):
        mx_dot(q, q, backend="cuda")
    qb = quantize(jnp.ones((2, 4, 64)), F.MXFP4, axis=1)
    with pytest.raises(ValueError, match="last axis"):
        mx_dot(qb, qb, backend="xla")
