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

**The route** ('xla_fp4', :func:`mx_gemm_fp4`, which `mxjax.gemm` dispatches to): the same
re-encoding applied to the emulation's in-place operands (`mxjax.emulation.in_place`), laid
out ``[B, F, K]`` for the block-scaled dot, with `mxjax.routes.xla_fp8`'s cond; the
result's factor ``2^(t_a + t_b)`` is applied after the cond, where XLA fuses it into the
result's consumers. Lowered for a GPU, the operands come from one Pallas kernel each
(`mxjax.routes.xla_fp4_kernel`: one read, both directions; :func:`kernel_operand`), the
same bits as the XLA form's.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from mxjax import _bits
from mxjax.chips import Chip, target_chip
from mxjax.emulation import in_place
from mxjax.layout import canonical_dimension_numbers
from mxjax.operands import rotation_signs, split_key
from mxjax.quantization import MXArray, dequantize, quantize_with
from mxjax.routes import xla_fp8
from mxjax.routes.spec import (
    Route,
    check_canonical_operand,
    in_place_route_gemm,
    in_place_route_packed_rhs_gemm,
)
from mxjax.scaling import SR_UNSCALE

__all__ = [
    "E4M3_POW2_RANGE",
    "NVFP4_PRODUCT_EXPONENTS",
    "ROUTE",
    "e4m3_pow2_bits",
    "fp4_block_scaled_dot",
    "fp4_operand",
    "in_place_operand",
    "kernel_operand",
    "kernel_pack_input",
    "kernel_packed",
    "kernel_view",
    "mx_gemm_fp4",
    "mx_gemm_fp4_packed_rhs",
    "packed_operand",
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


# The 'xla_fp4' route: the emulation's in-place operands (mxjax.emulation.in_place), written as
# NVFP4 for the block-scaled dot.

def _fp4_finish(v, amax_bits, op):
    """`mx_operand_values`' finish for the NVFP4 carrier: E2M1 elements (f4) and per-16 E4M3
    scales ``2^(s - t)`` in the bit view, with (t, exact)."""
    lo, hi = E4M3_POW2_RANGE
    s, nonfinite = op.scheme.exponents(amax_bits, op.scale_rule, op.sr_prescale)
    live = (amax_bits != 0) & ~nonfinite
    big = jnp.iinfo(jnp.int32).max
    s_max = jnp.max(jnp.where(live, s, -big))
    t = jnp.where(jnp.any(live), s_max - hi, 0).astype(jnp.int32)
    # Exact: every live block's 2^(s - t) an E4M3 power of two, its elements E2M1 values
    # times a normal-range 2^s (no NaN block: those take the emulation).
    ok = (s - t >= lo) & (s >= xla_fp8.MIN_EXP) & (s <= xla_fp8.MAX_EXP - 1)
    exact = jnp.all(ok | ~live) & ~jnp.any(nonfinite)
    q = v * _bits.pow2(jnp.clip(-s, xla_fp8.MIN_EXP, xla_fp8.MAX_EXP))
    bits = e4m3_pow2_bits(jnp.clip(s - t, lo, hi)).astype(jnp.uint8)
    return q.astype(jnp.float4_e2m1fn), (lax.bitcast_convert_type(bits, jnp.float8_e4m3fn),
                                         t, exact)


def mx_gemm_fp4(a: jax.Array, b: jax.Array, dims, recipe, k_lhs, k_rhs, signs, *,
                operand_dtypes=None, out_dtype=None, kernel: bool = False,
                e2m1_cvt: bool = False, interpret: bool = False) -> jax.Array:
    """``dot_general(a, b, dims)`` under an MXFP4 recipe on the NVFP4 block-scaled dot.

    The operands are quantized in place by the emulation's GPU form (as `mx_gemm_fp8`'s),
    written as E2M1 elements with per-16 E4M3 scales ``2^(s - t)`` (`mxjax.routes.xla_fp4`'s
    window: ``s >= s_max - 17``), laid out ``[B, F, K]`` and contracted by
    ``jax.nn.scaled_matmul`` (cuDNN's FP4 MMA on Blackwell), times ``2^(t_a + t_b)``. An
    operand with a block outside the window, a NaN block or a scale beyond 2^+-126 takes
    the emulation's result (``lax.cond``).

    ``kernel``: quantize each operand by the one-pass kernel (`kernel_operand`: one read,
    E2M1 codes and scales written in the ``[B, F, K]`` layout) where it takes the
    operand (`kernel_view`: no batch axes, the free axes on one side of the contraction;
    `mxjax.routes.xla_fp4_kernel.takes_kernel`), else by the XLA form; the same values
    either way. `mxjax.gemm` sets it when lowering for a GPU, and ``e2m1_cvt`` (the
    kernel converts by PTX's ``cvt.rn.satfinite.e2m1x2.f32``) where the chip has that
    instruction. ``interpret`` runs the kernel in the Pallas interpreter (CPU tests).

    Returns:
      ``[B, Fa, Fb]`` (batch and free axes flattened), f32 or out_dtype.
    """
    a0, b0 = a, b  # before the operand casts: the kernel rounds an f32 operand to bf16 itself
    a, b, va, vb, h = xla_fp8.in_place_views(a, b, dims, recipe, operand_dtypes, "xla_fp4")
    k_pad = _k_pad(va.x.shape[va.axis], h)
    (ca, cb), (ba, bb) = dims
    da, db = operand_dtypes or (None, None)
    operand = functools.partial(_route_operand, recipe=recipe, h=h, signs=signs, k_pad=k_pad,
                                kernel=kernel, e2m1_cvt=e2m1_cvt, interpret=interpret)
    ops_a = operand(va, recipe.lhs, k_lhs, a0, ba, ca, da)
    ops_b = operand(vb, recipe.rhs, k_rhs, b0, bb, cb, db)

    def emulated(a, b):
        out = in_place.mx_gemm(a, b, dims, recipe, k_lhs, k_rhs, signs, form="gpu",
                               operand_dtypes=operand_dtypes, out_dtype=out_dtype,
                               row_chunks=xla_fp8.FALLBACK_ROW_CHUNKS)
        return out.reshape(ops_a[0].shape[0], ops_a[0].shape[1], ops_b[0].shape[1])

    # The operands as given (the emulation casts them): no cast pass outside its branch.
    return _fp4_gemm(ops_a, ops_b, recipe, out_dtype, k_pad, emulated, (a0, b0))


def _k_pad(k: int, h: int | None) -> int:
    """The whole padded contraction: a multiple of 32 (NVFP4 scales cover 16 elements)
    and of the Hadamard size."""
    n_bits = max(5, 0 if h is None else h.bit_length() - 1)
    return -(-k // (1 << n_bits)) << n_bits


def _route_operand(cast_view, op, key, x, batch, contract, dtype, *, recipe, h, signs, k_pad,
             kernel, e2m1_cvt, interpret):
    """One operand of `mx_gemm_fp4`: by the one-pass kernel where it takes it, else in place."""
    bf16_values = (dtype is not None and jnp.dtype(dtype) == jnp.bfloat16
                   and x.dtype == jnp.float32)
    # The kernel reads an f32 operand cast to bf16 as it is and rounds it itself.
    view = in_place.contraction_view(x, batch, contract) if bf16_values else cast_view
    x2 = kernel_view(view) if kernel else None
    if x2 is not None and _takes_kernel(op, h, x2[0].dtype):
        # Randomized signs differ per GEMM: no other GEMM makes the same pair call.
        fixed_signs = recipe.hadamard is None or not recipe.hadamard.randomized
        return kernel_operand(*x2, op, hadamard_size=h, signs=signs, k_out=k_pad,
                              pair=fixed_signs and _pairable(x2[0], h),
                              bf16_values=bf16_values, e2m1_cvt=e2m1_cvt,
                              interpret=interpret)
    return in_place_operand(cast_view, op, key, k_out=k_pad, hadamard_size=h, signs=signs)


def _fp4_gemm(ops_a, ops_b, recipe, out_dtype, k_pad, emulated, operands) -> jax.Array:
    """The block-scaled dot of two carried operands times ``2^(t_a + t_b)``, or
    ``emulated(*operands)`` where either is not exact (``lax.cond``): ``[B, Fa, Fb]``."""
    (qa, sa, ta, exact_a), (qb, sb, tb, exact_b) = ops_a, ops_b
    narrow = xla_fp8.narrow_result(recipe, out_dtype)
    exact = exact_a & exact_b
    if narrow:  # cuDNN writes bf16 itself: 2 bytes per result, not 4 and a pass
        exact = exact & xla_fp8.narrow_result_exact(ta + tb, k_pad, NVFP4_PRODUCT_EXPONENTS)

    shift = ta + tb
    sr = any(op.sr_prescale for op in (recipe.lhs, recipe.rhs))
    result_dtype = jnp.bfloat16 if narrow else jnp.float32

    def fp4(*_):
        out = jax.nn.scaled_matmul(qa, qb, sa, sb, preferred_element_type=result_dtype)
        if sr:
            return xla_fp8.scaled_result(out.astype(jnp.float32), shift, recipe, out_dtype)
        return out if out_dtype is None else out.astype(out_dtype)

    out = lax.cond(exact, fp4, emulated, *operands)
    if sr:
        return out
    # 2^(t_a + t_b) applied after the conditional (1 for the emulation's result), where XLA
    # fuses it into the result's consumers; exact: a power of two on results that stay
    # normal (narrow_result_exact's bound for bf16, the carriers' for f32).
    return xla_fp8.scaled_result(out, jnp.where(exact, shift, 0), recipe, out_dtype)


def mx_gemm_fp4_packed_rhs(a: jax.Array, q: MXArray, b_shape, dims, recipe, k_lhs, signs, *,
                           operand_dtype=None, out_dtype=None, kernel: bool = False,
                           e2m1_cvt: bool = False, interpret: bool = False) -> jax.Array:
    """`mx_gemm_fp4` with its rhs given quantized: the same result, bit for bit.

    Args:
      a: the lhs as `mx_gemm_fp4` takes it (cast to ``operand_dtype`` first if given).
      q: the rhs's canonical MXFP4 operand ``[batch..., Fb, K]`` (the primal ``b`` of
        shape ``b_shape`` in the canonical layout, rotated by the recipe's Hadamard,
        quantized along K with the rhs key: a quantized residual), read by the
        block-scaled dot as it is (`packed_operand`) and by the emulation's branch as
        b's values (`mxjax.emulation.in_place.mx_gemm_packed_rhs`).
      dims: lax dimension numbers of ``dot_general(a, b)``.
    Returns:
      ``[B, Fa, Fb]``, f32 or out_dtype.
    """
    if not takes_mxfp4(recipe):
        raise ValueError(f"recipe: the 'xla_fp4' backend takes MXFP4 x MXFP4, got "
                         f"{recipe.lhs.fmt.name} x {recipe.rhs.fmt.name}")
    a0 = a
    if operand_dtype is not None:
        a = a.astype(operand_dtype)
    (ca, _), (ba, _) = dims
    va = in_place.contraction_view(a, ba, ca)
    h = None if recipe.hadamard is None else recipe.hadamard.block_size
    k_pad = _k_pad(va.x.shape[va.axis], h)
    ops_b = packed_operand(q)
    if ops_b[0].shape[-1] != k_pad:
        raise ValueError(f"q: its contraction padded to 32 is {ops_b[0].shape[-1]}, the lhs's "
                         f"{k_pad}")
    ops_a = _route_operand(va, recipe.lhs, k_lhs, a0, ba, ca, operand_dtype, recipe=recipe, h=h,
                     signs=signs, k_pad=k_pad, kernel=kernel, e2m1_cvt=e2m1_cvt,
                     interpret=interpret)

    def emulated(a):
        out = in_place.mx_gemm_packed_rhs(a, q, b_shape, dims, recipe, k_lhs, signs,
                                          operand_dtype=operand_dtype, out_dtype=out_dtype,
                                          row_chunks=xla_fp8.FALLBACK_ROW_CHUNKS)
        return out.reshape(ops_a[0].shape[0], ops_a[0].shape[1], ops_b[0].shape[1])

    return _fp4_gemm(ops_a, ops_b, recipe, out_dtype, k_pad, emulated, (a0,))


# The NVFP4 operands' products: nonzero magnitudes in [2^lo, 2^hi) (E2M1's 0.5 times E4M3's
# 2^-9 on each side; 6 * 2^8 < 2^11).
NVFP4_PRODUCT_EXPONENTS = (-20, 22)


def in_place_operand(view, op, key, *, k_out: int, hadamard_size: int | None, signs):
    """One operand of `mx_gemm_fp4`: (E2M1 elements ``[B, F, k_out]``, E4M3 scales
    ``[B, F, k_out // 16]``, its shift t, exact), quantized in place (`mx_operand_values`).

    ``k_out`` is the contraction padded to a multiple of 32 and of the Hadamard size.
    """
    q, (scales, t, exact) = in_place.mx_operand_values(
        view, op, key=key, finish=functools.partial(_fp4_finish, op=op), k_out=k_out,
        hadamard_size=hadamard_size, signs=signs, split_halves=False)
    # Scales: one per 32-block in the bit view, repeated for its two 16-halves.
    scales = jnp.repeat(scales.reshape(_block_shape(view, k_out)), 2, axis=view.axis)
    return (in_place.canonical_layout(q, view, k_out),
            in_place.canonical_layout(scales, view, k_out // 16), t, exact)


def _takes_kernel(op, h, dtype) -> bool:
    from mxjax.routes import xla_fp4_kernel as kernel  # Pallas: loaded on first use

    return kernel.takes_kernel(op, h, dtype)


def kernel_view(view):
    """``(x2, axis)``: the operand as the 2-D input of `kernel_operand`; None where the view
    has batch axes or free axes on both sides of its contraction."""
    if view.batch:
        return None
    shape, p = view.x.shape, view.axis
    pre, post = math.prod(shape[:p]), math.prod(shape[p + 1:])
    if post == 1:
        return view.x.reshape(pre, shape[p]), 1
    if pre == 1:
        return view.x.reshape(shape[p], post), 0
    return None


def kernel_operand(x2: jax.Array, axis: int, op, *, hadamard_size: int | None, signs,
                   k_out: int, pair: bool = False, bf16_values: bool = False,
                   e2m1_cvt: bool = False, interpret: bool = False):
    """`in_place_operand`'s result for a 2-D operand by the one-pass kernel
    (`mxjax.routes.xla_fp4_kernel`): the same elements, scales, shift and exactness.

    Args:
      x2: bf16/f32 ``[F, K]`` (axis 1) or ``[K, F]`` (axis 0).
      k_out: K padded to a multiple of 32 and of the Hadamard size (zeros).
      pair: quantize x2 along both axes in one kernel (`mxfp4_operand_pair`) and take
        this axis' copy: the GEMM that contracts x2 along the other axis with the same
        operand recipe and signs makes the identical kernel call, which XLA merges (CSE).
        Needs both sizes of x2 multiples of 32 and of the Hadamard size.
      bf16_values: the operand is ``x2.astype(bfloat16)``, rounded in the kernel.
      e2m1_cvt: the kernel converts by PTX's cvt (`xla_fp4_kernel.has_e2m1_cvt`).
    Returns:
      ``(elements f4e2m1fn [1, F, k_out], scales f8e4m3fn [1, F, k_out // 16], t, exact)``.
    """
    from mxjax.routes import xla_fp4_kernel as kernel  # Pallas: loaded on first use

    codes, scale_bytes, s_max, s_min = _kernel_codes(
        x2, axis, op, hadamard_size=hadamard_size, signs=signs, k_out=k_out, pair=pair,
        bf16_values=bf16_values, e2m1_cvt=e2m1_cvt, interpret=interpret)
    nonfinite = s_max == kernel.NONFINITE_SENTINEL
    f = codes.shape[0]
    return _carried(codes.reshape(1, f, -1), scale_bytes.reshape(1, f, -1), s_max, s_min,
                    nonfinite)


def _kernel_codes(x2, axis, op, *, hadamard_size, signs, k_out, pair, bf16_values, e2m1_cvt,
                  interpret):
    """`kernel_operand`'s kernel call: (codes ``[F, k_out // 2]``, per-16 E8M0 scale bytes
    ``[F, k_out // 16]``, s_max, s_min) (`xla_fp4_kernel.mxfp4_operand`)."""
    from mxjax.routes import xla_fp4_kernel as kernel  # Pallas: loaded on first use

    if pair:
        halves = kernel.mxfp4_operand_pair(x2, op, hadamard_size=hadamard_size, signs=signs,
                                           bf16_values=bf16_values, e2m1_cvt=e2m1_cvt,
                                           interpret=interpret)
        return halves[0] if axis == 1 else halves[1]
    if k_out != x2.shape[axis]:
        widths = [(0, 0), (0, 0)]
        widths[axis] = (0, k_out - x2.shape[axis])
        x2 = jnp.pad(x2, widths)
    return kernel.mxfp4_operand(x2, axis, op, hadamard_size=hadamard_size, signs=signs,
                                bf16_values=bf16_values, e2m1_cvt=e2m1_cvt, interpret=interpret)


def kernel_packed(x2: jax.Array, axis: int, op, *, hadamard_size: int | None, signs,
                  pair: bool = True, bf16_values: bool = False, e2m1_cvt: bool = False,
                  interpret: bool = False) -> MXArray:
    """The canonical MXFP4 operand of a 2-D ``x2`` contracted along ``axis``, by the
    one-pass kernel: ``mxjax.quantize_with`` of x2 laid out ``[F, K]`` (rotated by the
    Hadamard of size `hadamard_size` with `signs`, K zero-padded to it), bit for bit.

    With ``pair``, where x2's sizes allow it, the kernel quantizes x2 in both directions
    (`kernel_operand`'s ``pair``): the forward GEMM reading x2 along its other axis with
    the same recipe and signs makes the same call, and XLA computes both in one read.
    ``bf16_values``: the operand is ``x2.astype(bfloat16)``, rounded in the kernel.
    Returns an MXArray of shape ``[F, K']`` (K' the contraction padded to the Hadamard
    size), blocked along axis 1.
    """
    h = hadamard_size
    k = x2.shape[axis]
    k_logical = k if h is None else -(-k // h) * h
    k_out = _k_pad(k, h)
    codes, scale_bytes, _, _ = _kernel_codes(
        x2, axis, op, hadamard_size=h, signs=signs, k_out=k_out,
        pair=pair and k_out == k and _pairable(x2, h), bf16_values=bf16_values, e2m1_cvt=e2m1_cvt,
        interpret=interpret)
    return MXArray(codes, scale_bytes[:, ::_MX_BLOCK // _NV_BLOCK], None,
                   (x2.shape[1 - axis], k_logical), 1, op.fmt, bool(op.sr_prescale))


def _carried(codes, scale_bytes, s_max, s_min, nonfinite):
    """(elements, scales, t, exact) of `in_place_operand` from an operand's MXFP4 codes and
    per-16 E8M0 scale bytes ``[B, F, K // 2]``, ``[B, F, K // 16]``: the shift t puts the
    largest live block at the top of E4M3's window (`_fp4_finish`'s rule, from the live
    blocks' largest and smallest exponents; with no live block ``s_max < s_min``)."""
    lo, hi = E4M3_POW2_RANGE
    any_live = s_min <= s_max
    t = jnp.where(any_live & ~nonfinite, s_max - hi, 0).astype(jnp.int32)
    exact = ~nonfinite & (~any_live | (
        (s_min - t >= lo) & (s_min >= xla_fp8.MIN_EXP) & (s_max <= xla_fp8.MAX_EXP - 1)))
    s = scale_bytes.astype(jnp.int32) - 127
    bits = e4m3_pow2_bits(jnp.clip(s - t, lo, hi)).astype(jnp.uint8)
    scales = lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
    # XLA's sub-byte order: the first element in the low nibble, as mxjax packs.
    elements = lax.bitcast_convert_type(codes, jnp.float4_e2m1fn)
    return elements.reshape(codes.shape[:-1] + (-1,)), scales, t, exact


def packed_operand(q: MXArray):
    """`in_place_operand`'s result for an operand already quantized canonically: (E2M1
    elements ``[B, F, Kp]``, E4M3 scales ``[B, F, Kp // 16]``, t, exact), B the product of
    q's batch axes, F its free size, Kp its contraction padded to 32.

    ``q``: the canonical MXFP4 operand (`mxjax.quantize_with` along its last axis of
    ``[batch..., F, K]``, the recipe's Hadamard applied), e.g. a quantized residual. Its
    live blocks are those whose input was not all zeros: a nonzero code, or a scale other
    than an all-zero block's 1 (a block of inputs so small that every code rounds to zero
    has its exponent clamped at -127; the in-place form counts it live, and so does this).
    """
    check_canonical_operand(q, "MXFP4", lambda fmt: fmt.name == "mxfp4")
    f = q.shape[-2]
    codes = q.codes.reshape(-1, f, q.codes.shape[-1])
    scale_bytes = q.scales.reshape(-1, f, q.scales.shape[-1])
    c = jnp.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(scale_bytes.shape + (-1,))
    nan = scale_bytes == _E8M0_NAN
    live = ~nan & ((scale_bytes != 127) | jnp.any((c & 0x07) != 0, axis=-1))
    s = scale_bytes.astype(jnp.int32) - 127
    big = jnp.int32(1 << 20)
    s_max = jnp.max(jnp.where(live, s, -big))
    s_min = jnp.min(jnp.where(live, s, big))
    per16 = jnp.repeat(scale_bytes, _MX_BLOCK // _NV_BLOCK, axis=-1)
    return _carried(codes, per16, s_max, s_min, jnp.any(nan))


def _pairable(x2, h) -> bool:
    step = max(in_place.MX_BLOCK, h or 1)
    return all(n % step == 0 for n in x2.shape)


def _block_shape(view, k_pad):
    """view.x's shape with K replaced by its number of 32-blocks."""
    shape = list(view.x.shape)
    shape[view.axis] = k_pad // in_place.MX_BLOCK
    return tuple(shape)


def _kernel_options(platform) -> dict:
    """`mx_gemm_fp4`'s kernel settings for lowering `platform`: on a GPU the one-pass operand
    kernel ('xla_fp8' keeps XLA's two passes: on an H200 a one-pass Pallas kernel for its
    operands ran 3x (row) to 10x (column) slower), converting by PTX's cvt where the chip
    has it."""
    if platform != "gpu":
        return {}
    from mxjax.routes.xla_fp4_kernel import has_e2m1_cvt  # Pallas: on first use

    return {"kernel": True, "e2m1_cvt": has_e2m1_cvt(target_chip("gpu").compute_capability)}


def _gemm(a, b, *, dims, recipe, key, gemm_name, operand_dtypes=None, out_dtype=None,
          platform=None) -> jax.Array:
    del gemm_name
    route = functools.partial(mx_gemm_fp4, **_kernel_options(platform))
    return in_place_route_gemm(route, a, b, dims=dims, recipe=recipe, key=key,
                               operand_dtypes=operand_dtypes, out_dtype=out_dtype)


def _packed_rhs_gemm(a, packed_q, *, b_shape, dims, recipe, key, gemm_name,
                     operand_dtypes=None, out_dtype=None, platform=None) -> jax.Array:
    """``Route.packed_rhs_gemm``: `_gemm` with the rhs given quantized (a packed residual)."""
    del gemm_name
    route = functools.partial(mx_gemm_fp4_packed_rhs, **_kernel_options(platform))
    return in_place_route_packed_rhs_gemm(route, a, packed_q, b_shape=b_shape, dims=dims,
                                          recipe=recipe, key=key,
                                          operand_dtypes=operand_dtypes, out_dtype=out_dtype)


def kernel_pack_input(b, *, dims, recipe, key, operand_dtype, takes_recipe, takes_kernel):
    """What a route's one-pass kernel reads to pack the rhs `b` of the GEMM `dims`
    (``Route.pack_rhs``): ``(x2, axis, hadamard_size, signs, bf16_values)`` for the kernel
    call, or None where ``takes_recipe(recipe)`` (the route's formats) or
    ``takes_kernel(op, h, dtype)`` refuses the operand or it is not 2-D-viewable
    (`kernel_view`). An f32 `b` cast to bf16 is read as it is and rounded by
    the kernel (``bf16_values``), as the forward GEMM's operand is."""
    if not takes_recipe(recipe):
        return None
    (_, cb), (_, bb) = dims
    bf16_values = (operand_dtype is not None and jnp.dtype(operand_dtype) == jnp.bfloat16
                   and b.dtype == jnp.float32)
    if operand_dtype is not None and not bf16_values:
        b = b.astype(operand_dtype)
    x2 = kernel_view(in_place.contraction_view(b, bb, cb))
    h = None if recipe.hadamard is None else recipe.hadamard.block_size
    if x2 is None or not takes_kernel(recipe.rhs, h, x2[0].dtype):
        return None
    _, _, k_had = split_key(key)
    signs = None if h is None else rotation_signs(recipe.hadamard, k_had)
    return x2[0], x2[1], h, signs, bf16_values


def _pack_rhs(b, *, dims, recipe, key, operand_dtype=None,
              interpret: bool = False) -> MXArray | None:
    """``Route.pack_rhs`` (lowering for a GPU): the rhs of the GEMM `dims` as
    `mxjax.residuals.pack_rhs` makes it, by the one-pass kernel (`kernel_packed`), paired
    with the forward GEMM's call on the same operand; None where the kernel does not take
    the operand (batch axes, free axes on both sides of the contraction, stochastic
    rounding, ...). ``interpret``: the Pallas interpreter (CPU tests)."""
    read = kernel_pack_input(b, dims=dims, recipe=recipe, key=key,
                             operand_dtype=operand_dtype, takes_recipe=takes_mxfp4,
                             takes_kernel=_takes_kernel)
    if read is None:
        return None
    x2, axis, h, signs, bf16_values = read
    return kernel_packed(x2, axis, recipe.rhs, hadamard_size=h, signs=signs,
                         pair=not recipe.hadamard or not recipe.hadamard.randomized,
                         bf16_values=bf16_values, interpret=interpret,
                         e2m1_cvt=not interpret and _kernel_options("gpu")["e2m1_cvt"])


def _runs_on(chip: Chip) -> str:
    # XLA's block-scaled dot: cuDNN's FP4 MMA on Blackwell; XLA:CPU expands it (tests).
    cc = chip.compute_capability
    if chip.platform == "cpu" or (chip.platform == "gpu" and not chip.is_amd
                                  and cc is not None and cc >= (10, 0)):
        return ""
    kind = chip.device_kind
    return (f"needs block-scaled FP4 MMA reached by XLA (cuDNN, NVIDIA Blackwell sm_100+); "
            f"device is {kind or 'unknown'!r}"
            + (" (an unknown GPU: trace under the target's abstract mesh)"
               if chip.platform == "gpu" and not kind else ""))


ROUTE = Route(
    name="xla_fp4",
    summary=("MXFP4 re-encoded exactly as NVFP4 for XLA's block-scaled dot (cuDNN's FP4 MMA "
             "on Blackwell)"),
    formats=("mxfp4",),
    runs_on=_runs_on,
    gemm=_gemm,
    packed_dot=None,
    evidence=("layer_8b.b200.rates_roofline",),
    packed_rhs_gemm=_packed_rhs_gemm,
    pack_rhs=_pack_rhs,
)
