"""MXFP4 GEMMs on Blackwell's block-scaled FP4 MMA, through XLA's NVFP4 block-scaled dot.

XLA lowers ``jax.nn.scaled_matmul`` to cuDNN's block-scaled MMA
(``__cudnn$blockScaledDot``) on B200 for two operand configurations only: MXFP8 (f8
elements, ``float8_e8m0fnu`` scales per 32) and NVFP4 (``float4_e2m1fn`` elements,
``float8_e4m3fn`` scales per 16). MXFP4 (E2M1 elements, E8M0 scales per 32) is not one of
them: XLA expands it into a dequantize and an f32 dot (no FP4 tensor core). This module
runs MXFP4 exactly on the NVFP4 configuration.

**Re-encoding.** An MXFP4 value is ``c * 2^e`` (``c`` an E2M1 code, ``e`` its block's E8M0
exponent, 32 elements along K). With one integer shift ``s`` per operand, each 32-block
becomes two 16-blocks with the same E4M3 scale ``2^(e - s)``, and the GEMM's result is
multiplied by ``2^(s_a + s_b)``. E4M3 holds the powers of two ``2^-9 .. 2^8`` (18
binades; ``2^-9 .. 2^-7`` are its subnormals), so the re-encoding is exact for every
block with ``e - s`` in ``[-9, 8]``. ``s = e_max - 8`` (``e_max`` the largest exponent
of a live block: one with a nonzero code and a scale byte other than NaN's 0xFF), so
the window covers the live blocks whose exponents lie within 17 of the largest: an
operand is exact unless its live blocks span more than 18 binades.

* Blocks whose codes are all zero (mxjax's all-zero blocks, scale byte 127) hold ±0
  under any scale: their E4M3 scale is ``2^(e - s)`` clipped into the window.
* NaN blocks (scale byte 0xFF) get E4M3's NaN (0x7F): the same NaN values.
* A live block below the window cannot be represented: it is never rounded. Its E4M3
  scale is NaN (0x7F), the operand's ``exact`` is False, and
  :func:`fp4_block_scaled_dot` computes that GEMM by the emulation instead
  (``lax.cond``; a caller of :func:`fp4_operand` who ignores ``exact`` sees NaN, not a
  wrong value). An operand with a NaN block also takes the emulation there: what
  the MMA makes of a NaN scale is not checked without a device.

**The GEMM.** :func:`fp4_block_scaled_dot` quantizes both canonical operands with
mxjax's own quantizer (bit for bit `mxjax.quantize`), re-encodes them and, when both
are exact and free of NaN blocks, returns ``scaled_matmul(...) * 2^(s_a + s_b)`` (the
power of two applied with integer bit operations, `mxjax._bits.ldexp`: exact wherever
the result is a normal f32). Otherwise (an operand whose live blocks span more than 18
binades, or one holding a NaN block) it returns the emulation: both operands
dequantized to f32 and one ``dot_general`` at HIGHEST (``lax.cond``: the emulation
runs only then). Under ``vmap`` JAX turns the cond into a select and both branches
run. On a GPU, XLA's conditional reads its predicate on the host (a wait on the
stream) unless it runs inside a CUDA graph; its cost is not measured here.

Deviceless compiles (``tests/accelerators/test_deviceless_fp4_mma.py``): on B200 the
fast branch is ``__cudnn$blockScaledDot`` on f4e2m1fn operands; on H200 (no
block-scaled MMA) XLA expands it into a dequantize and an f32 dot.

Not wired into `mxjax.gemm`'s dispatch here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from mxjax import _bits
from mxjax.layout import canonical_dimension_numbers
from mxjax.quantization import MXArray, dequantize, quantize_with
from mxjax.scaling import SR_UNSCALE

__all__ = [
    "E4M3_POW2_RANGE",
    "e4m3_pow2_bits",
    "fp4_block_scaled_dot",
    "fp4_operand",
    "reencode",
    "takes_mxfp4",
]

_MX_BLOCK = 32
_NV_BLOCK = 16
# The powers of two E4M3 holds: 2^-9 (smallest subnormal, 0x01) .. 2^8 (0x78).
E4M3_POW2_RANGE = (-9, 8)
_E4M3_NAN = 0x7F
_E8M0_NAN = 0xFF


def _mxfp4(op) -> bool:
    return (op.fmt.element is not None and op.fmt.element.name == "e2m1"
            and op.fmt.scale == "e8m0" and op.fmt.block_size == _MX_BLOCK)


def takes_mxfp4(recipe) -> bool:
    """Whether both operands of the GEMM recipe are MXFP4 (E2M1, E8M0 scales per 32)."""
    return _mxfp4(recipe.lhs) and _mxfp4(recipe.rhs)


def e4m3_pow2_bits(j: jax.Array) -> jax.Array:
    """E4M3 bit patterns (int32) of 2^j for int32 j in [-9, 8]."""
    return jnp.where(j >= -6, (j + 7) << 3, jnp.left_shift(1, jnp.maximum(j + 9, 0)))


def reencode(codes: jax.Array, scale_bytes: jax.Array):
    """MXFP4 codes and E8M0 scale bytes re-encoded as NVFP4-layout operands.

    Args:
      codes: uint8 ``[..., Kp // 2]``: E2M1 codes two per byte, the first element in
        the low nibble (`mxjax.MXArray`'s layout, block axis last); Kp a multiple of 32.
      scale_bytes: uint8 ``[..., Kp // 32]``: E8M0 bytes (2^(byte - 127), 0xFF NaN).
    Returns:
      ``(elements, scales, s, exact)``: ``float4_e2m1fn [..., Kp]`` (the same codes),
      ``float8_e4m3fn [..., Kp // 16]`` (``2^(e - s)`` for both halves of each 32-block;
      NaN for NaN blocks and for live blocks outside the window), the shift ``s``
      (int32 scalar, 0 when no block is live) and ``exact`` (bool scalar: every live
      block is in the window). ``elements * scales * 2^s`` equals the MXFP4 values
      exactly when ``exact``.
    """
    codes = jnp.asarray(codes)
    scale_bytes = jnp.asarray(scale_bytes)
    if codes.dtype != jnp.uint8 or scale_bytes.dtype != jnp.uint8:
        raise TypeError(f"codes, scale_bytes: expected uint8, got {codes.dtype}, "
                        f"{scale_bytes.dtype}")
    if codes.ndim < 1 or codes.shape[:-1] != scale_bytes.shape[:-1] or (
            codes.shape[-1] != scale_bytes.shape[-1] * (_MX_BLOCK // 2)):
        raise ValueError(f"codes, scale_bytes: expected [..., Kp // 2] and [..., Kp // 32], "
                         f"got {codes.shape} and {scale_bytes.shape}")
    lead, nb = scale_bytes.shape[:-1], scale_bytes.shape[-1]
    # Unpacked with integer ops (not a u8 -> f4 bitcast, whose nibble order is XLA's).
    c = jnp.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(lead + (nb, _MX_BLOCK))
    live = (scale_bytes != _E8M0_NAN) & jnp.any((c & 0x07) != 0, axis=-1)
    e = scale_bytes.astype(jnp.int32) - 127
    lo, hi = E4M3_POW2_RANGE
    e_max = jnp.max(jnp.where(live, e, jnp.int32(-(1 << 20))), initial=-(1 << 20))
    s = jnp.where(jnp.any(live), e_max - hi, 0).astype(jnp.int32)
    j = e - s
    in_window = (j >= lo) & (j <= hi)
    exact = jnp.all(in_window | ~live)
    bits = e4m3_pow2_bits(jnp.clip(j, lo, hi))
    bits = jnp.where((scale_bytes == _E8M0_NAN) | (live & ~in_window), _E4M3_NAN, bits)
    scales = jnp.repeat(bits.astype(jnp.uint8), _MX_BLOCK // _NV_BLOCK, axis=-1)
    elements = lax.bitcast_convert_type(
        c.reshape(lead + (nb * _MX_BLOCK,)).astype(jnp.uint4), jnp.float4_e2m1fn)
    return elements, lax.bitcast_convert_type(scales, jnp.float8_e4m3fn), s, exact


def _quantized(x3: jax.Array, op, key) -> MXArray:
    if not _mxfp4(op):
        raise ValueError(f"op: expected an MXFP4 operand recipe, got {op!r}")
    if x3.ndim < 2:
        raise ValueError(f"x3: expected [batch..., F, K], got shape {x3.shape}")
    return quantize_with(x3, op, -1, key=key)


def _operand(q: MXArray):
    f, half = q.codes.shape[-2:]
    return reencode(q.codes.reshape(-1, f, half), q.scales.reshape(-1, f, q.scales.shape[-1]))


def fp4_operand(x3: jax.Array, op, key):
    """A canonical operand quantized to MXFP4 by `mxjax.quantize`, re-encoded for NVFP4's MMA.

    Args:
      x3: f32/bf16 ``[batch..., F, K]`` (the canonical layout, contraction last).
      op: its OperandRecipe (MXFP4: E2M1 elements, E8M0 scales per 32).
      key: the rounding key (stochastic rounding) or None.
    Returns:
      ``(elements, scales, s, exact)`` (see :func:`reencode`): ``float4_e2m1fn [B, F,
      Kp]``, ``float8_e4m3fn [B, F, Kp // 16]``, int32 scalar, bool scalar; B the
      product of the batch axes, Kp K padded with zeros to 32.
    """
    return _operand(_quantized(x3, op, key))


def _emulated(qa: MXArray, qb: MXArray) -> jax.Array:
    """Dequantized f32 operands, one f32 dot_general at HIGHEST: [B, Fa, Fb]."""
    av = dequantize(qa, jnp.float32)
    bv = dequantize(qb, jnp.float32)
    av = av.reshape((-1,) + av.shape[-2:])
    bv = bv.reshape((-1,) + bv.shape[-2:])
    return lax.dot_general(av, bv, canonical_dimension_numbers(1),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _on_mma(qa: MXArray, qb: MXArray, exact_a, exact_b) -> jax.Array:
    """Whether the GEMM takes the block-scaled MMA: both operands exact, no NaN block.

    NaN blocks (E4M3 NaN scales) never reach the MMA: how Blackwell's block-scaled MMA
    treats a NaN scale byte (its NVFP4 scales are unsigned UE4M3) is not checked here.
    """
    no_nan = ~jnp.any(qa.scales == _E8M0_NAN) & ~jnp.any(qb.scales == _E8M0_NAN)
    return exact_a & exact_b & no_nan


def _block_scaled(ops, sr_unscale: int) -> jax.Array:
    """scaled_matmul of re-encoded operands, times 2^(s_a + s_b): [B, Fa, Fb]."""
    (ae, asc, sa), (be, bsc, sb), _ = ops
    out = jax.nn.scaled_matmul(ae, be, asc, bsc, preferred_element_type=jnp.float32)
    out = _bits.ldexp(out, sa + sb)
    for _ in range(sr_unscale):
        out = out * jnp.float32(SR_UNSCALE)
    return out


def fp4_block_scaled_dot(a3: jax.Array, b3: jax.Array, recipe, k_lhs, k_rhs) -> jax.Array:
    """The MXFP4 GEMM of canonical operands on NVFP4's block-scaled dot: f32 [batch..., Fa, Fb].

    Args:
      a3: ``[batch..., Fa, K]``, b3: ``[batch..., Fb, K]`` (f32/bf16, contraction last,
        already rotated by the recipe's Hadamard if it has one).
      recipe: a GemmRecipe with two MXFP4 operands.
      k_lhs, k_rhs: the operands' rounding keys (stochastic rounding) or None.
    Returns:
      ``scaled_matmul(f4, f4, e4m3, e4m3) * 2^(s_a + s_b)`` (times the SR 4/3 unscale of
      each operand that has it) when both operands are exact and hold no NaN block;
      otherwise (some operand's live blocks span more than 18 binades, or it holds a NaN
      block) the emulation: the dequantized operands in f32 and one ``dot_general`` at
      HIGHEST (``lax.cond``).
    """
    if not takes_mxfp4(recipe):
        raise ValueError(f"recipe: expected MXFP4 operands, got {recipe!r}")
    if a3.ndim != b3.ndim or a3.shape[:-2] != b3.shape[:-2] or a3.shape[-1] != b3.shape[-1]:
        raise ValueError(f"a3, b3: expected [batch..., Fa, K] and [batch..., Fb, K], got "
                         f"{a3.shape} and {b3.shape}")
    qa = _quantized(a3, recipe.lhs, k_lhs)
    qb = _quantized(b3, recipe.rhs, k_rhs)
    ops_a, ops_b = _operand(qa), _operand(qb)
    sr_unscale = int(qa.sr_prescale) + int(qb.sr_prescale)
    out = lax.cond(_on_mma(qa, qb, ops_a[3], ops_b[3]),
                   functools.partial(_block_scaled, sr_unscale=sr_unscale),
                   lambda ops: _emulated(*ops[2]),
                   (ops_a[:3], ops_b[:3], (qa, qb)))
    return out.reshape(a3.shape[:-2] + (a3.shape[-2], b3.shape[-2]))
