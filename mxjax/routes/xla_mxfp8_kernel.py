"""One-pass MXFP8 operand kernel for the 'xla_mxfp8' route: f8 codes and E8M0 scales.

`mxfp8_operand_pair` reads a 2-D operand once (`mxjax.routes.xla_fp4_kernel.run_codec`
with `Mxfp8Codec`) and writes, for both of its axes, what the block-scaled dot reads: the
f8 element codes ``[F, K]`` (one byte each, contraction last) and each 32-block's E8M0
byte ``[F, K/32]``; `mxfp8_operand` writes one axis. No tensor scale: one read in all.

**Arithmetic.** `mxjax.quantize`'s (`E8M0Blocks.prepare`) on the 32 strided slices of a
tile: the rotated values (the butterflies of `mxjax.hadamard`, then 1/sqrt(h)), the
block's amax, its exponent ``s`` by the scale rule (`E8M0Blocks.exponents`), ``y = v *
2^-s`` by integer operations on the exponent (`mxjax._bits.ldexp`, exact for subnormal
inputs too), the rounding onto the E4M3/E5M2 grid (`mxjax.elements.round_to_grid`) and
the code byte ``sign << 7 | magnitude code``. A block holding NaN or Inf has zero codes
and E8M0's NaN byte 0xFF, as the quantizer writes them.

**On a GPU with FP8 conversions** (sm_89 and later, `has_f8_cvt`), ``f8_cvt`` rounds to
nearest even by PTX's ``cvt.rn.satfinite.e4m3x2.f32`` (``e5m2x2``), one instruction per
two codes, and forms ``y`` by two multiplies by powers of two instead of the exponent
arithmetic: both exact wherever y is a normal f32, and a smaller y is below half of the
f8 format's smallest subnormal, a (signed) zero code either way. IEEE rounding to nearest
even on the f8 grid, saturated at its largest finite value, is `round_to_grid`'s
(``tests/mxjax/routes/test_xla_mxfp8_kernel.py`` compares the two on every f32 exponent
the codes can see, with PTX's conversion modelled by ml_dtypes on saturated inputs).

Scope: MXFP8 operands, a Hadamard of 16 or 32 or none, deterministic rounding without
the SR pre-scale, bf16 or f32 input (`takes_kernel`); stochastic rounding takes the
route's XLA form.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from mxjax import _bits
from mxjax.elements import round_to_grid
from mxjax.formats import Rounding
from mxjax.routes import xla_fp4_kernel as fp4k

__all__ = ["Mxfp8Codec", "has_f8_cvt", "mxfp8_operand", "mxfp8_operand_pair",
           "takes_kernel"]

_MX = 32


def has_f8_cvt(compute_capability: tuple[int, int] | None) -> bool:
    """Whether the NVIDIA GPU of this compute capability has PTX's
    ``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`` (sm_89 and later: Ada, Hopper, Blackwell)."""
    return compute_capability is not None and tuple(compute_capability) >= (8, 9)


def _cvt_f8x2(even, odd, element: str):
    """The code bytes of elements 2p (low byte) and 2p + 1 (high) as one int32, by PTX's
    ``cvt.rn.satfinite.<element>x2.f32`` (the source written first fills the high byte)."""
    from jax.experimental.pallas import triton as plt

    (out,) = plt.elementwise_inline_asm(
        f"{{ .reg .b16 pair; cvt.rn.satfinite.{element}x2.f32 pair, $2, $1; "
        f"cvt.u32.u16 $0, pair; }}",
        args=[even, odd], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(even.shape, jnp.int32)])
    return out


def takes_kernel(op, hadamard_size: int | None, dtype) -> bool:
    """Whether the MXFP8 kernel computes this operand (E4M3/E5M2 with E8M0 scales per 32,
    h in {None, 16, 32}, deterministic rounding, no SR pre-scale, bf16 or f32 input)."""
    elem = op.fmt.element
    return (elem is not None and elem.name in ("e4m3", "e5m2") and op.fmt.scale == "e8m0"
            and op.fmt.block_size == _MX and op.rounding is not Rounding.STOCHASTIC
            and not op.sr_prescale and hadamard_size in (None, 16, 32)
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mxfp8Codec:
    """What the kernel writes for an MXFP8 operand: 32 code bytes and one E8M0 byte per
    32-block; no statistics, no parameter."""

    op: object
    hadamard_size: int | None
    f8_cvt: bool = False  # PTX's cvt for nearest-even codes (compiled kernels, `has_f8_cvt`)
    name: ClassVar[str] = "mxfp8_operand"
    code_columns: ClassVar[int] = _MX
    scale_columns: ClassVar[int] = 1
    n_stats: ClassVar[int] = 0
    has_param: ClassVar[bool] = False
    draw_columns: ClassVar[tuple[int, ...]] = ()  # no stochastic rounding

    def encode(self, xs, signs, param):
        del param
        h, op = self.hadamard_size, self.op
        v = fp4k.rotate_slices(xs, h, signs)
        if h is not None:
            norm = jnp.float32(1.0 / h ** 0.5)
            v = [r * norm for r in v]
        s, nonfinite = op.scheme.exponents(fp4k.abs_max_bits(v), op.scale_rule,
                                           op.sr_prescale)
        scale_bytes = [jnp.where(nonfinite, 255, s + 127)]
        if self.f8_cvt and op.rounding is Rounding.NEAREST_EVEN:
            half = (-s) // 2  # 2^-s as two normal-range factors (s in [-127, 127])
            up, rest = _bits.pow2(half), _bits.pow2(-s - half)
            codes = []
            for p in range(_MX // 2):
                pair = _cvt_f8x2((v[2 * p] * up) * rest, (v[2 * p + 1] * up) * rest,
                                 op.fmt.element.name)
                pair = jnp.where(nonfinite, 0, pair)
                codes += [pair & 0xFF, pair >> 8]
            return codes, scale_bytes, []
        codes = []
        for r in v:
            y = jnp.where(nonfinite, 0.0, _bits.ldexp(r, -s))
            sign, mag = round_to_grid(y, op.fmt.element, op.rounding)
            codes.append(jnp.where(nonfinite, 0, mag | (sign.astype(jnp.int32) << 7)))
        return codes, scale_bytes, []


def _check(x2, op, hadamard_size, f8_cvt=False, interpret=False):
    if f8_cvt and interpret:
        raise ValueError("f8_cvt: PTX's cvt has no interpreter form; pass f8_cvt=False with "
                         "interpret=True")
    fp4k.check_matrix(x2)
    if not takes_kernel(op, hadamard_size, x2.dtype):
        raise ValueError(f"op, hadamard_size, x2: the MXFP8 kernel takes MXFP8 with h in "
                         f"(None, 16, 32), deterministic rounding and a bf16 or f32 operand; "
                         f"got {op!r}, h={hadamard_size}, {x2.dtype}")


def _run(x2, directions, op, hadamard_size, signs, bf16_values, interpret, launch, f8_cvt):
    codec = Mxfp8Codec(op=op, hadamard_size=hadamard_size, f8_cvt=f8_cvt)
    # Per shard under a multi-device sharding (custom_partitioning): a plain kernel call
    # makes XLA gather the whole operand on every device first (FSDP, 8 B200s: 7.9 GB of
    # all-gathers for the 8B layer, 9.4x bf16's).
    out = fp4k.run_codec_sharded(x2, fp4k.signs_array(signs, hadamard_size), None,
                                 directions=directions, codec=codec, interpret=interpret,
                                 bf16_values=bf16_values, launch=launch)
    return [(codes, scale_bytes) for codes, scale_bytes, _ in out]


def _trimmed(result, f: int, k: int):
    codes, scale_bytes = result
    k = -(-k // _MX) * _MX
    return codes[:f, :k], scale_bytes[:f, :k // _MX]


def mxfp8_operand(x2: jax.Array, axis: int, op, *, hadamard_size: int | None, signs,
                  bf16_values: bool = False, interpret: bool = False,
                  launch: fp4k.Launch | None = None, f8_cvt: bool = False):
    """One MXFP8 operand in one read: codes and scales laid out ``[F, K]`` for the MMA.

    Args:
      x2: bf16 or f32 ``[F, K]`` (axis 1) or ``[K, F]`` (axis 0), any K (zero-padded
        here to a multiple of 32 and of the Hadamard size).
      axis: the contraction axis of x2 (0 or 1).
      op: the OperandRecipe (`takes_kernel`).
      hadamard_size: 16, 32 or None; signs: its ±1 vector (f32 [h]) or None.
      bf16_values: quantize ``x2.astype(bfloat16)`` (rounded in the kernel).
      interpret: run in the Pallas interpreter (CPU tests).
      launch: the kernel's tiles and launch (`xla_fp4_kernel.run_codec`; None: the
        default for the interpreter or the GPU traced for); the same bits under any.
      f8_cvt: round to nearest even by PTX's cvt (`has_f8_cvt`; compiled kernels only,
        not with ``interpret``): the same codes.
    Returns:
      ``(codes, scale_bytes)``: uint8 ``[F, Kp]`` (the f8 bit patterns) and uint8 ``[F,
      Kp // 32]`` (E8M0 bytes, 0xFF for a non-finite block); Kp K padded to 32. The bits
      of `mxjax.quantize` of the rotated operand.
    """
    if axis not in (0, 1):
        raise ValueError(f"axis: expected 0 or 1, got {axis!r}")
    _check(x2, op, hadamard_size, f8_cvt, interpret)
    step = max(_MX, hadamard_size or 1)
    if x2.shape[axis] % step:
        widths = [(0, 0), (0, 0)]
        widths[axis] = (0, (-x2.shape[axis]) % step)
        x2 = jnp.pad(x2, widths)
    (out,) = _run(x2, (axis,), op, hadamard_size, signs, bf16_values, interpret, launch,
                  f8_cvt)
    return _trimmed(out, x2.shape[1 - axis], x2.shape[axis])


def mxfp8_operand_pair(x2: jax.Array, op, *, hadamard_size: int | None, signs,
                       bf16_values: bool = False, interpret: bool = False,
                       launch: fp4k.Launch | None = None, f8_cvt: bool = False):
    """Both of x2's MXFP8 operands from one read: blocks along its rows and its columns.

    Args:
      x2: bf16 or f32 ``[R, C]``, R and C multiples of 32 and of the Hadamard size.
      op, hadamard_size, signs, bf16_values, interpret, launch, f8_cvt: as for
        `mxfp8_operand`.
    Returns:
      ``(along_rows, along_columns)``: `mxfp8_operand`'s result for axis 1 and for axis 0.
    """
    _check(x2, op, hadamard_size, f8_cvt, interpret)
    for k in x2.shape:
        fp4k.check_contraction(k, hadamard_size)
    row, col = _run(x2, (1, 0), op, hadamard_size, signs, bf16_values, interpret, launch,
                    f8_cvt)
    r, c = x2.shape
    return _trimmed(row, r, c), _trimmed(col, c, r)
