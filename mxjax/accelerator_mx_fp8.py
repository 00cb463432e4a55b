"""MXFP4 GEMMs on FP8 matrix units: the 'xla_fp8' backend (Hopper's fastest MXFP4 route).

Hopper (H100/H200) has FP8 tensor cores but no FP4 ones. An MXFP4 value is an E2M1
element times its block's power of two, ``v = q * 2^s`` (``|q| <= 6``, two significant
bits). Shifted by one power of two per tensor, ``v * 2^-t``, it is exactly an FP8
value whenever its block's scale is within the FP8 format's window of the tensor's
largest block scale ``s_max``:

==========  ==========================  ========================================
carrier     shift ``t``                 exact for blocks with
==========  ==========================  ========================================
E4M3        ``s_max - 6`` (6 * 2^6 <= 448)   ``s >= s_max - 14`` (E4M3 subnormals)
E5M2        ``s_max - 13`` (6 * 2^13 <= 57344) ``s >= s_max - 28``
==========  ==========================  ========================================

so the GEMM of the dequantized operands is ``dot(A8, B8) * 2^(t_a + t_b)``: one FP8
GEMM whose products are exact, with the two tensor factors applied to its f32 result
(XLA folds them into the GEMM as it does the ``fp8`` preset's scales). The operands
are the emulation's in-place operands (`mxjax.accelerator.mx_operand_values`: each
operand quantized where it is, in two fusible passes, Hadamard included), cast to
FP8 instead of bf16 in the second pass: half the bytes the GEMM reads, twice the
matrix rate.

**No silent loss.** Whether every live block (amax > 0, finite) of both operands is
inside its window is known after the first pass (from the block amaxes). If one is
not, the GEMM's result is the emulation's (``lax.cond``; the branch not taken costs
nothing), so the values never depend on the window: they are the emulation's up to
summation order and the FP8 MMA's accumulation (docs/NUMERICS.md states the bound).
A block of NaN or Inf gives NaN where the emulation gives NaN or Inf (E4M3 has no
Inf).

cuBLAS takes E4M3 x E4M3 and the mixed pairs, not E5M2 x E5M2, so the wide window
(E5M2) goes to the lhs (X in fprop, dY in dgrad and wgrad: `mxjax.policies`' operand
order), the narrow one (E4M3) to the rhs (W, and X in wgrad).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from mxjax import _bits, accelerator
from mxjax.formats import E2M1, E4M3, E5M2, ElementFormat
from mxjax.scaling import SR_UNSCALE

__all__ = [
    "CARRIERS",
    "LHS_CARRIER",
    "RHS_CARRIER",
    "Carrier",
    "carrier_window",
    "encode_exact",
    "mx_dot_fp8",
    "mx_gemm_fp8",
    "pallas_operand",
    "takes_fp8_route",
    "window_of_exponents",
]


class Carrier:
    """An FP8 format that carries E2M1 x 2^s values exactly: its dtype and window."""

    def __init__(self, fmt: ElementFormat, dtype):
        self.fmt, self.dtype = fmt, jnp.dtype(dtype)
        # Largest k with max|q| * 2^k <= the carrier's max (the top block's shift).
        self.top = math.floor(math.log2(fmt.max_normal / E2M1.max_normal))
        # Smallest (s - t) whose element grid (min_subnormal(q) * 2^(s - t)) is on the
        # carrier's grid.
        self.lowest = round(math.log2(fmt.min_subnormal / E2M1.min_subnormal))

    @property
    def span(self) -> int:
        """Blocks with scale exponent >= s_max - span are carried exactly."""
        return self.top - self.lowest

    def __repr__(self):
        return f"Carrier({self.fmt.name}, top={self.top}, span={self.span})"


CARRIERS = {"e4m3": Carrier(E4M3, jnp.float8_e4m3fn), "e5m2": Carrier(E5M2, jnp.float8_e5m2)}
LHS_CARRIER = CARRIERS["e5m2"]
RHS_CARRIER = CARRIERS["e4m3"]
_MIN_EXP, _MAX_EXP = -126, 127  # _bits.pow2's range


def takes_fp8_route(recipe) -> bool:
    """Whether the 'xla_fp8' route implements the recipe: MXFP4 (E2M1 elements, E8M0
    scales per 32) on both operands."""
    return all(op.fmt.scale == "e8m0" and op.fmt.block_size == accelerator.MX_BLOCK
               and op.fmt.element == E2M1 and not op.fmt.is_per_tensor
               for op in (recipe.lhs, recipe.rhs))


def carrier_window(amax_bits: jax.Array, op, carrier: Carrier) -> tuple[jax.Array, jax.Array]:
    """(shift t, exact) of one operand from its blocks' amax bits.

    Args:
      amax_bits: uint32 abs bits of every block's amax (any layout).
      op: the operand's OperandRecipe (MXFP4).
      carrier: the FP8 format the values are cast to.
    Returns:
      ``t``: int32 scalar, the tensor's shift (values are carried as ``v * 2^-t``), in
      [-127, 126]; ``exact``: bool scalar, every live finite block is in the window.
    """
    s, nonfinite = op.scheme.exponents(amax_bits, op.scale_rule, op.sr_prescale)
    return window_of_exponents(s, (amax_bits != 0) & ~nonfinite, carrier)


def window_of_exponents(s: jax.Array, live: jax.Array, carrier: Carrier):
    """`carrier_window` from the blocks' scale exponents ``s`` (int32) and which blocks
    are ``live`` (finite scale and some nonzero value)."""
    big = jnp.iinfo(jnp.int32).max
    s_max = jnp.max(jnp.where(live, s, -big))
    s_min = jnp.min(jnp.where(live, s, big))
    t = jnp.clip(s_max - carrier.top, -_MAX_EXP, -_MIN_EXP).astype(jnp.int32)
    # No live block: all values are zero or NaN, carried exactly whatever t.
    exact = (s_min - t >= carrier.lowest) | ~jnp.any(live)
    return t, exact


def encode_exact(v: jax.Array, t: jax.Array, carrier: Carrier) -> jax.Array:
    """``v * 2^-t`` cast to the carrier's dtype (exact where `carrier_window` says so).

    ``v``: f32 MX values (NaN for non-finite blocks); ``t`` an int32 scalar in
    [-127, 126]. The multiply is exact (a power of two, results in the carrier's range).
    """
    return (v * _bits.pow2(-t)).astype(carrier.dtype)


def _apply_pow2(out: jax.Array, e: jax.Array) -> jax.Array:
    """out * 2^e for an int32 scalar e in [-254, 252], as two normal-range multiplies."""
    half = e // 2
    return (out * _bits.pow2(half)) * _bits.pow2(e - half)


def _e2m1_values(codes: jax.Array) -> jax.Array:
    """f32 values of 4-bit E2M1 codes (uint8, one code per element)."""
    mag = (codes & 7).astype(jnp.int32)
    e, m = mag >> 1, (mag & 1).astype(jnp.float32)
    v = jnp.where(e == 0, m * 0.5, (1.0 + m * 0.5) * _bits.pow2(jnp.maximum(e, 1) - 1))
    return jnp.where((codes & 8) != 0, -v, v)


def _unpack(packed: jax.Array, axis: int) -> jax.Array:
    """uint8 codes two per byte along `axis` (the first in the low nibble) -> one per byte."""
    pair = jnp.stack([packed & 15, packed >> 4], axis=axis + 1)
    shape = list(packed.shape)
    shape[axis] *= 2
    return pair.reshape(shape)


def pallas_operand(x2: jax.Array, axis: int, op, *, hadamard_size: int | None, signs, key,
                   carrier: Carrier, interpret: bool = False):
    """One 2-D operand by the one-pass Pallas quantizer, carried in FP8.

    ``mxjax.kernels.fused_quantize`` (rotation, block amax, scale, rounding and packing in
    one read of ``x2``, the f32 values of the GEMMs' canonical operands) writes the codes
    and scale bytes; one elementwise pass turns them into ``q * 2^(s - t)`` in the
    carrier. The codes and scales are `mxjax.quantize`'s bit for bit (the kernel's
    tests), so the values are the emulation's.

    Args:
      x2: ``[R, K]`` (axis 1) or ``[K, C]`` (axis 0), K a multiple of the Hadamard size.
      axis: the contraction axis (0 or 1).
      op: the OperandRecipe (MXFP4).
      hadamard_size, signs: the rotation, or None.
      key: the rounding key (stochastic rounding) or None.
      carrier: the FP8 format.
      interpret: run the kernel in the Pallas interpreter (CPU tests).
    Returns:
      ``(q, (t, exact))``: q of the carrier's dtype, x2's shape with K padded to 32.
    """
    from mxjax.kernels import QuantSpec, fused_quantize  # Pallas: kept out of `import mxjax`

    spec = QuantSpec(recipe=op, hadamard=hadamard_size)
    kw = {"row": spec, "row_signs": signs, "row_key": key} if axis == 1 else {
        "col": spec, "col_signs": signs, "col_key": key}
    row_q, col_q = fused_quantize(x2, interpret=interpret, value_dtype=jnp.float32, **kw)
    q = row_q if axis == 1 else col_q
    codes = _unpack(q.codes, axis)
    scale = q.scales.astype(jnp.int32)
    s = jnp.repeat(scale, accelerator.MX_BLOCK, axis=axis) - 127
    nonzero = jnp.max((q.codes & 0x77).reshape(_blocks_shape(q.codes.shape, axis)),
                      axis=axis + 1) != 0
    t, exact = window_of_exponents(scale - 127, nonzero & (scale != 255), carrier)
    shift = jnp.clip(s - t, _MIN_EXP, _MAX_EXP)
    v = _e2m1_values(codes) * _bits.pow2(shift)
    v = jnp.where(jnp.repeat(scale == 255, accelerator.MX_BLOCK, axis=axis), jnp.nan, v)
    return v.astype(carrier.dtype), (t, exact)


def _blocks_shape(packed_shape, axis: int):
    """The packed codes' shape with `axis` split into (blocks, 16 bytes)."""
    shape = list(packed_shape)
    nb = shape[axis] // (accelerator.MX_BLOCK // 2)
    return tuple(shape[:axis]) + (nb, accelerator.MX_BLOCK // 2) + tuple(shape[axis + 1:])


def _as_2d(view) -> tuple[jax.Array, int] | None:
    """view.x as [rows, K] (axis 1) or [K, cols] (axis 0), or None when K is in the middle."""
    x, p = view.x, view.axis
    if p == x.ndim - 1:
        return x.reshape(-1, x.shape[p]), 1
    if p == 0:
        return x.reshape(x.shape[0], -1), 0
    return None


def mx_gemm_fp8(a: jax.Array, b: jax.Array, dims, recipe, k_lhs, k_rhs, signs, *,
                operand_dtypes=None, out_dtype=None, quantizer: str = "xla",
                interpret: bool = False) -> jax.Array:
    """``dot_general(a, b, dims)`` under an MXFP4 recipe on FP8 GEMMs: f32, lax's layout.

    Same operands, keys and rotation as `mxjax.accelerator.mx_gemm` (form 'gpu'), whose
    result it returns when an operand's blocks span more than its carrier's window.

    Args:
      a, b: the GEMM's operands (any float dtype), ``dims`` lax dimension numbers.
      recipe: a GemmRecipe that `takes_fp8_route`.
      k_lhs, k_rhs: the rounding keys (stochastic rounding) or None.
      signs: the Hadamard's ±1 vector or None.
      operand_dtypes: None or a pair of dtypes (or None) a and b are cast to first.
      out_dtype: the f32 result is cast to this in both branches (None: f32), so that
        XLA fuses the cast and the factors into the GEMM instead of writing f32 out of
        the conditional.
      quantizer: 'xla' (`mxjax.accelerator.mx_operand_values`' two fusible passes) or
        'pallas' (`pallas_operand`: the one-pass kernel, then one decode pass) for
        operands whose contraction is their first or last axis (others take 'xla').
      interpret: the Pallas quantizer in the interpreter (CPU tests).
    Returns:
      ``[batch..., lhs free..., rhs free...]`` (f32 or out_dtype), times each operand's
      SR unscale.
    """
    if not takes_fp8_route(recipe):
        raise ValueError(f"recipe: the 'xla_fp8' backend takes MXFP4 x MXFP4, got "
                         f"{recipe.lhs.fmt.name} x {recipe.rhs.fmt.name}")
    a, b = accelerator.cast_operands(a, b, operand_dtypes)
    (ca, cb), (ba, bb) = dims
    va, vb = accelerator.contraction_view(a, ba, ca), accelerator.contraction_view(b, bb, cb)
    k = va.x.shape[va.axis]
    h = None if recipe.hadamard is None else recipe.hadamard.block_size
    kw = {"k_out": k if h is None else -(-k // h) * h, "hadamard_size": h, "signs": signs}
    ops = ((va, recipe.lhs, k_lhs, LHS_CARRIER), (vb, recipe.rhs, k_rhs, RHS_CARRIER))
    if quantizer not in ("xla", "pallas"):
        raise ValueError(f"quantizer: expected 'xla' or 'pallas', got {quantizer!r}")
    encoded = []
    for view, op, key, carrier in ops:
        flat = _as_2d(view) if quantizer == "pallas" else None
        if flat is not None:
            x2, axis = flat
            pad = kw["k_out"] - x2.shape[axis]
            if pad:
                x2 = jnp.pad(x2, [(0, pad) if i == axis else (0, 0) for i in range(2)])
            q, extra = pallas_operand(x2, axis, op, hadamard_size=h, signs=signs, key=key,
                                      carrier=carrier, interpret=interpret)
            q = lax.slice_in_dim(q, 0, kw["k_out"], axis=axis)
            shape = list(view.x.shape)
            shape[view.axis] = kw["k_out"]
            encoded.append((q.reshape(shape), extra))
            continue

        def finish(v, amax_bits, op=op, carrier=carrier):
            t, exact = carrier_window(amax_bits, op, carrier)
            return encode_exact(v, t, carrier), (t, exact)

        encoded.append(accelerator.mx_operand_values(view, op, key=key, finish=finish, **kw))
    (qa, (ta, exact_a)), (qb, (tb, exact_b)) = encoded
    contract = (((va.axis,), (vb.axis,)), (va.batch, vb.batch))

    def fp8(a, b):
        del a, b
        out = lax.dot_general(qa, qb, contract, precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
        out = _apply_pow2(out, ta + tb)
        for op in (recipe.lhs, recipe.rhs):
            if op.sr_prescale:
                out = out * jnp.float32(SR_UNSCALE)
        return out if out_dtype is None else out.astype(out_dtype)

    def emulated(a, b):
        out = accelerator.mx_gemm(a, b, dims, recipe, k_lhs, k_rhs, signs, form="gpu")
        return out if out_dtype is None else out.astype(out_dtype)

    return lax.cond(exact_a & exact_b, fp8, emulated, a, b)


def mx_dot_fp8(lhs_q, rhs_q) -> jax.Array:
    """f32 [lhs free, rhs free] (or batched): `mxjax.kernels.mx_dot` of two MXFP4 MXArrays
    by the 'xla_fp8' route (the dot of the dequantized operands at HIGHEST where a block
    is outside its carrier's window)."""
    from mxjax.quantization import dequantize  # the MXArray API, above this module

    def operand(q, carrier):
        scale = q.scales.astype(jnp.int32)
        nb = scale.shape[q.axis]
        v = dequantize(q, jnp.float32)
        blocks = _bits.f32_bits(jnp.where(jnp.isnan(v), 0.0, v)) & _bits.ABS_MASK
        pad = nb * accelerator.MX_BLOCK - v.shape[q.axis]
        blocks = jnp.pad(blocks, [(0, pad if i == q.axis else 0) for i in range(v.ndim)])
        shape = blocks.shape[:q.axis] + (nb, accelerator.MX_BLOCK) + blocks.shape[q.axis + 1:]
        nonzero = jnp.max(blocks.reshape(shape), axis=q.axis + 1) != 0
        t, exact = window_of_exponents(scale - 127, nonzero & (scale != 255), carrier)
        return encode_exact(v, t, carrier), t, exact, v

    qa, ta, exact_a, va = operand(lhs_q, LHS_CARRIER)
    qb, tb, exact_b, vb = operand(rhs_q, RHS_CARRIER)
    nbatch = len(lhs_q.shape) - 2
    batch = tuple(range(nbatch))
    dims = (((lhs_q.axis,), (rhs_q.axis,)), (batch, batch))

    def fp8(qa, qb, va, vb):
        out = lax.dot_general(qa, qb, dims, precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
        return _apply_pow2(out, ta + tb)

    def reference(qa, qb, va, vb):
        return lax.dot_general(va, vb, dims, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)

    return lax.cond(exact_a & exact_b, fp8, reference, qa, qb, va, vb)
