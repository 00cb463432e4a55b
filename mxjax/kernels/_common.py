"""Small shared helpers for the kernels (padding, tiling, interpret mode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mxjax.quantization import MXArray


def round_up(n: int, m: int) -> int:
    """Smallest multiple of m that is >= n."""
    return -(-n // m) * m


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def default_interpret() -> bool:
    """Pallas runs compiled only on GPU here; everywhere else it is interpreted."""
    return jax.default_backend() != "gpu"


def pad2(x: jnp.ndarray, rows: int, cols: int, value=0) -> jnp.ndarray:
    """Pads a 2-D array at the end of each axis up to (rows, cols)."""
    pr, pc = rows - x.shape[0], cols - x.shape[1]
    if pr == 0 and pc == 0:
        return x
    return jnp.pad(x, ((0, pr), (0, pc)), constant_values=jnp.asarray(value, x.dtype))


def tile(n: int, preferred: int, minimum: int) -> int:
    """A power-of-two tile for an axis of length n: min(preferred, next_pow2(n)) >= minimum."""
    return max(minimum, min(preferred, next_pow2(n)))


def canonical_operands(lhs_q: MXArray, rhs_q: MXArray):
    """Puts two 2-D MXFP4 operands in the kernels' layout.

    Returns (a_codes u8[M, Kp/2], a_scales u8[M, Kp/32], b_codes u8[Kp/2, N],
    b_scales u8[Kp/32, N], (M, N, K)), where Kp = K padded to the block (32) and
    the contraction runs along lhs_q.axis and rhs_q.axis.
    """
    a_codes, a_scales = lhs_q.codes, lhs_q.scales
    if lhs_q.axis == 0:
        a_codes, a_scales = a_codes.T, a_scales.T
    b_codes, b_scales = rhs_q.codes, rhs_q.scales
    if rhs_q.axis == 1:
        b_codes, b_scales = b_codes.T, b_scales.T
    m = lhs_q.shape[1 - lhs_q.axis]
    n = rhs_q.shape[1 - rhs_q.axis]
    k = lhs_q.shape[lhs_q.axis]
    return a_codes, a_scales, b_codes, b_scales, (m, n, k)
