"""The Hopper path's E2M1 -> E4M3 re-encoding, bit for bit (pure jnp, CPU).

For every chunk flagged exact, float(e4m3 byte) * 2^(smax - 6) equals the
dequantized MXFP4 value bit for bit; a chunk is flagged exact iff the exponents
of its live (nonzero, non-NaN) blocks span at most 14.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mxjax import formats as F
from mxjax.kernels import mx_dot
from mxjax.kernels.fp8_gemm import CHUNK, MAX_SPAN, reencode_e4m3
from mxjax.quantization import MXArray
from tests.mxjax.kernels._kernel_testutil import assert_gemm_close, dequantize_jit, quantize

reencode = jax.jit(reencode_e4m3, static_argnames="axis")


def _mx(codes, scales, k):
    """An MXFP4 MXArray [rows, k] blocked along axis 1 from raw bytes."""
    return MXArray(jnp.asarray(codes, jnp.uint8), jnp.asarray(scales, jnp.uint8), None,
                   (codes.shape[0], k), 1, F.MXFP4, False)


def _values(e4m3, smax):
    v = np.asarray(e4m3).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return v * np.exp2(np.repeat(np.asarray(smax), CHUNK, axis=1) - 6.0)


def _bits_equal(a, b):
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a32) & np.isnan(b32)
    return nan | (a32.view(np.uint32) == b32.view(np.uint32))


def test_every_code_at_every_exact_offset(np_rng):
    # One row per (offset d in [-14, 0] of a block below its chunk's max): the
    # chunk holds a max block (exponent e0) and a block at e0 + d whose 32
    # elements run through all 16 codes twice; other blocks are all zero.
    rows = []
    scales = []
    e0 = 3
    for d in range(-MAX_SPAN, 1):
        c = np.zeros(CHUNK // 2, np.uint8)
        c[:16] = 0x77  # max block: all ±6 -> live
        codes16 = np.arange(16, dtype=np.uint8)
        c[16:32] = codes16 | (codes16[::-1] << 4)  # second block: every code
        rows.append(c)
        scales.append([127 + e0, 127 + e0 + d, 127 - 60, 127])  # blocks 3, 4 all zero
    codes, scales = np.stack(rows), np.asarray(scales, np.uint8)
    e4m3, smax, exact = reencode(jnp.asarray(codes), jnp.asarray(scales), axis=1)
    assert np.asarray(exact).all()
    np.testing.assert_array_equal(np.asarray(smax)[:, 0], e0)  # zero blocks ignored
    want = dequantize_jit(_mx(codes, scales, CHUNK))
    assert _bits_equal(_values(e4m3, smax), want).all()
    # Signed zeros survive: code 8 (-0) -> E4M3 byte 0x80.
    assert (np.asarray(e4m3)[:, 32 + 16] == 0x80).all()


def test_span_above_14_is_flagged_and_below_is_not():
    codes = np.full((2, CHUNK // 2), 0x11, np.uint8)  # every element 0.5: all blocks live
    scales = np.asarray([[127, 127 - 14, 127, 127], [127, 127 - 15, 127, 127]], np.uint8)
    _, smax, exact = reencode(jnp.asarray(codes), jnp.asarray(scales), axis=1)
    np.testing.assert_array_equal(np.asarray(exact)[:, 0], [True, False])
    np.testing.assert_array_equal(np.asarray(smax)[:, 0], [0, 0])


def test_nan_block_encodes_nan_and_is_ignored_for_the_reference():
    codes = np.full((1, CHUNK // 2), 0x22, np.uint8)
    scales = np.asarray([[255, 100, 101, 102]], np.uint8)
    e4m3, smax, exact = reencode(jnp.asarray(codes), jnp.asarray(scales), axis=1)
    e = np.asarray(e4m3)
    assert (e[0, :32] == 0x7F).all() and np.asarray(exact).all()
    assert int(np.asarray(smax)[0, 0]) == 102 - 127
    assert _bits_equal(_values(e4m3, smax), dequantize_jit(_mx(codes, scales, CHUNK))).all()


def test_random_quantized_data_both_axes(np_rng):
    x = np_rng.standard_normal((24, 300)) * np.exp2(np.round(3 * np_rng.standard_normal((24, 300))))
    x[3, 40] = np.nan

    q = quantize(jnp.asarray(x, jnp.float32), F.MXFP4, axis=1)
    e4m3, smax, exact = reencode(q.codes, q.scales, axis=1)
    assert e4m3.shape == (24, 384) and smax.shape == (24, 3)
    ok = _bits_equal(_values(e4m3, smax)[:, :300], dequantize_jit(q))
    ex = np.repeat(np.asarray(exact), CHUNK, axis=1)[:, :300]
    assert ok[ex].all() and ex.mean() > 0.5
    # Axis 0 is the transpose of axis 1.
    qt = quantize(jnp.asarray(x.T, jnp.float32), F.MXFP4, axis=0)
    e_t, s_t, x_t = reencode(qt.codes, qt.scales, axis=0)
    np.testing.assert_array_equal(np.asarray(e_t).T, np.asarray(e4m3))
    np.testing.assert_array_equal(np.asarray(s_t).T, np.asarray(smax))
    np.testing.assert_array_equal(np.asarray(x_t).T, np.asarray(exact))


@pytest.mark.parametrize("wide", [False, True])
def test_fp8_gemm_with_and_without_fallback_chunks(np_rng, wide):
    m, n, k = 24, 32, 256
    a = np_rng.standard_normal((m, k)).astype(np.float32)
    if wide:  # first chunk: 32-blocks alternating 2^20 apart -> the exact fallback there
        a[:, :CHUNK] *= np.where(np.arange(CHUNK) % 64 < 32, 1.0, 2.0**-20).astype(np.float32)
    b = np_rng.standard_normal((k, n)).astype(np.float32)

    lq = quantize(jnp.asarray(a), F.MXFP4, axis=1)
    rq = quantize(jnp.asarray(b), F.MXFP4, axis=0)
    exact = np.asarray(reencode(lq.codes, lq.scales, axis=1)[2])
    np.testing.assert_array_equal(exact[:, 0], not wide)
    assert exact[:, 1].all()  # mixed tiles: per-chunk choice between FP8 and fallback
    f = jax.jit(mx_dot, static_argnames="backend")
    assert_gemm_close(f(lq, rq, backend="pallas_fp8"), f(lq, rq, backend="xla"), lq, rq, k)
