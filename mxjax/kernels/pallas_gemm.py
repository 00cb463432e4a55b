"""MXFP4 x MXFP4 GEMM as a Pallas kernel: packed E2M1 codes + E8M0 scales in, f32 out.

Tiles over (M, N) on the grid and over K inside the kernel. Each K step loads a
(bm, bk/2) and a (bk/2, bn) tile of packed codes plus their scales, unpacks the
even and odd E2M1 elements, applies the block scales (exactly: power-of-two
multiplies), and accumulates two dots in fp32. The dequantized values have 2
significant bits, so they are exact in bf16 (the GPU dot operand type) and in f32
(the interpreter's). Products are exact; only the fp32 summation order differs
from the reference, hence the tolerance (see GEMM_TOLERANCE_DOC).

On GPU the kernel is lowered through Pallas's Triton backend; on CPU it runs
with interpret=True.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mxjax.kernels import _common as C
from mxjax.kernels.reference import dequant_split

__all__ = ["GEMM_TOLERANCE_DOC", "gemm_error_bound", "mxfp4_matmul_pallas"]

GEMM_TOLERANCE_DOC = (
    "|C_kernel - C_ref| <= 2 * K * 2^-24 * (|A| @ |B|) elementwise, where A and B are the "
    "dequantized operands (exact) and K the contraction length: both are fp32 sums of the "
    "same exact products in different orders, each within gamma_K = K*2^-24/(1-K*2^-24) "
    "of the exact sum (standard summation error bound), valid while no partial sum "
    "overflows or underflows fp32."
)


def gemm_error_bound(abs_product_sum, k: int):
    """The stated tolerance for two correct MXFP4 GEMMs given sum_k |a_mk b_kn| (f64 array)."""
    u = 2.0**-24
    gamma = k * u / (1.0 - k * u)
    return 2.0 * gamma * abs_product_sum


def _gemm_kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, bk: int, nk: int, dot_dtype, precision):
    bm = a_ref.shape[0]
    bn = b_ref.shape[1]
    hk = bk // 2  # packed bytes per K step
    sk = bk // 32  # scales per K step

    def step(k, acc):
        a = a_ref[:, pl.ds(k * hk, hk)]
        sa = sa_ref[:, pl.ds(k * sk, sk)]
        b = b_ref[pl.ds(k * hk, hk), :]
        sb = sb_ref[pl.ds(k * sk, sk), :]
        a_even, a_odd = dequant_split(a, sa, axis=1)
        b_even, b_odd = dequant_split(b, sb, axis=0)
        dot = functools.partial(
            jnp.dot, preferred_element_type=jnp.float32, precision=precision
        )
        acc = acc + dot(a_even.astype(dot_dtype), b_even.astype(dot_dtype))
        return acc + dot(a_odd.astype(dot_dtype), b_odd.astype(dot_dtype))

    acc = lax.fori_loop(0, nk, step, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc


def mxfp4_matmul_pallas(
    a_codes: jnp.ndarray,
    a_scales: jnp.ndarray,
    b_codes: jnp.ndarray,
    b_scales: jnp.ndarray,
    *,
    m: int,
    n: int,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 256,
    interpret: bool | None = None,
    num_warps: int = 8,
    num_stages: int = 3,
) -> jnp.ndarray:
    """f32[m, n] = dequant(A) @ dequant(B) from packed MXFP4 operands.

    Args:
      a_codes: uint8[M, Kp/2], E2M1 pairs packed along K (low nibble first).
      a_scales: uint8[M, Kp/32] E8M0.
      b_codes: uint8[Kp/2, N], packed along K.
      b_scales: uint8[Kp/32, N].
      m, n: logical output size (M, N may be larger; extra rows/cols are dropped).
      block_m, block_n, block_k: preferred tile sizes (powers of two, block_k >= 32).
      interpret: run the Pallas interpreter (default: unless the backend is GPU).
    """
    if interpret is None:
        interpret = C.default_interpret()
    kp = a_codes.shape[1] * 2
    if b_codes.shape[0] * 2 != kp:
        raise ValueError(
            f"b_codes: packed K {b_codes.shape[0]} does not match a_codes' {a_codes.shape[1]}"
        )
    bm = C.tile(a_codes.shape[0], block_m, 16)
    bn = C.tile(b_codes.shape[1], block_n, 16)
    bk = C.tile(kp, block_k, 32)
    mp, np_ = C.round_up(a_codes.shape[0], bm), C.round_up(b_codes.shape[1], bn)
    kpp = C.round_up(kp, bk)
    # Zero codes contribute nothing whatever their scale; 127 is the scale 1.
    a_codes = C.pad2(a_codes, mp, kpp // 2)
    a_scales = C.pad2(a_scales, mp, kpp // 32, 127)
    b_codes = C.pad2(b_codes, kpp // 2, np_)
    b_scales = C.pad2(b_scales, kpp // 32, np_, 127)

    if interpret:
        dot_dtype, precision, params = jnp.float32, lax.Precision.HIGHEST, None
    else:
        from jax.experimental.pallas import triton as plt

        dot_dtype, precision = jnp.bfloat16, None
        params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)

    kernel = functools.partial(
        _gemm_kernel, bk=bk, nk=kpp // bk, dot_dtype=dot_dtype, precision=precision
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        grid=(mp // bm, np_ // bn),
        in_specs=[
            pl.BlockSpec((bm, kpp // 2), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, kpp // 32), lambda i, j: (i, 0)),
            pl.BlockSpec((kpp // 2, bn), lambda i, j: (0, j)),
            pl.BlockSpec((kpp // 32, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=params,
        name="mxfp4_matmul",
    )(a_codes, a_scales, b_codes, b_scales)
    return out[:m, :n]
