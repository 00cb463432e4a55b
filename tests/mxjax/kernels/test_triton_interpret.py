"""The 'triton' backend's tl.dot_scaled kernel, run on CPU by Triton's interpreter.

`make test-triton` installs the `triton-interpret` extra and runs this module
with TRITON_INTERPRET=1 (Triton decorates its own library when it is first
imported, so the variable must be set before that: a separate process). The
kernel is `mxjax.kernels.triton_gemm._kernel()`, the very @triton.jit function
the jax-triton path launches, fed by the same `launch_plan` (tiles, padding,
scale transpose, grid). The interpreter gets the numpy arrays through
`_HostArray` (the few tensor methods it calls; no torch needed).

The judge is mxjax's reference GEMM (`mx_dot(..., backend="xla")`) within the
stated tolerance (GEMM_TOLERANCE_DOC), with NaN and ±Inf in the same places,
and an independent float64 decode of the raw bytes.

What the interpreter cannot show: its tl.dot_scaled upcasts to fp32 and calls
np.matmul, so this checks the kernel's indexing, tiling, padding, scale layout
and NaN/Inf handling, not the GPU's MMA (native FP4 on sm_100, bf16 emulation
on sm_90): that is left to tests/mxjax/kernels/test_kernels_gpu.py on a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxjax import formats as F
from mxjax.backends import mx_dot
from mxjax.kernels import _common as C
from mxjax.kernels import gemm_error_bound
from mxjax.quantization import MXArray
from tests.mxjax.kernels._kernel_testutil import (
    assert_gemm_close,
    exact_partial_sum_operands,
    hard_matrix,
    quantize,
)

pytestmark = [
    pytest.mark.triton_interpret,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed (pip install -e '.[triton-interpret]'; "
                              "make test-triton)"),
]


@pytest.fixture(scope="module")
def kernel():
    """The project's @triton.jit kernel as the interpreter sees it (an InterpretedFunction)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("run with TRITON_INTERPRET=1 set before triton is imported (make test-triton): "
                    "triton builds its own library for the interpreter only then")
    from triton.runtime.interpreter import InterpretedFunction

    from mxjax.kernels.triton_gemm import _kernel

    k = _kernel()
    assert isinstance(k, InterpretedFunction), type(k)
    return k


class _HostArray:
    """A contiguous numpy array with the torch-tensor methods Triton's interpreter calls.

    The interpreter copies each pointer argument to host storage and back; the
    array is already on the host, so its storage is itself.
    """

    def __init__(self, array: np.ndarray):
        self.array = np.ascontiguousarray(array)
        self.dtype = self.array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def new_empty(self, *_, **__):
        return _HostArray(np.empty(0, self.dtype))

    def set_(self, storage, offset, size, stride):
        assert offset == 0 and tuple(size) == storage.array.shape
        self.array = storage.array
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def copy_(self, other) -> None:
        if other.array is not self.array:
            np.copyto(self.array, other.array)


def _run(kernel, lhs_q: MXArray, rhs_q: MXArray, **tiles) -> np.ndarray:
    """f32[M, N]: the kernel under the interpreter, launched as mxfp4_matmul_triton does."""
    from mxjax.kernels.triton_gemm import launch_plan

    a, sa, b, sb, (m, n, _) = C.canonical_operands(lhs_q, rhs_q)
    plan = launch_plan(a, sa, b, sb, **tiles)
    out = np.full(plan.out_shape, np.nan, np.float32)  # a tile never stored stays NaN
    kernel[plan.grid](*(_HostArray(np.asarray(x)) for x in plan.args), _HostArray(out),
                      **plan.constants)
    return out[:m, :n]


_reference = jax.jit(functools.partial(mx_dot, backend="xla"))

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _decode_f64(q: MXArray) -> np.ndarray:
    """Exact float64 values [rows, K] of a 2-D MXFP4 array blocked along axis 1 (NaN for 0xFF)."""
    codes = np.asarray(q.codes)
    scales = np.asarray(q.scales).astype(np.float64)
    nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], -1)
    vals = np.where(nib & 8, -1.0, 1.0) * _E2M1[nib & 7]
    s = np.where(scales == 255, np.nan, np.exp2(scales - 127))
    return (vals * np.repeat(s, 32, axis=1))[:, : q.shape[1]]


def _raw_mx(codes: np.ndarray, scales: np.ndarray) -> MXArray:
    """An MXFP4 MXArray [rows, K] blocked along axis 1 from raw code and scale bytes."""
    return MXArray(jnp.asarray(codes, jnp.uint8), jnp.asarray(scales, jnp.uint8), None,
                   (codes.shape[0], codes.shape[1] * 2), 1, F.MXFP4)


def _quantized(rng, m, n, k, lhs_axis=1, rhs_axis=0, *, spread=3.0, specials=False):
    a = hard_matrix(rng, (m, k), spread=spread, specials=specials)
    b = hard_matrix(rng, (k, n), spread=spread, specials=False)
    a = a if lhs_axis == 1 else a.T
    b = b if rhs_axis == 0 else b.T
    return (quantize(jnp.asarray(a), F.MXFP4, axis=lhs_axis, scale_rule="even"),
            quantize(jnp.asarray(b), F.MXFP4, axis=rhs_axis, scale_rule="even"))


# (m, n, k, tiles): tile edge cases of launch_plan (M, N, K not multiples of the
# tiles, one 32-block of K, several K steps, several tiles along M and N).
SHAPES = [
    (37, 45, 300, {"block_m": 16, "block_n": 32, "block_k": 64}),
    (5, 3, 32, {}),
    (16, 16, 64, {"block_m": 16, "block_n": 16, "block_k": 64}),
    (130, 20, 160, {}),
    (33, 70, 512, {"block_m": 32, "block_n": 64, "block_k": 128}),
]


@pytest.mark.parametrize(("m", "n", "k", "tiles"), SHAPES)
@pytest.mark.parametrize(("lhs_axis", "rhs_axis"), [(1, 0), (0, 1)])
def test_random_operands_match_reference(kernel, np_rng, m, n, k, tiles, lhs_axis, rhs_axis):
    lq, rq = _quantized(np_rng, m, n, k, lhs_axis, rhs_axis)
    out = _run(kernel, lq, rq, **tiles)
    assert out.shape == (m, n) and out.dtype == np.float32
    assert_gemm_close(out, _reference(lq, rq), lq, rq, k)


def test_bit_exact_when_every_partial_sum_is_exact(kernel, np_rng):
    # every fp32 partial sum is exact, so any summation order gives the same bits
    lq, rq = exact_partial_sum_operands(np_rng)
    out = _run(kernel, lq, rq, block_m=16, block_n=16, block_k=64)
    ref = np.asarray(_reference(lq, rq))
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


_OVERFLOW_WARNINGS = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")


@_OVERFLOW_WARNINGS
def test_nan_inf_zero_and_saturating_inputs(kernel, np_rng):
    # hard_matrix's specials in A: NaN in row 0, ±Inf in rows 1-2 (their blocks get
    # scale 0xFF, so the whole output row is NaN), f32 subnormals, -0, 3e38 in row 5
    # (saturates to ±6 * 2^125) and an all-zero row 7 (zero blocks, scale byte 127).
    # B is small enough that no product or partial sum overflows fp32.
    m, n, k = 24, 20, 96
    a = hard_matrix(np_rng, (m, k), spread=6.0, specials=True)
    b = hard_matrix(np_rng, (k, n), spread=2.0, specials=False) * np.float32(2.0**-20)
    lq = quantize(jnp.asarray(a), F.MXFP4, axis=1, scale_rule="floor")
    rq = quantize(jnp.asarray(b), F.MXFP4, axis=0, scale_rule="floor")
    assert (np.asarray(lq.scales)[:3, 0] == 255).all()
    assert (np.abs(_decode_f64(lq)[5]) == 6 * 2.0**125).any()
    out = _run(kernel, lq, rq, block_m=16, block_n=16, block_k=64)
    assert np.isnan(out[:3]).all() and np.isfinite(out[3:]).all()
    np.testing.assert_array_equal(out[7], np.zeros(n, np.float32))
    assert_gemm_close(out, _reference(lq, rq), lq, rq, k)


def test_nan_scale_bytes_in_either_operand(kernel, np_rng):
    # A 0xFF scale is NaN even over zero codes (0 * NaN): the row of A / column of B is NaN.
    m, n, k = 8, 12, 128
    a_codes = np_rng.integers(0, 256, (m, k // 2), dtype=np.uint8)
    b_codes = np_rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    a_scales = np_rng.integers(120, 135, (m, k // 32), dtype=np.uint8)
    b_scales = np_rng.integers(120, 135, (n, k // 32), dtype=np.uint8)
    a_scales[2, 3] = 255
    a_codes[2, 48:64] = 0
    b_scales[5, 0] = 255
    lq, rq = _raw_mx(a_codes, a_scales), _raw_mx(b_codes, b_scales)
    rq = MXArray(rq.codes.T, rq.scales.T, None, (k, n), 0, F.MXFP4)  # B as [K, N]
    out = _run(kernel, lq, rq)
    want_nan = np.zeros((m, n), bool)
    want_nan[2, :] = True
    want_nan[:, 5] = True
    np.testing.assert_array_equal(np.isnan(out), want_nan)
    assert_gemm_close(out, _reference(lq, rq), lq, rq, k)


def _assert_within(got, want, bound, what: str) -> None:
    err = np.abs(got - want)
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} over the bound; worst "
                           f"err {err[bad].max()} with bound {bound[bad][np.argmax(err[bad])]}")


def _extreme_bound(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """The stated bound plus what fp32 underflow may lose: a product under 2^-126
    rounds to the subnormal grid (half a step, 2^-150)."""
    return gemm_error_bound(np.abs(a) @ np.abs(b), k) + k * 2.0**-150


@_OVERFLOW_WARNINGS
@pytest.mark.parametrize(("a_range", "b_range"), [
    ((0, 20), (200, 254)), ((0, 20), (0, 20)), ((100, 154), (100, 154)), ((0, 254), (0, 127)),
    ((230, 254), (230, 254)),
], ids=["subnormal_x_huge", "underflow", "mid", "full", "overflow"])
def test_every_code_and_extreme_scale_bytes(kernel, np_rng, a_range, b_range):
    # Raw bytes: all 16 codes in both nibbles, scale bytes over the given ranges
    # (byte 0 is 2^-127, so ±0.5, ±1, ±1.5 there are fp32 subnormals; 254 is 2^127,
    # where 4 * 2^127 is past the fp32 maximum). Where fp32 holds every dequantized
    # element and every partial sum of |products|, the kernel is within the bound of
    # the exact float64 product. Elsewhere fp32 overflows: the kernel must then give
    # Inf/NaN, never a wrong finite number.
    # Against the XLA reference only rows/columns without fp32 subnormals are
    # compared: XLA:CPU flushes subnormal inputs and results of arithmetic to zero,
    # so the reference itself drops those elements (the kernel, like np.matmul,
    # keeps them).
    # (Under overflow the XLA:CPU dot is not IEEE-sequential either: it can return
    # Inf where Inf - Inf makes np.matmul return NaN; not compared.)
    m, n, k = 18, 22, 160
    a_codes = np_rng.integers(0, 256, (m, k // 2), dtype=np.uint8)
    b_codes = np_rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    a_scales = np_rng.integers(a_range[0], a_range[1] + 1, (m, k // 32), dtype=np.uint8)
    b_scales = np_rng.integers(b_range[0], b_range[1] + 1, (n, k // 32), dtype=np.uint8)
    lq = _raw_mx(a_codes, a_scales)
    rq = _raw_mx(b_codes, b_scales)
    out = np.asarray(_run(kernel, lq, rq, block_m=16, block_n=16, block_k=64), np.float64)
    ref = np.asarray(_reference(lq, rq), np.float64)
    a, b = _decode_f64(lq), _decode_f64(rq).T
    exact = a @ b
    bound = _extreme_bound(a, b, k)
    f32_max = float(np.finfo(np.float32).max)
    in_range = ((np.abs(a) <= f32_max).all(axis=1)[:, None]
                & (np.abs(b) <= f32_max).all(axis=0)[None, :]
                & (np.abs(a) @ np.abs(b) <= f32_max))
    overflow_case = a_range[0] + b_range[0] - 254 > 128
    assert overflow_case or in_range.sum() >= m * n // 4
    _assert_within(out[in_range], exact[in_range], bound[in_range], "kernel vs exact")
    tiny = 2.0**-126
    normal = (((np.abs(a) >= tiny) | (a == 0)).all(axis=1)[:, None]
              & ((np.abs(b) >= tiny) | (b == 0)).all(axis=0)[None, :])
    both = in_range & normal
    flushed = k * tiny  # the reference also flushes each product under 2^-126
    _assert_within(out[both], ref[both], 2 * bound[both] + flushed, "kernel vs XLA reference")
    outside = ~in_range & np.isfinite(out)
    _assert_within(out[outside], exact[outside], bound[outside], "finite outputs under overflow")
    if overflow_case:
        assert not np.isfinite(out).any()
