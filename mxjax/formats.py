"""Number formats: element formats, block/tensor formats, scale rules and roundings.

Every constant (max normal, emax, mantissa bits) is derived here, once, from the
exponent/mantissa widths of the element format. See docs/NUMERICS.md.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = [
    "BF16",
    "E2M1",
    "E4M3",
    "E5M2",
    "FORMATS",
    "FP8_E4M3",
    "FP8_E5M2",
    "MXFP4",
    "MXFP8_E4M3",
    "MXFP8_E5M2",
    "NVFP4",
    "ElementFormat",
    "Format",
    "Rounding",
    "ScaleRule",
    "get",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElementFormat:
    """A small float element format (no Inf; E4M3 'fn' keeps one NaN code, unused).

    Attributes:
      name: 'e2m1', 'e4m3' or 'e5m2'.
      ebits: exponent bits.
      mbits: explicit mantissa bits.
      max_mantissa_code: largest mantissa field at the top exponent (E4M3fn
        reserves 0b111 at the top exponent for NaN, so its max is 1.75·2^8).
      ieee_top: True when the top exponent field is reserved for Inf/NaN (E5M2).
    """

    name: str
    ebits: int
    mbits: int
    max_mantissa_code: int
    ieee_top: bool = False

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two in the format."""
        top_field = 2**self.ebits - (2 if self.ieee_top else 1)
        return top_field - self.bias

    @property
    def max_mantissa(self) -> float:
        """m_max with max_normal = m_max · 2^emax, 1 <= m_max < 2."""
        return 1.0 + self.max_mantissa_code / 2**self.mbits

    @property
    def max_normal(self) -> float:
        return self.max_mantissa * 2.0**self.emax

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    @property
    def max_code(self) -> int:
        """Magnitude code (no sign bit) of max_normal."""
        return ((self.emax - self.emin + 1) << self.mbits) | self.max_mantissa_code

    @property
    def sign_bit(self) -> int:
        return 1 << (self.ebits + self.mbits)


E2M1 = ElementFormat(name="e2m1", ebits=2, mbits=1, max_mantissa_code=1)
E4M3 = ElementFormat(name="e4m3", ebits=4, mbits=3, max_mantissa_code=6)
E5M2 = ElementFormat(name="e5m2", ebits=5, mbits=2, max_mantissa_code=3, ieee_top=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Format:
    """A quantized tensor format.

    Attributes:
      name: lower-case name ('mxfp4', 'nvfp4', 'fp8_e4m3', 'bf16', ...).
      element: element format, None for pass-through (BF16).
      block_size: elements per scale along the block axis; None for per-tensor.
      scale: 'e8m0' (power-of-two uint8 byte), 'e4m3' (NVFP4), or None.
      tensor_scale: whether an fp32 per-tensor scale is stored.
    """

    name: str
    element: ElementFormat | None
    block_size: int | None
    scale: str | None
    tensor_scale: bool

    @property
    def is_passthrough(self) -> bool:
        return self.element is None

    @property
    def is_block(self) -> bool:
        return self.block_size is not None

    @property
    def is_per_tensor(self) -> bool:
        return self.element is not None and self.block_size is None

    @property
    def packed(self) -> bool:
        """Two 4-bit codes per byte."""
        return self.element is not None and self.element.bits == 4

    def __repr__(self) -> str:
        return f"mxjax.{self.name.upper()}"


MXFP4 = Format(name="mxfp4", element=E2M1, block_size=32, scale="e8m0", tensor_scale=False)
MXFP8_E4M3 = Format(name="mxfp8_e4m3", element=E4M3, block_size=32, scale="e8m0",
                    tensor_scale=False)
MXFP8_E5M2 = Format(name="mxfp8_e5m2", element=E5M2, block_size=32, scale="e8m0",
                    tensor_scale=False)
NVFP4 = Format(name="nvfp4", element=E2M1, block_size=16, scale="e4m3", tensor_scale=True)
FP8_E4M3 = Format(name="fp8_e4m3", element=E4M3, block_size=None, scale=None, tensor_scale=True)
FP8_E5M2 = Format(name="fp8_e5m2", element=E5M2, block_size=None, scale=None, tensor_scale=True)
BF16 = Format(name="bf16", element=None, block_size=None, scale=None, tensor_scale=False)

FORMATS: dict[str, Format] = {
    f.name: f for f in (MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, FP8_E4M3, FP8_E5M2, BF16)
}


class ScaleRule(enum.Enum):
    """How an E8M0 block scale is chosen from the block's amax (docs/NUMERICS.md)."""

    FLOOR = "floor"  # OCP v1.0: 2^(floor(log2 amax) - emax), elements saturate
    EVEN = "even"  # round amax to the element mantissa width, then FLOOR
    CEIL = "ceil"  # 2^(ceil(log2 amax) - emax)
    RCEIL = "rceil"  # 2^ceil(log2(amax / max_normal)) (NVIDIA, jax.nn 'mxfp4')


class Rounding(enum.Enum):
    """How a scaled element is rounded onto the element grid."""

    NEAREST_EVEN = "nearest_even"
    STOCHASTIC = "stochastic"
    TOWARD_ZERO = "toward_zero"
    NEAREST_AWAY = "nearest_away"


def get(fmt: str | Format) -> Format:
    """Returns the Format named `fmt` (case-insensitive) or `fmt` itself."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str) and fmt.lower() in FORMATS:
        return FORMATS[fmt.lower()]
    raise ValueError(f"fmt: unknown format {fmt!r}; expected one of {sorted(FORMATS)}")


def scale_rule(rule: str | ScaleRule) -> ScaleRule:
    """Coerces a ScaleRule or its (case-insensitive) name."""
    if isinstance(rule, ScaleRule):
        return rule
    try:
        return ScaleRule(str(rule).lower())
    except ValueError:
        raise ValueError(
            f"scale_rule: unknown {rule!r}; expected one of {[r.value for r in ScaleRule]}"
        ) from None


def rounding(mode: str | Rounding) -> Rounding:
    """Coerces a Rounding or its (case-insensitive) name."""
    if isinstance(mode, Rounding):
        return mode
    try:
        return Rounding(str(mode).lower())
    except ValueError:
        raise ValueError(
            f"rounding: unknown {mode!r}; expected one of {[r.value for r in Rounding]}"
        ) from None
