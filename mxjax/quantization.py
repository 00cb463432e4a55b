"""Quantize, dequantize and fake-quantize to MX, NVFP4 and per-tensor FP8 formats.

The numerics are specified in docs/NUMERICS.md and tested bit for bit against an
independent numpy reference. Everything is pure `jnp` (jit/vmap friendly); the
element-level helpers (`round_to_grid`, `decode_magnitude`, `e8m0_exponent`) are
shared with the Pallas kernels.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mxjax import _bits
from mxjax import formats as F
from mxjax._platform import cpu_barrier
from mxjax.formats import ElementFormat, Format, Rounding, ScaleRule

__all__ = [
    "FLOAT_DTYPES",
    "MXArray",
    "decode_magnitude",
    "dequantize",
    "e8m0_exponent",
    "fake_quantize",
    "quantize",
    "quantize_mx_blocks",
    "round_to_grid",
]

# The input dtypes the quantizer (and every quantized GEMM) accepts.
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Element format name -> the ml_dtypes dtype of one element (MXArray.dtype).
_ELEMENT_DTYPES = {"e2m1": jnp.float4_e2m1fn, "e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
SR_PRESCALE = 0.75  # Tseng et al.: keep stochastic rounding away from saturation
SR_UNSCALE = 4.0 / 3.0  # dequantize multiplies by fp32(4/3)


# --------------------------------------------------------------------------- #
# Element level (pure, elementwise; reused by kernels)
# --------------------------------------------------------------------------- #
def _round_integer(y, elem: ElementFormat, mode: Rounding, u):
    """(sign bits uint32, unsaturated integer multiple n f32, exponent E int32) of y."""
    bits = _bits.f32_bits(y)
    a = _bits.bits_f32(bits & _bits.ABS_MASK)
    e = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127
    big_e = jnp.clip(e, elem.emin, elem.emax)
    t = a * _bits.pow2(elem.mbits - big_e)  # exact: power-of-two scaling of a normal
    # floor/compare forms only (t >= 0): lax.round has no Pallas-Triton lowering.
    fl = jnp.floor(t)
    fr = t - fl  # exact
    if mode is Rounding.NEAREST_EVEN:
        odd = (fl - 2.0 * jnp.floor(fl * 0.5)) == 1.0
        n = fl + ((fr > 0.5) | ((fr == 0.5) & odd)).astype(jnp.float32)
    elif mode is Rounding.NEAREST_AWAY:
        n = fl + (fr >= 0.5).astype(jnp.float32)
    elif mode is Rounding.TOWARD_ZERO:
        n = fl
    elif mode is Rounding.STOCHASTIC:
        if u is None:
            raise ValueError("u: STOCHASTIC rounding needs uniform random numbers")
        n = fl + (u < fr).astype(jnp.float32)
    else:  # pragma: no cover - enum is closed
        raise ValueError(f"rounding: unsupported {mode!r}")
    return (bits >> 31) << 31, n, big_e


def round_to_grid(
    y: jnp.ndarray, elem: ElementFormat, mode: Rounding, u: jnp.ndarray | None = None
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Rounds finite f32 `y` onto `elem`'s grid, saturating.

    Args:
      y: f32 array, finite; |y| is a normal f32 or zero (smaller values are zero
        after XLA's flush, and would round to zero on every grid anyway).
      elem: element format.
      mode: rounding mode.
      u: f32 uniforms in [0, 1), same shape as y, for STOCHASTIC.
    Returns:
      (sign uint32 0/1, magnitude code int32 in [0, elem.max_code]).
    """
    sign_bits, n, big_e = _round_integer(y, elem, mode, u)
    # Saturate before the int conversion (huge t for values far above max).
    n = jnp.minimum(n, float(2 ** (elem.mbits + 2)))
    code = n.astype(jnp.int32) + ((big_e - elem.emin) << elem.mbits)
    return sign_bits >> 31, jnp.minimum(code, elem.max_code)


def round_to_value(
    y: jnp.ndarray, elem: ElementFormat, mode: Rounding, u: jnp.ndarray | None = None
) -> jnp.ndarray:
    """Like `round_to_grid`, but returns the signed f32 grid value (no codes)."""
    sign_bits, n, big_e = _round_integer(y, elem, mode, u)
    mag = jnp.minimum(n * _bits.pow2(big_e - elem.mbits), jnp.float32(elem.max_normal))
    return _bits.bits_f32(_bits.f32_bits(mag) | sign_bits)


def decode_magnitude(code: jnp.ndarray, elem: ElementFormat) -> jnp.ndarray:
    """f32 magnitude of an element code (sign bit ignored); exact."""
    mag = code.astype(jnp.int32) & (elem.sign_bit - 1)
    field = mag >> elem.mbits
    mant = mag & ((1 << elem.mbits) - 1)
    is_sub = field == 0
    n = jnp.where(is_sub, mant, mant + (1 << elem.mbits)).astype(jnp.float32)
    exp = jnp.where(is_sub, elem.emin, field - 1 + elem.emin) - elem.mbits
    return n * _bits.pow2(exp)


def e8m0_exponent(amax_bits: jnp.ndarray, elem: ElementFormat, rule: ScaleRule) -> jnp.ndarray:
    """Unclamped-then-clamped E8M0 scale exponent from the block amax's abs bits.

    Args:
      amax_bits: uint32 abs bits of the (finite, nonzero) block amax.
    Returns:
      int32 exponent s in [-127, 127]; scale = 2^s.
    """
    exp, frac = _bits.normalize(amax_bits)
    e = exp - 127
    if rule is ScaleRule.FLOOR:
        bump = jnp.zeros_like(e)
    elif rule is ScaleRule.EVEN:
        # m rounded (ties away) to mbits reaches 2  <=>  m >= 2 - 2^-(mbits+1)
        threshold = (1 << 23) - (1 << (23 - elem.mbits - 1))
        bump = (frac >= threshold).astype(jnp.int32)
    elif rule is ScaleRule.CEIL:
        bump = (frac > 0).astype(jnp.int32)
    elif rule is ScaleRule.RCEIL:
        threshold = elem.max_mantissa_code << (23 - elem.mbits)
        bump = (frac > threshold).astype(jnp.int32)
    else:  # pragma: no cover
        raise ValueError(f"scale_rule: unsupported {rule!r}")
    return jnp.clip(e - elem.emax + bump, -127, 127)


def _encode(sign: jnp.ndarray, code: jnp.ndarray, elem: ElementFormat) -> jnp.ndarray:
    return (code | (sign.astype(jnp.int32) * elem.sign_bit)).astype(jnp.uint8)


def _signed_value(code: jnp.ndarray, elem: ElementFormat) -> jnp.ndarray:
    mag = decode_magnitude(code, elem)
    neg = (code.astype(jnp.int32) & elem.sign_bit) != 0
    return jnp.where(neg, -mag, mag)


def _uniforms(key: jax.Array | None, shape: tuple[int, ...]) -> jnp.ndarray:
    return jax.random.uniform(key, shape, jnp.float32)


# --------------------------------------------------------------------------- #
# MXArray
# --------------------------------------------------------------------------- #
@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class MXArray:
    """A quantized array.

    Attributes:
      codes: uint8. E2M1 formats: two codes per byte along `axis` (first element
        in the low nibble), length padded_n // 2 there. FP8 formats: one byte per
        element (the float8 bit pattern), length padded_n.
      scales: uint8 per block along `axis` (E8M0 bytes for MX formats, E4M3 bytes
        for NVFP4), length padded_n // block_size there; None for per-tensor formats.
      tensor_scale: f32 scalar (NVFP4, per-tensor FP8) or None.
      shape: logical (unpadded) shape of the quantized array.
      axis: non-negative block axis.
      fmt: the Format.
      sr_prescale: whether values were multiplied by 3/4 before rounding (dequantize
        divides by 3/4).
    """

    codes: jnp.ndarray
    scales: jnp.ndarray | None
    tensor_scale: jnp.ndarray | None
    shape: tuple[int, ...]
    axis: int
    fmt: Format
    sr_prescale: bool = False

    def tree_flatten(self):
        return (self.codes, self.scales, self.tensor_scale), (
            self.shape,
            self.axis,
            self.fmt,
            self.sr_prescale,
        )

    @classmethod
    def tree_unflatten(cls, aux, children):
        codes, scales, tensor_scale = children
        shape, axis, fmt, sr_prescale = aux
        return cls(codes, scales, tensor_scale, shape, axis, fmt, sr_prescale)

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: codes + scales + tensor scale (padding included)."""
        total = math.prod(self.codes.shape) * 1
        if self.scales is not None:
            total += math.prod(self.scales.shape)
        if self.tensor_scale is not None:
            total += 4
        return total

    @property
    def dtype(self) -> jnp.dtype:
        """The element dtype: float4_e2m1fn (MXFP4, NVFP4), float8_e4m3fn or float8_e5m2.

        What each code holds (before its scale); the format itself is ``fmt``.
        """
        return jnp.dtype(_ELEMENT_DTYPES[self.fmt.element.name])

    def dequantize(self, dtype=jnp.float32) -> jnp.ndarray:
        return dequantize(self, dtype)

    def __repr__(self) -> str:
        return (f"MXArray(fmt={self.fmt!r}, shape={self.shape}, axis={self.axis}, "
                f"nbytes={self.nbytes})")


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #
def _check_input(x: Any, fmt: Any, axis: int, scale_rule, rounding, key, sr_prescale=False):
    fmt = F.get(fmt)
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        x = jnp.asarray(x)
    if not any(x.dtype == d for d in FLOAT_DTYPES):
        raise TypeError(f"x: expected a float32, bfloat16 or float16 array, got dtype {x.dtype}")
    ndim = x.ndim
    if ndim == 0:
        raise ValueError("x: expected an array with at least one dimension, got a scalar")
    if isinstance(axis, bool):
        raise TypeError(f"axis: expected an int, got {axis!r}")
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"axis: expected an int, got {axis!r}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis: {axis} is out of range for an array of rank {ndim}")
    axis = axis % ndim
    rounding = F.rounding(rounding)
    if scale_rule is None:
        scale_rule = ScaleRule.FLOOR
    scale_rule = F.scale_rule(scale_rule)
    if fmt.scale != "e8m0" and scale_rule is not ScaleRule.FLOOR and not fmt.is_passthrough:
        raise ValueError(
            f"scale_rule: {scale_rule.name} applies to E8M0-scaled MX formats only; "
            f"{fmt.name} has a fixed scale computation (pass ScaleRule.FLOOR or None)"
        )
    if rounding is Rounding.STOCHASTIC and key is None:
        raise ValueError("key: STOCHASTIC rounding needs a PRNG key (key=jax.random.key(...))")
    if not isinstance(sr_prescale, (bool, np.bool_)):
        raise TypeError(f"sr_prescale: expected a bool, got {sr_prescale!r}")
    if sr_prescale and rounding is not Rounding.STOCHASTIC:
        raise ValueError(f"sr_prescale: True needs rounding=STOCHASTIC, got {rounding.name}")
    return x, fmt, axis, scale_rule, rounding


def _to_blocks(x: jnp.ndarray, axis: int, block: int) -> tuple[jnp.ndarray, int]:
    """Moves `axis` last, pads it with zeros to a multiple of `block`."""
    xm = jnp.moveaxis(x, axis, -1)
    n = xm.shape[-1]
    pad = (-n) % block
    if pad:
        xm = jnp.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, pad)])
    return xm, n


# --------------------------------------------------------------------------- #
# Core, per format (block axis last, padded). Each format has a `_prepare` step
# (scales and the scaled elements y), then either codes (`_quantize_*`) or the
# dequantized values straight from the rounding (`_fake_*`, no codes).
# --------------------------------------------------------------------------- #
def max_scale_exponent(dtype, elem: ElementFormat, prescale: bool) -> int:
    """The largest E8M0 exponent s whose dequantized values stay finite in `dtype`.

    A saturated element dequantizes to ``max_normal * 2^s`` (times 4/3 with the SR
    pre-scale); with s <= emax(dtype) - emax(elem) (minus one with the pre-scale,
    as 4/3 * max_normal >= 2^(emax(elem) + 1)) that is at most the dtype's largest
    finite value. FLOOR never exceeds this bound without the pre-scale; EVEN, CEIL
    and RCEIL would for amax in the dtype's top binade (docs/NUMERICS.md).
    """
    return int(jnp.finfo(dtype).maxexp) - 1 - elem.emax - int(bool(prescale))


def _mx_prepare(xb, elem, rule, prescale, dtype=jnp.float32):
    abs_bits = _bits.f32_bits(xb) & _bits.ABS_MASK
    amax_bits = jnp.max(abs_bits, axis=-1, keepdims=True)
    nonfinite = amax_bits >= _bits.EXP_INF
    s = jnp.minimum(e8m0_exponent(amax_bits, elem, rule),
                    max_scale_exponent(dtype, elem, prescale))
    s = jnp.where(amax_bits == 0, 0, s)
    y = _bits.ldexp(xb, -s)
    if prescale:
        y = y * jnp.float32(SR_PRESCALE)
    return jnp.where(nonfinite, 0.0, y), s, nonfinite


def quantize_mx_blocks(xb, elem, rule, mode, u, prescale, dtype=jnp.float32):
    """xb f32 [..., nb, bs] -> (codes uint8 [..., nb, bs], E8M0 scale bytes uint8 [..., nb]).

    The E8M0 block quantizer on blocks laid out last (unpacked codes); also the
    body of the fused Pallas kernel. ``u``: uniforms for STOCHASTIC (else None);
    ``prescale``: the 3/4 SR pre-scale. ``dtype`` is the input's dtype before the
    f32 upcast: it bounds the scale (`max_scale_exponent`) so that dequantized
    values are finite in it.
    """
    y, s, nonfinite = _mx_prepare(xb, elem, rule, prescale, dtype)
    sign, code = round_to_grid(y, elem, mode, u)
    scale_bytes = jnp.where(nonfinite, 255, s + 127).astype(jnp.uint8)[..., 0]
    return _encode(sign, code, elem), scale_bytes


def _mx_scale_values(v, s, nonfinite, prescale):
    out = _bits.ldexp_normal(v, s)
    if prescale:
        out = out * jnp.float32(SR_UNSCALE)
    return jnp.where(nonfinite, jnp.float32(jnp.nan), out)


def _fake_mx(xb, elem, rule, mode, u, prescale, dtype=jnp.float32):
    y, s, nonfinite = _mx_prepare(xb, elem, rule, prescale, dtype)
    return _mx_scale_values(round_to_value(y, elem, mode, u), s, nonfinite, prescale)


def _dequant_mx(codes, scale_bytes, elem, prescale):
    """codes uint8 [..., nb, bs], scale_bytes uint8 [..., nb] -> f32 [..., nb, bs]."""
    sb = scale_bytes.astype(jnp.int32)[..., None]
    return _mx_scale_values(_signed_value(codes, elem), sb - 127, sb == 255, prescale)


def _tensor_scale(amax_bits, denom: float, floor_exp: int):
    """max(amax / denom, 2^floor_exp); 1 for zero; NaN for non-finite."""
    amax = _bits.bits_f32(amax_bits)
    # A traced divisor, so XLA cannot turn the division into a reciprocal multiply.
    divisor = lax.optimization_barrier(amax * 0.0 + jnp.float32(denom))
    t = jnp.maximum(amax / divisor, jnp.float32(2.0**floor_exp))
    t = jnp.where(amax_bits == 0, jnp.float32(1.0), t)
    return jnp.where(amax_bits >= _bits.EXP_INF, jnp.float32(jnp.nan), t)


def _nvfp4_floor_exp() -> int:
    # d = block_scale * t >= 2^-9 * t and the smallest E2M1 value 0.5 * d must stay normal.
    return -126 + 1 + 9


def _pertensor_floor_exp(elem: ElementFormat) -> int:
    # min_subnormal(elem) * t must stay a normal f32.
    return -126 - (elem.emin - elem.mbits)


def _nvfp4_prepare(xb, prescale):
    abs_bits = _bits.f32_bits(xb) & _bits.ABS_MASK
    t_bits = jnp.max(abs_bits)
    t = _tensor_scale(t_bits, 6.0 * 448.0, _nvfp4_floor_exp())
    amax = _bits.bits_f32(jnp.max(abs_bits, axis=-1, keepdims=True))
    finite = t_bits < _bits.EXP_INF
    six_t = lax.optimization_barrier(jnp.broadcast_to(jnp.float32(6.0) * t, amax.shape))
    _, bs_code = round_to_grid(jnp.where(finite, amax / six_t, 0.0), F.E4M3, Rounding.NEAREST_EVEN)
    block_scale = decode_magnitude(bs_code, F.E4M3)
    y = _bits.exact_div(xb, jnp.where(block_scale == 0, 1.0, block_scale * t))
    y = jnp.where(block_scale == 0, jnp.copysign(jnp.float32(0.0), xb), y)
    y = jnp.where(finite, y, 0.0)
    if prescale:
        y = y * jnp.float32(SR_PRESCALE)
    bs_code = jnp.where(finite, bs_code, 0x7F)  # E4M3 NaN byte for a non-finite tensor
    return y, bs_code, block_scale, t


def _quantize_nvfp4(xb, mode, u, prescale):
    """xb f32 [..., nb, 16] -> (codes, E4M3 block-scale bytes [..., nb], tensor scale)."""
    y, bs_code, _, t = _nvfp4_prepare(xb, prescale)
    sign, code = round_to_grid(y, F.E2M1, mode, u)
    return _encode(sign, code, F.E2M1), bs_code.astype(jnp.uint8)[..., 0], t


def _nvfp4_scale_values(v, block_scale, t, prescale):
    # (value * block_scale) is exact; the tensor scale is applied last, as
    # block-scaled MMA hardware does.
    out = (v * block_scale) * t
    return out * jnp.float32(SR_UNSCALE) if prescale else out


def _fake_nvfp4(xb, mode, u, prescale):
    y, _, block_scale, t = _nvfp4_prepare(xb, prescale)
    return _nvfp4_scale_values(round_to_value(y, F.E2M1, mode, u), block_scale, t, prescale)


def _dequant_nvfp4(codes, scale_bytes, t, prescale):
    block_scale = decode_magnitude(scale_bytes, F.E4M3)[..., None]
    return _nvfp4_scale_values(_signed_value(codes, F.E2M1), block_scale, t, prescale)


def _pertensor_prepare(xf, elem, prescale):
    t_bits = jnp.max(_bits.f32_bits(xf) & _bits.ABS_MASK)
    t = _tensor_scale(t_bits, elem.max_normal, _pertensor_floor_exp(elem))
    finite = t_bits < _bits.EXP_INF
    y = jnp.where(finite, _bits.exact_div(xf, jnp.where(finite, t, 1.0)), 0.0)
    if prescale:
        y = y * jnp.float32(SR_PRESCALE)
    return y, t


def _quantize_pertensor(xf, elem, mode, u, prescale):
    y, t = _pertensor_prepare(xf, elem, prescale)
    sign, code = round_to_grid(y, elem, mode, u)
    return _encode(sign, code, elem), t


def _pertensor_scale_values(v, t, prescale):
    out = v * t
    return out * jnp.float32(SR_UNSCALE) if prescale else out


def _fake_pertensor(xf, elem, mode, u, prescale):
    y, t = _pertensor_prepare(xf, elem, prescale)
    return _pertensor_scale_values(round_to_value(y, elem, mode, u), t, prescale)


def _dequant_pertensor(codes, t, elem, prescale):
    return _pertensor_scale_values(_signed_value(codes, elem), t, prescale)


def _pack(codes: jnp.ndarray) -> jnp.ndarray:
    """uint8 4-bit codes [..., n] (n even) -> [..., n // 2], first in low nibble."""
    pairs = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack(packed: jnp.ndarray) -> jnp.ndarray:
    lo = packed & 0x0F
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))


def _core(x, fmt: Format, axis: int, rule: ScaleRule, mode: Rounding, key, prescale: bool,
          values: bool = False):
    """Quantizes with the block axis moved last and padded.

    Returns (codes uint8 [..., n_pad] unpacked, scales [..., nb] | None, t | None, n),
    or with `values=True` (dequantized f32 values [..., n_pad], None, None, n).
    """
    elem = fmt.element
    block = fmt.block_size or 1
    xm, n = _to_blocks(x.astype(jnp.float32), axis, block)
    u = _uniforms(key, xm.shape) if mode is Rounding.STOCHASTIC else None
    if fmt.is_per_tensor:
        if values:
            return _fake_pertensor(xm, elem, mode, u, prescale), None, None, n
        codes, t = _quantize_pertensor(xm, elem, mode, u, prescale)
        return codes, None, t, n
    lead = xm.shape[:-1]
    nb = xm.shape[-1] // block
    xb = xm.reshape(lead + (nb, block))
    ub = None if u is None else u.reshape(xb.shape)
    if values:
        if fmt.scale == "e8m0":
            out = _fake_mx(xb, elem, rule, mode, ub, prescale, x.dtype)
        else:
            out = _fake_nvfp4(xb, mode, ub, prescale)
        return out.reshape(xm.shape), None, None, n
    if fmt.scale == "e8m0":
        codes, scales = quantize_mx_blocks(xb, elem, rule, mode, ub, prescale, x.dtype)
        t = None
    else:
        codes, scales, t = _quantize_nvfp4(xb, mode, ub, prescale)
    return codes.reshape(xm.shape), scales, t, n


def _dequant_core(codes, scales, t, fmt: Format, prescale: bool):
    """codes [..., n_pad] (unpacked), scales [..., nb] -> f32 [..., n_pad]."""
    elem = fmt.element
    if fmt.is_per_tensor:
        return _dequant_pertensor(codes, t, elem, prescale)
    block = fmt.block_size
    cb = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // block, block))
    if fmt.scale == "e8m0":
        out = _dequant_mx(cb, scales, elem, prescale)
    else:
        out = _dequant_nvfp4(cb, scales, t, prescale)
    return out.reshape(codes.shape)


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #
def quantize(
    x: jnp.ndarray,
    fmt: Format | str,
    axis: int = -1,
    *,
    scale_rule: ScaleRule | str | None = ScaleRule.FLOOR,
    rounding: Rounding | str = Rounding.NEAREST_EVEN,
    key: jax.Array | None = None,
    sr_prescale: bool = False,
) -> MXArray:
    """Quantizes `x` to `fmt` with blocks along `axis`.

    Args:
      x: float32/bfloat16/float16 array of any rank >= 1.
      fmt: MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, FP8_E4M3, FP8_E5M2 (or name).
      axis: the block (contraction) axis. Sizes not divisible by the block are
        zero-padded internally.
      scale_rule: E8M0 scale rule (MX formats); NVFP4 and per-tensor FP8 have a
        fixed scale computation and accept only FLOOR/None.
      rounding: element rounding.
      key: PRNG key, required for STOCHASTIC rounding. The uniforms are
        `jax.random.uniform(key, shape, f32)` with `shape` = x's shape with
        `axis` moved last and padded to the block.
      sr_prescale: multiply by 3/4 before rounding (dequantize divides by 3/4).
    Returns:
      MXArray (see its docstring for the layout).
    """
    x, fmt, axis, rule, mode = _check_input(x, fmt, axis, scale_rule, rounding, key,
                                            sr_prescale)
    if fmt.is_passthrough:
        raise ValueError("fmt: BF16 is pass-through; there is nothing to quantize")
    codes, scales, t, _ = _core(x, fmt, axis, rule, mode, key, sr_prescale)
    if fmt.packed:
        # Packing fused into the quantizer's loop defeats XLA:CPU vectorization;
        # materializing the byte codes first is ~4x faster there (CPU only).
        codes = _pack(cpu_barrier(codes))
    codes = jnp.moveaxis(codes, -1, axis)
    if scales is not None:
        scales = jnp.moveaxis(scales, -1, axis)
    return MXArray(codes, scales, t, tuple(x.shape), axis, fmt, bool(sr_prescale))


def dequantize(q: MXArray, dtype=jnp.float32) -> jnp.ndarray:
    """Values of `q` as `dtype` (default f32), with its logical shape.

    Exact in f32 (subnormal results included); other dtypes are a cast of the
    f32 values. A NaN block scale (0xFF) gives NaN for the whole block.
    """
    if not isinstance(q, MXArray):
        raise TypeError(f"q: expected an MXArray, got {type(q).__name__}")
    codes = jnp.moveaxis(q.codes, q.axis, -1)
    if q.fmt.packed:
        codes = _unpack(codes)
    scales = None if q.scales is None else jnp.moveaxis(q.scales, q.axis, -1)
    out = _dequant_core(codes, scales, q.tensor_scale, q.fmt, q.sr_prescale)
    out = out[..., : q.shape[q.axis]]
    return jnp.moveaxis(out, -1, q.axis).astype(dtype)


def fake_quantize(
    x: jnp.ndarray,
    fmt: Format | str,
    axis: int = -1,
    *,
    scale_rule: ScaleRule | str | None = ScaleRule.FLOOR,
    rounding: Rounding | str = Rounding.NEAREST_EVEN,
    key: jax.Array | None = None,
    sr_prescale: bool = False,
) -> jnp.ndarray:
    """Quantize-dequantize in one fused pass: same shape and dtype as `x`.

    Equals `dequantize(quantize(x, ...), x.dtype)` bit for bit without
    materializing packed codes. BF16 (pass-through) returns `x` unchanged.
    """
    x, fmt, axis, rule, mode = _check_input(x, fmt, axis, scale_rule, rounding, key,
                                            sr_prescale)
    if fmt.is_passthrough:
        return x
    values, _, _, n = _core(x, fmt, axis, rule, mode, key, sr_prescale, values=True)
    out = values[..., :n]
    return jnp.moveaxis(out, -1, axis).astype(x.dtype)


def fake_quantize_parts(
    x: jnp.ndarray,
    fmt: Format | str,
    axis: int = -1,
    *,
    scale_rule: ScaleRule | str | None = ScaleRule.FLOOR,
    rounding: Rounding | str = Rounding.NEAREST_EVEN,
    key: jax.Array | None = None,
    sr_prescale: bool = False,
) -> tuple[jnp.ndarray, jnp.ndarray | None]:
    """`fake_quantize` with its per-tensor factors left out: ``(values, tensor_scale)``.

    ``values`` (f32, x's shape) are the element grid values times their block
    scales: ``ldexp(v, s)`` for E8M0 formats (NaN for a non-finite block),
    ``v * block_scale`` for NVFP4 (exact: at most 6 significant bits, magnitudes
    in [2^-10, 2688]), ``v`` for per-tensor FP8. ``tensor_scale`` is the f32
    per-tensor scale (NVFP4, per-tensor FP8; NaN for a non-finite tensor) or
    None. With ``sr_prescale`` the caller also owes the ``fp32(4/3)`` unscale.
    ``fake_quantize(x) == (values * tensor_scale) * fp32(4/3)`` (each factor
    only where present), bit for bit, in f32. Used by the emulated GEMM on
    accelerators, which applies the factors to the f32 GEMM result.
    """
    x, fmt, axis, rule, mode = _check_input(x, fmt, axis, scale_rule, rounding, key,
                                            sr_prescale)
    if fmt.is_passthrough:
        raise ValueError("fmt: BF16 is pass-through; there is nothing to quantize")
    elem = fmt.element
    block = fmt.block_size or 1
    xm, n = _to_blocks(x.astype(jnp.float32), axis, block)
    u = _uniforms(key, xm.shape) if mode is Rounding.STOCHASTIC else None
    if fmt.is_per_tensor:
        y, t = _pertensor_prepare(xm, elem, sr_prescale)
        values = round_to_value(y, elem, mode, u)
    else:
        xb = xm.reshape(xm.shape[:-1] + (xm.shape[-1] // block, block))
        ub = None if u is None else u.reshape(xb.shape)
        if fmt.scale == "e8m0":
            y, s, nonfinite = _mx_prepare(xb, elem, rule, sr_prescale, x.dtype)
            v = _bits.ldexp_normal(round_to_value(y, elem, mode, ub), s)
            values, t = jnp.where(nonfinite, jnp.float32(jnp.nan), v), None
        else:
            y, _, block_scale, t = _nvfp4_prepare(xb, sr_prescale)
            values = round_to_value(y, F.E2M1, mode, ub) * block_scale
        values = values.reshape(xm.shape)
    return jnp.moveaxis(values[..., :n], -1, axis), t
