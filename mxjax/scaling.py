"""Scaling schemes: how a quantized format chooses, stores and applies its scales.

Three schemes, one interface (:class:`ScalingScheme`), one implementation each:

* :class:`E8M0Blocks` (MXFP4, MXFP8): a power-of-two E8M0 byte per block, chosen
  from the block's amax by a :class:`~mxjax.formats.ScaleRule`;
* :class:`E4M3BlocksTensorScale` (NVFP4): an E4M3 scale per block times one fp32
  scale for the whole tensor;
* :class:`PerTensor` (FP8 E4M3/E5M2): one fp32 scale, the tensor's amax now.

A scheme works on f32 values with the block axis last and zero-padded to its
block size (``to_blocks``). Quantizing is ``prepare`` (scales and the scaled
elements ``y``), then rounding ``y`` onto the element grid
(``mxjax.elements``), then either ``stored`` (the scale bytes / tensor scale of
an ``MXArray``) or ``values`` (the dequantized values straight from the
rounding). ``from_stored`` turns stored scales back into the scales
``values`` applies. ``parts`` applies the block scales only (the emulated GEMM
on accelerators applies per-tensor factors to its f32 result). The numerics are
docs/NUMERICS.md's; :func:`scheme_for` is the one place a format picks its scheme.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from mxjax import _bits
from mxjax import formats as F
from mxjax.elements import decode_magnitude, e8m0_exponent, round_to_grid
from mxjax.formats import ElementFormat, Format, Rounding, ScaleRule

__all__ = [
    "SR_PRESCALE",
    "SR_UNSCALE",
    "E4M3BlocksTensorScale",
    "E8M0Blocks",
    "OperandRange",
    "PerTensor",
    "ScalingScheme",
    "max_scale_exponent",
    "scheme_for",
    "to_blocks",
]

SR_PRESCALE = 0.75  # Tseng et al.: keep stochastic rounding away from saturation
SR_UNSCALE = 4.0 / 3.0  # dequantize multiplies by fp32(4/3)

# bf16 (and f32) normal exponents start at -126; bf16 subnormals end at 2^-133.
_BF16_MIN_NORMAL_EXP = -126
_BF16_MIN_SUBNORMAL_EXP = -133
_BF16_SIGNIFICANT_BITS = 8


class OperandRange(NamedTuple):
    """What the emulated GEMM's operand values (per-tensor factors left out) can be.

    ``min_exp``: log2 of the smallest nonzero magnitude; ``significant_bits``:
    the most significant bits of any value. None for a pass-through operand
    (arbitrary f32 values).
    """

    min_exp: int | None
    significant_bits: int | None

    @property
    def bf16_exact(self) -> bool:
        """Every value is a bf16 value (subnormals included)."""
        return (self.min_exp is not None and self.min_exp >= _BF16_MIN_SUBNORMAL_EXP
                and self.significant_bits <= _BF16_SIGNIFICANT_BITS)

    @property
    def bf16_normal(self) -> bool:
        """Every nonzero value is a bf16 normal (nothing a flush-to-zero unit can drop)."""
        return self.bf16_exact and self.min_exp >= _BF16_MIN_NORMAL_EXP


def to_blocks(x: jax.Array, axis: int, block: int) -> tuple[jax.Array, int]:
    """Moves `axis` last and pads it with zeros to a multiple of `block`.

    Returns ``(xm [..., n_pad], n)`` with ``n`` the unpadded length.
    """
    xm = jnp.moveaxis(x, axis, -1)
    n = xm.shape[-1]
    pad = (-n) % block
    if pad:
        xm = jnp.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, pad)])
    return xm, n


def _tensor_amax_bits(abs_bits: jax.Array) -> jax.Array:
    """uint32 abs bits of a tensor's amax; 0 for an empty tensor (whose scale is then 1)."""
    return jnp.max(abs_bits) if abs_bits.size else jnp.zeros((), jnp.uint32)


def _prescaled(y: jax.Array, prescale: bool) -> jax.Array:
    return y * jnp.float32(SR_PRESCALE) if prescale else y


def _unscaled(v: jax.Array, prescale: bool) -> jax.Array:
    return v * jnp.float32(SR_UNSCALE) if prescale else v


class ScalingScheme(Protocol):
    """The interface every scaling scheme implements (block axis last, padded).

    ``xb`` is the scheme's view of the values (``split`` of ``[..., n_pad]``):
    ``[..., nb, block_size]`` for block schemes, ``[..., n]`` per tensor.
    ``scales`` is the scheme's own NamedTuple of traced scales.
    """

    element: ElementFormat
    block_size: int  # elements per block scale (1: per-tensor, no padding)
    scale_rules: tuple[ScaleRule, ...]  # the rules it accepts (FLOOR only: fixed)

    def split(self, xm: jax.Array) -> jax.Array:
        """``[..., n_pad]`` -> the scheme's view ``xb``."""

    def prepare(self, xb: jax.Array, rule: ScaleRule, prescale: bool, dtype: Any
                ) -> tuple[jax.Array, Any]:
        """``(y, scales)``: the finite scaled elements to round and the scales.

        ``dtype``: the input's dtype before the f32 upcast (bounds E8M0 scales).
        """

    def stored(self, scales: Any) -> tuple[jax.Array | None, jax.Array | None]:
        """``(scale bytes uint8 [..., nb] | None, f32 tensor scale | None)``."""

    def from_stored(self, scale_bytes: jax.Array | None, tensor_scale: jax.Array | None
                    ) -> Any:
        """The scales ``values`` applies, from an MXArray's stored scales."""

    def values(self, v: jax.Array, scales: Any, prescale: bool) -> jax.Array:
        """Dequantized f32 values of signed element grid values ``v``."""

    def parts(self, v: jax.Array, scales: Any) -> tuple[jax.Array, jax.Array | None]:
        """``(v times its block scales, f32 tensor scale | None)``; no 4/3 unscale."""

    def decode_view(self, xf: jax.Array, axis: int, scale_bytes: jax.Array | None,
                    tensor_scale: jax.Array | None
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """For diagnostics: ``(xv, |y|, log2 d, has_block)`` of f32 ``xf`` (any layout).

        ``xv``: the values in the scheme's view; ``|y| = |xv| / d`` with ``d`` each
        block's decode scale (no pre-scale); ``log2 d`` per block (NaN for a NaN
        scale); ``has_block``: blocks that hold a nonzero value and a usable ``d``.
        """

    def operand_range(self) -> OperandRange:
        """Trace-time range of ``parts`` values (per-tensor factors left out)."""


def _min_exp(elem: ElementFormat) -> int:
    return int(math.log2(elem.min_subnormal))


def max_scale_exponent(dtype, elem: ElementFormat, prescale: bool) -> int:
    """The largest E8M0 exponent s whose dequantized values stay finite in `dtype`.

    A saturated element dequantizes to ``max_normal * 2^s`` (times 4/3 with the SR
    pre-scale); with s <= emax(dtype) - emax(elem) (minus one with the pre-scale,
    as 4/3 * max_normal >= 2^(emax(elem) + 1)) that is at most the dtype's largest
    finite value. FLOOR never exceeds this bound without the pre-scale; EVEN, CEIL
    and RCEIL would for amax in the dtype's top binade (docs/NUMERICS.md).
    """
    return int(jnp.finfo(dtype).maxexp) - 1 - elem.emax - int(bool(prescale))


# --------------------------------------------------------------------------- #
# E8M0 blocks (MXFP4, MXFP8)
# --------------------------------------------------------------------------- #
class E8M0Scales(NamedTuple):
    exponent: jax.Array  # int32 [..., nb, 1]: scale = 2^exponent
    nonfinite: jax.Array  # bool [..., nb, 1]: the block held NaN/Inf (scale byte 0xFF)


@dataclasses.dataclass(frozen=True, kw_only=True)
class E8M0Blocks:
    """A power-of-two E8M0 scale byte per block of ``block_size`` elements."""

    element: ElementFormat
    block_size: int
    scale_rules: tuple[ScaleRule, ...] = tuple(ScaleRule)

    def split(self, xm):
        return xm.reshape(xm.shape[:-1] + (xm.shape[-1] // self.block_size, self.block_size))

    def exponents(self, amax_bits, rule, prescale, dtype=jnp.float32) -> E8M0Scales:
        """The blocks' scales from the abs bits (uint32) of their amax, any layout.

        Also the scale rule of mxjax.emulation.in_place's in-place forms (blocks anywhere).
        """
        s = jnp.minimum(e8m0_exponent(amax_bits, self.element, rule),
                        max_scale_exponent(dtype, self.element, prescale))
        return E8M0Scales(jnp.where(amax_bits == 0, 0, s), amax_bits >= _bits.EXP_INF)

    def block_scales(self, xb, rule, prescale, dtype=jnp.float32) -> E8M0Scales:
        """The scales of blocks ``xb [..., nb, block_size]`` (f32) from their amax."""
        abs_bits = _bits.f32_bits(xb) & _bits.ABS_MASK
        return self.exponents(jnp.max(abs_bits, axis=-1, keepdims=True), rule, prescale, dtype)

    def prepare(self, xb, rule, prescale, dtype=jnp.float32):
        scales = self.block_scales(xb, rule, prescale, dtype)
        y = _prescaled(_bits.ldexp(xb, -scales.exponent), prescale)
        return jnp.where(scales.nonfinite, 0.0, y), scales

    def stored(self, scales):
        s, nonfinite = scales
        return jnp.where(nonfinite, 255, s + 127).astype(jnp.uint8)[..., 0], None

    def from_stored(self, scale_bytes, tensor_scale):
        sb = scale_bytes.astype(jnp.int32)[..., None]
        return E8M0Scales(sb - 127, sb == 255)

    def values(self, v, scales, prescale):
        s, nonfinite = scales
        out = _unscaled(_bits.ldexp_normal(v, s), prescale)
        return jnp.where(nonfinite, jnp.float32(jnp.nan), out)

    def parts(self, v, scales):
        s, nonfinite = scales
        return jnp.where(nonfinite, jnp.float32(jnp.nan), _bits.ldexp_normal(v, s)), None

    def decode_view(self, xf, axis, scale_bytes, tensor_scale):
        xb = self.split(to_blocks(xf, axis, self.block_size)[0])
        sb = jnp.moveaxis(scale_bytes, axis, -1).astype(jnp.int32)
        s = sb - 127
        y = jnp.abs(_bits.ldexp(xb, -s[..., None]))
        log2d = jnp.where(sb == 255, jnp.float32(jnp.nan), s.astype(jnp.float32))
        return xb, y, log2d, jnp.any(_bits.nonzero(xb), axis=-1)

    def operand_range(self):
        # Element grid times 2^s, s in [-127, 127]; the top end above the f32 range is
        # already Inf in f32 (and the same Inf in bf16).
        return OperandRange(_min_exp(self.element) - 127, self.element.mbits + 1)


# --------------------------------------------------------------------------- #
# E4M3 blocks + fp32 tensor scale (NVFP4)
# --------------------------------------------------------------------------- #
class E4M3Scales(NamedTuple):
    code: jax.Array | None  # int32 [..., nb, 1] E4M3 block-scale codes (None from storage)
    block_scale: jax.Array  # f32 [..., nb, 1], the decoded block scales
    tensor_scale: jax.Array  # f32 scalar


def _tensor_scale(amax_bits, denom: float, floor_exp: int):
    """max(amax / denom, 2^floor_exp); 1 for zero; NaN for non-finite."""
    amax = _bits.bits_f32(amax_bits)
    # A divisor that depends on amax, so XLA cannot turn the division into a reciprocal
    # multiply (min(amax, 0) is 0 for every amax but NaN, which the last line replaces).
    # No optimization barrier: one would keep these scalar ops out of the kernels that
    # use the scale (on GPUs a launch each, for every quantized operand).
    divisor = jnp.float32(denom) + jnp.minimum(amax, jnp.float32(0.0))
    t = jnp.maximum(amax / divisor, jnp.float32(2.0**floor_exp))
    t = jnp.where(amax_bits == 0, jnp.float32(1.0), t)
    return jnp.where(amax_bits >= _bits.EXP_INF, jnp.float32(jnp.nan), t)


@dataclasses.dataclass(frozen=True, kw_only=True)
class E4M3BlocksTensorScale:
    """An E4M3 scale per block of ``block_size`` elements times one fp32 tensor scale."""

    element: ElementFormat
    block_size: int
    scale_rules: tuple[ScaleRule, ...] = (ScaleRule.FLOOR,)

    scale_element = F.E4M3
    # d = block_scale * t >= 2^-9 * t and the smallest E2M1 value 0.5 * d must stay normal.
    tensor_floor_exp = -126 + 1 + 9

    def split(self, xm):
        return xm.reshape(xm.shape[:-1] + (xm.shape[-1] // self.block_size, self.block_size))

    def tensor_scale(self, amax_bits):
        """The f32 tensor scale of a tensor whose amax has these abs bits (uint32):
        amax / (max element * max E4M3) floored at 2^tensor_floor_exp, 1 for zero, NaN
        for a non-finite amax."""
        return _tensor_scale(amax_bits, self.element.max_normal * self.scale_element.max_normal,
                             self.tensor_floor_exp)

    def prepare(self, xb, rule, prescale, dtype=jnp.float32):
        abs_bits = _bits.f32_bits(xb) & _bits.ABS_MASK
        t_bits = _tensor_amax_bits(abs_bits)
        t = self.tensor_scale(t_bits)
        amax = _bits.bits_f32(jnp.max(abs_bits, axis=-1, keepdims=True))
        finite = t_bits < _bits.EXP_INF
        six_t = lax.optimization_barrier(
            jnp.broadcast_to(jnp.float32(self.element.max_normal) * t, amax.shape))
        _, bs_code = round_to_grid(jnp.where(finite, amax / six_t, 0.0), self.scale_element,
                                   Rounding.NEAREST_EVEN)
        block_scale = decode_magnitude(bs_code, self.scale_element)
        y = _bits.exact_div(xb, jnp.where(block_scale == 0, 1.0, block_scale * t))
        y = jnp.where(block_scale == 0, jnp.copysign(jnp.float32(0.0), xb), y)
        y = _prescaled(jnp.where(finite, y, 0.0), prescale)
        bs_code = jnp.where(finite, bs_code, 0x7F)  # E4M3 NaN byte for a non-finite tensor
        return y, E4M3Scales(bs_code, block_scale, t)

    def stored(self, scales):
        return scales.code.astype(jnp.uint8)[..., 0], scales.tensor_scale

    def from_stored(self, scale_bytes, tensor_scale):
        block_scale = decode_magnitude(scale_bytes, self.scale_element)[..., None]
        return E4M3Scales(None, block_scale, tensor_scale)

    def values(self, v, scales, prescale):
        # (value * block_scale) is exact; the tensor scale is applied last, as
        # block-scaled MMA hardware does.
        return _unscaled((v * scales.block_scale) * scales.tensor_scale, prescale)

    def parts(self, v, scales):
        return v * scales.block_scale, scales.tensor_scale

    def decode_view(self, xf, axis, scale_bytes, tensor_scale):
        xb = self.split(to_blocks(xf, axis, self.block_size)[0])
        sb = jnp.moveaxis(scale_bytes, axis, -1).astype(jnp.int32)
        d = decode_magnitude(sb, self.scale_element) * tensor_scale.astype(jnp.float32)
        pos = d > 0
        y = jnp.abs(_bits.exact_div(xb, jnp.where(pos, d, 1.0)[..., None]))
        y = jnp.where(pos[..., None], y, 0.0)  # d == 0: everything underflows
        log2d = jnp.where(pos, jnp.log2(jnp.where(pos, d, 1.0)), d)  # NaN stays NaN
        has_block = jnp.any(_bits.nonzero(xb), axis=-1) & (pos | jnp.isnan(d))
        return xb, y, log2d, has_block

    def operand_range(self):
        # The element grid times an E4M3 block scale (the tensor scale is a factor).
        return OperandRange(_min_exp(self.element) + _min_exp(self.scale_element),
                            self.element.mbits + 1 + self.scale_element.mbits + 1)


# --------------------------------------------------------------------------- #
# Per-tensor (FP8 E4M3 / E5M2, current scaling)
# --------------------------------------------------------------------------- #
class TensorScale(NamedTuple):
    tensor_scale: jax.Array  # f32 scalar


# A tensor scale at least this large puts every f32-subnormal element's quotient below
# 2^-26, which rounds to (signed) zero on every FP8 grid: a division that flushes
# subnormal inputs to (signed) zero gives the same elements.
_SUBNORMALS_ROUND_TO_ZERO = 2.0 ** -100


def _cpu_tensor_div(x, d):
    """`_bits.exact_div(x, d)` rounded onto an FP8 grid, for the tensor scale d, on XLA:CPU.

    XLA:CPU treats subnormal inputs as zero, so `exact_div` rescales subnormal x with
    integer ops on every element (most of the per-tensor quantizer's time there). For
    d >= 2^-100 that cannot change an element (`_SUBNORMALS_ROUND_TO_ZERO`), so the
    plain division runs (the divisor kept a division, see `exact_div`); smaller tensor
    scales (tensors whose amax is below about 2^-91) take `exact_div`. One branch of a
    conditional on the scalar d: no pass over the tensor.
    """
    return lax.cond(
        d < jnp.float32(_SUBNORMALS_ROUND_TO_ZERO), _bits.exact_div,
        lambda x, d: x / (d + jnp.minimum(jnp.abs(x), jnp.float32(0.0))), x, d)


_TINY_TENSOR_RESCALE = 2.0 ** 64


def _cuda_tensor_div(x, d):
    """x / d for the tensor scale d, on CUDA: one multiply and one division per element.

    `_bits.exact_div`'s elementwise subnormal rescue (bit ops on every element) is what
    keeps XLA:GPU from fusing the per-tensor quantizer of a transposed operand (a weight
    laid out for the FP8 GEMM) into one kernel: it split into five, most of `fp8`'s
    non-GEMM time on H200. Here the rescue is one scalar: for d >= 2^-100 a subnormal x
    rounds to (signed) zero on every FP8 grid whatever the division does with it
    (`_SUBNORMALS_ROUND_TO_ZERO`), so the plain division gives the same elements; for a
    smaller d (a tensor whose amax is below about 2^-91) both x and d are scaled by 2^64
    (exact: |x| < 2^-91, and XLA:GPU keeps f32 subnormals, ``xla_gpu_ftz=false``), which
    makes every nonzero x normal and leaves the quotient unchanged. The divisor depends on
    x elementwise to keep the division a division (see `_bits.exact_div`).
    """
    x = x.astype(jnp.float32)
    s = jnp.where(d < jnp.float32(_SUBNORMALS_ROUND_TO_ZERO), jnp.float32(_TINY_TENSOR_RESCALE),
                  jnp.float32(1.0))
    xs = x * s
    return xs / (d * s + jnp.minimum(jnp.abs(xs), jnp.float32(0.0)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerTensor:
    """One fp32 scale for the whole tensor: its amax over the element max normal."""

    element: ElementFormat
    block_size: int = 1
    scale_rules: tuple[ScaleRule, ...] = (ScaleRule.FLOOR,)

    @property
    def tensor_floor_exp(self) -> int:
        # min_subnormal(elem) * t must stay a normal f32.
        return -126 - (self.element.emin - self.element.mbits)

    def split(self, xm):
        return xm

    def prepare(self, xb, rule, prescale, dtype=jnp.float32):
        t_bits = _tensor_amax_bits(_bits.f32_bits(xb) & _bits.ABS_MASK)
        t = _tensor_scale(t_bits, self.element.max_normal, self.tensor_floor_exp)
        finite = t_bits < _bits.EXP_INF
        divisor = jnp.where(finite, t, 1.0)
        quotient = lax.platform_dependent(xb, divisor, cpu=_cpu_tensor_div,
                                          cuda=_cuda_tensor_div, default=_bits.exact_div)
        y = jnp.where(finite, quotient, 0.0)
        return _prescaled(y, prescale), TensorScale(t)

    def stored(self, scales):
        return None, scales.tensor_scale

    def from_stored(self, scale_bytes, tensor_scale):
        return TensorScale(tensor_scale)

    def values(self, v, scales, prescale):
        return _unscaled(v * scales.tensor_scale, prescale)

    def parts(self, v, scales):
        return v, scales.tensor_scale

    def decode_view(self, xf, axis, scale_bytes, tensor_scale):
        t = tensor_scale.astype(jnp.float32)
        y = jnp.abs(_bits.exact_div(xf, jnp.where(jnp.isfinite(t), t, 1.0)))
        return xf, y, jnp.log2(t)[None], jnp.any(_bits.nonzero(xf))[None]

    def operand_range(self):
        return OperandRange(_min_exp(self.element), self.element.mbits + 1)


# Format.scale -> the scheme class (the one place a format picks its scheme).
_SCHEMES = {"e8m0": E8M0Blocks, "e4m3": E4M3BlocksTensorScale, None: PerTensor}


def scheme_for(fmt: Format | str) -> ScalingScheme:
    """The scaling scheme of a quantized format (BF16, pass-through, has none)."""
    fmt = F.get(fmt)
    if fmt.is_passthrough:
        raise ValueError("fmt: BF16 is pass-through; there is nothing to quantize")
    kind = _SCHEMES[fmt.scale]
    if kind is PerTensor:
        return PerTensor(element=fmt.element)
    return kind(element=fmt.element, block_size=fmt.block_size)
