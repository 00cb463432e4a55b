"""The XLA reference GEMM ('xla' backend) and exact element decoders shared by the kernels.

The reference is the judge: dequantize both operands exactly (mxjax.dequantize)
and contract them with `lax.dot_general` at HIGHEST precision, fp32 accumulation.
E2M1 x E2M1 products scaled by powers of two are exact in fp32, so any two
correct MXFP4 GEMMs differ only by the order of the fp32 summation.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from mxjax import formats as F
from mxjax.elements import decode_magnitude
from mxjax.quantization import MXArray, dequantize

__all__ = ["GEMM_TOLERANCE_DOC", "decode_e2m1", "dequant_split", "e8m0_to_f32", "expand_scales",
           "gemm_error_bound", "mx_dot_reference"]

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



def mx_dot_reference(lhs_q: MXArray, rhs_q: MXArray) -> jnp.ndarray:
    """f32[lhs free, rhs free]: contracts lhs_q.axis with rhs_q.axis of two 2-D MXArrays.

    Any quantized format (MX, NVFP4, per-tensor FP8); exact operands, fp32
    accumulation at HIGHEST precision.
    """
    a = dequantize(lhs_q, jnp.float32)
    b = dequantize(rhs_q, jnp.float32)
    dims = (((lhs_q.axis,), (rhs_q.axis,)), ((), ()))
    return lax.dot_general(
        a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def e8m0_to_f32(b: jnp.ndarray) -> jnp.ndarray:
    """f32 value 2^(b-127) of E8M0 bytes, built from bits.

    Byte 0 gives 2^-127 (an f32 subnormal), 0xFF gives NaN.
    """
    b = b.astype(jnp.int32)
    bits = jnp.where(b == 0, jnp.int32(0x00400000), b << 23)
    bits = jnp.where(b == 255, jnp.int32(0x7FC00000), bits)
    return lax.bitcast_convert_type(bits, jnp.float32)


def decode_e2m1(code: jnp.ndarray) -> jnp.ndarray:
    """Signed f32 value of 4-bit E2M1 codes (the low nibble; sign in bit 3); exact, -0 kept."""
    code = code.astype(jnp.int32) & 0xF
    mag = decode_magnitude(code, F.E2M1)
    return jnp.where((code & 0x8) != 0, -mag, mag)


def expand_scales(s: jnp.ndarray, axis: int, rep: int = 16) -> jnp.ndarray:
    """Repeats each scale `rep` times along `axis` (2-D), by broadcast + reshape."""
    if axis == 1:
        r, nb = s.shape
        return jnp.broadcast_to(s[:, :, None], (r, nb, rep)).reshape(r, nb * rep)
    nb, c = s.shape
    return jnp.broadcast_to(s[:, None, :], (nb, rep, c)).reshape(nb * rep, c)


def dequant_split(codes: jnp.ndarray, scales: jnp.ndarray, axis: int):
    """Dequantizes packed MXFP4 codes into their even and odd elements along `axis`.

    Args:
      codes: uint8 [.., P, ..] packed along `axis` (2-D), P = K/2.
      scales: uint8 E8M0 bytes, K/32 along `axis`.
      axis: 0 or 1, the packed (contraction) axis.
    Returns:
      (even, odd) f32 arrays shaped like `codes`: element 2j and 2j+1 of the
      contraction axis at position j. Packed position j belongs to block j // 16,
      so both halves share the expanded scales. Since a dot sums over K, the
      split order is a valid summation order: dot(a, b) = dot(a_even, b_even)
      + dot(a_odd, b_odd).
    """
    s = expand_scales(e8m0_to_f32(scales), axis)
    even = decode_e2m1(codes & 0xF) * s
    odd = decode_e2m1(codes >> 4) * s
    return even, odd
