"""One-pass NVFP4 operand kernel for the 'xla_nvfp4' route: E2M1 codes and E4M3 scales.

NVFP4's block scales depend on the operand's tensor scale, so an operand takes two reads:
`tensor_scale` (one XLA reduction over the rotated operand: its amax, then the tensor
scale exactly as `mxjax.scaling.E4M3BlocksTensorScale` computes it), then the one-pass
kernel (`mxjax.routes.xla_fp4_kernel.run_codec` with `Nvfp4Codec`), which reads the operand
once and writes, for each direction asked, the packed E2M1 codes ``[F, K/2]`` and the
E4M3 scale bytes ``[F, K/16]`` in the layout the block-scaled dot reads. Both directions of
an operand come from one read where two GEMMs quantize it with the same recipe (the
weight in fprop and dgrad under the ``nvfp4`` preset).

**Arithmetic.** The emulation's (`E4M3BlocksTensorScale.prepare`) on the 32 strided slices
of a tile (`xla_fp4_kernel`'s layout, each 32-group two 16-blocks): the rotated values
``v`` (the butterflies of `mxjax.hadamard`, then 1/sqrt(h)), each 16-block's amax, its
E4M3 scale ``RNE(amax / (6 t))``, ``y = v / (scale * t)`` correctly rounded (the
interpreter uses `mxjax._bits.exact_div`, the emulation's division; compiled kernels PTX's
``div.rn.f32``, since Triton's ``/`` is an approximate division), then the rounding onto
E2M1 (to nearest even on Blackwell by PTX's ``cvt.rn.satfinite.e2m1x2.f32``, as
`xla_fp4_kernel` rounds MXFP4: the same codes, one instruction per byte). A tensor
holding NaN or Inf has a NaN tensor scale: zero codes and E4M3's NaN byte 0x7F
everywhere, as the quantizer writes them.

**Stochastic rounding** draws in the kernel: each element's uniform is
``jax.random.uniform(key, (F, K16))``'s at its place in the canonical operand (K16 the
contraction padded to 16, as the quantizer pads it), computed from the key's words and
the element's flat index by threefry2x32 (`mxjax.routes.threefry`), so the codes are the
emulation's for the same key: no uniforms are written or read. The SR pre-scale (3/4)
multiplies ``y`` before the rounding, as the emulation's.

Scope: NVFP4 operands, a Hadamard of 16 or none, bf16 or f32 input; stochastic rounding
with a threefry2x32 key JAX draws partitionably from (`takes_kernel`: JAX's defaults).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from mxjax import _bits
from mxjax.elements import decode_magnitude, round_to_grid
from mxjax.formats import E2M1, E4M3, Rounding
from mxjax.routes import threefry
from mxjax.routes import xla_fp4_kernel as fp4k
from mxjax.scaling import SR_PRESCALE, E4M3BlocksTensorScale

__all__ = ["Nvfp4Codec", "nvfp4_operand", "nvfp4_operand_pair", "takes_kernel",
           "tensor_scale"]

_NV = 16
_SCHEME = E4M3BlocksTensorScale(element=E2M1, block_size=_NV)
_E4M3_NAN = 0x7F


def takes_kernel(op, hadamard_size: int | None, dtype, key=None) -> bool:
    """Whether the NVFP4 kernel computes this operand (NVFP4, h in {None, 16}, bf16 or f32
    input; stochastic rounding with a ``key`` whose ``jax.random.uniform`` draws the
    kernel reproduces, `mxjax.routes.threefry.reproduces`)."""
    elem = op.fmt.element
    return (elem is not None and elem.name == "e2m1" and op.fmt.scale == "e4m3"
            and op.fmt.block_size == _NV and hadamard_size in (None, 16)
            and (op.rounding is not Rounding.STOCHASTIC or threefry.reproduces(key))
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)))


def tensor_scale(x2: jax.Array, axis: int, *, hadamard_size: int | None, signs,
                 bf16_values: bool = False) -> jax.Array:
    """The f32 tensor scale the emulation gives x2 quantized along ``axis``: the amax of
    the operand rotated along that axis (one reduction XLA fuses with the rotation), over
    6 * 448, floored at 2^-116; 1 for an all-zero operand, NaN for one holding NaN/Inf."""
    x = x2.astype(jnp.bfloat16) if bf16_values else x2
    x = x.astype(jnp.float32)
    if hadamard_size is None:
        amax_bits = jnp.max(_bits.f32_bits(x) & _bits.ABS_MASK)
        return _SCHEME.tensor_scale(amax_bits)
    # The rotation as the kernel computes it, on 32 strided slices (element j of every
    # 32-group along `axis`): elementwise butterflies XLA fuses with the reduction into one
    # read of x. `mxjax.hadamard`'s reshaped stages made XLA write the f32 rotation and read
    # it back (8B layer, B200: three passes, 2.1 GB, per wgrad operand of 14336 columns).
    # The same values: `rotate_slices` runs mxjax.hadamard's butterflies in its order.
    # (Zero padding to the 32-group rotates to zeros: the amax is unchanged.)
    xs = fp4k.group_slices(x, axis)
    norm = jnp.float32(1.0 / hadamard_size ** 0.5)
    v = [r * norm for r in fp4k.rotate_slices(xs, hadamard_size, signs)]
    amax_bits = jnp.max(fp4k.abs_max_bits(v))
    return _SCHEME.tensor_scale(amax_bits)


def _div_rn(a, b):
    """a / b rounded to nearest even by PTX's ``div.rn.f32`` (subnormals kept)."""
    from jax.experimental.pallas import triton as plt

    (out,) = plt.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, jnp.broadcast_to(b, a.shape)],
        constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Nvfp4Codec:
    """What the kernel writes for an NVFP4 operand: 16 code bytes and two E4M3 scale bytes
    (one per 16-block) per 32-group; the direction's tensor scale is its parameter."""

    op: object
    hadamard_size: int | None
    compiled: bool = False  # PTX's div.rn.f32 for the divisions (not in the interpreter)
    # Stochastic rounding: each direction's canonical K (its draws' row length); the
    # conversion of jax.random.uniform (`mxjax.routes.threefry.uniforms_legacy`).
    draw_columns: tuple[int, ...] = ()
    legacy_uniforms: bool = True
    # Nearest-even codes by PTX's cvt.rn.satfinite.e2m1x2.f32 (`xla_fp4_kernel.has_e2m1_cvt`)
    e2m1_cvt: bool = False
    name: ClassVar[str] = "nvfp4_operand"
    code_columns: ClassVar[int] = 16
    scale_columns: ClassVar[int] = 2
    n_stats: ClassVar[int] = 0
    has_param: ClassVar[bool] = True

    def _div(self, a, b):
        return _div_rn(a, b) if self.compiled else _bits.exact_div(a, b)

    def encode(self, xs, signs, t, draws=None):
        h = self.hadamard_size
        v = fp4k.rotate_slices(xs, h, signs)
        if h is not None:
            norm = jnp.float32(1.0 / h ** 0.5)
            v = [r * norm for r in v]
        finite = ~jnp.isnan(t)  # a NaN tensor scale: the tensor holds NaN or Inf
        six_t = jnp.float32(E2M1.max_normal) * t
        cvt = self.e2m1_cvt and self.op.rounding is Rounding.NEAREST_EVEN
        codes, scales, ys = [], [], []
        for b, block in enumerate((v[:_NV], v[_NV:])):
            amax = _bits.bits_f32(fp4k.abs_max_bits(block))
            # The emulation's amax / six_t is a plain division (XLA:CPU: the same flush).
            ratio = (amax / six_t) if not self.compiled else _div_rn(amax, six_t)
            _, code = round_to_grid(jnp.where(finite, ratio, 0.0), E4M3,
                                    Rounding.NEAREST_EVEN)
            scale = decode_magnitude(code, E4M3)
            zero = scale == 0
            d = jnp.where(zero, jnp.float32(1.0), scale * t)
            for i, r in enumerate(block):
                y = jnp.where(zero, _bits.bits_f32((_bits.f32_bits(r) >> 31) << 31),
                              self._div(r, d))
                y = jnp.where(finite, y, 0.0)
                if self.op.sr_prescale:
                    y = y * jnp.float32(SR_PRESCALE)
                if cvt:
                    ys.append(y)
                    continue
                u = None if draws is None else draws.slice(b * _NV + i)
                sign, mag = round_to_grid(y, E2M1, self.op.rounding, u)
                codes.append(mag | (sign.astype(jnp.int32) << 3))
            scales.append(jnp.where(finite, code, _E4M3_NAN))
        if cvt:  # IEEE nearest even on the E2M1 grid, saturated at 6: round_to_grid's
            return [fp4k.cvt_e2m1x2(ys[2 * p], ys[2 * p + 1]) for p in range(16)], scales, []
        packed = [codes[2 * p] | (codes[2 * p + 1] << 4) for p in range(16)]
        return packed, scales, []


def _check(x2, op, hadamard_size, compiled, interpret, key=None):
    if compiled and interpret:
        raise ValueError("compiled: PTX's div.rn has no interpreter form; pass compiled=False "
                         "with interpret=True")
    fp4k.check_matrix(x2)
    if op.rounding is Rounding.STOCHASTIC:
        threefry.key_words(key)  # raises, naming the key, where the kernel cannot draw
    elif key is not None:
        raise ValueError(f"key: only stochastic rounding takes a key; the operand rounds "
                         f"{op.rounding.name}")
    if not takes_kernel(op, hadamard_size, x2.dtype, key):
        raise ValueError(f"op, hadamard_size, x2: the NVFP4 kernel takes NVFP4 with h in "
                         f"(None, 16) and a bf16 or f32 operand; got {op!r}, "
                         f"h={hadamard_size}, {x2.dtype}")


def _run(x2, directions, op, hadamard_size, signs, bf16_values, compiled, interpret, launch,
         key=None):
    signs = fp4k.signs_array(signs, hadamard_size)
    scales = jnp.stack([tensor_scale(x2, d, hadamard_size=hadamard_size, signs=signs,
                                     bf16_values=bf16_values) for d in directions])
    keys, draw_columns = None, ()
    if op.rounding is Rounding.STOCHASTIC:
        (direction,) = directions  # each GEMM draws with its own key: one direction a call
        keys = threefry.key_words(key)
        draw_columns = (-(-x2.shape[direction] // _NV) * _NV,)  # the quantizer's K16
    cvt = False
    if compiled:
        from mxjax.chips import target_chip

        cvt = fp4k.has_e2m1_cvt(target_chip("gpu").compute_capability)
    codec = Nvfp4Codec(op=op, hadamard_size=hadamard_size, compiled=compiled,
                       draw_columns=draw_columns, legacy_uniforms=threefry.uniforms_legacy(),
                       e2m1_cvt=cvt)
    out = fp4k.run_codec_sharded(x2, signs, scales, directions=directions, codec=codec,
                                 interpret=interpret, bf16_values=bf16_values, launch=launch,
                                 keys=keys)
    return [(codes, sb, scales[i]) for i, (codes, sb, _) in enumerate(out)]


def _trimmed(result, f: int, k: int):
    codes, scale_bytes, t = result
    k = -(-k // 32) * 32
    return codes[:f, :k // 2], scale_bytes[:f, :k // _NV], t


def nvfp4_operand(x2: jax.Array, axis: int, op, *, hadamard_size: int | None, signs,
                  bf16_values: bool = False, compiled: bool = False,
                  interpret: bool = False, launch: fp4k.Launch | None = None, key=None):
    """One NVFP4 operand: its tensor scale (one reduction), then codes and scales in one read.

    Args:
      x2: bf16 or f32 ``[F, K]`` (axis 1) or ``[K, F]`` (axis 0), any K (zero-padded here
        to a multiple of 32: zero blocks, zero codes and scale bytes).
      axis: the contraction axis of x2 (0 or 1).
      op: the OperandRecipe (`takes_kernel`).
      hadamard_size: 16 or None; signs: its ±1 vector (f32 [16]) or None.
      bf16_values: quantize ``x2.astype(bfloat16)`` (rounded in the kernel).
      compiled: divide by PTX's ``div.rn.f32`` (GPU kernels); not with ``interpret``.
      interpret: run in the Pallas interpreter (CPU tests).
      launch: the kernel's tiles and launch (`xla_fp4_kernel.run_codec`; None: the
        default for the interpreter or the GPU traced for); the same bits under any.
      key: the rounding key of a stochastically rounded operand (a threefry2x32 key,
        `mxjax.routes.threefry.reproduces`), else None: the draws are
        ``jax.random.uniform(key, (F, K16))``'s, K16 the contraction padded to 16.
    Returns:
      ``(codes, scale_bytes, t)``: uint8 ``[F, Kp // 2]`` (element 2p in the low nibble
      of byte p), uint8 ``[F, Kp // 16]`` (E4M3 bytes), and the f32 tensor scale; Kp K
      padded to a multiple of 32. The bits of `mxjax.quantize_with` of the rotated
      operand (whose codes stop at K padded to 16).
    """
    if axis not in (0, 1):
        raise ValueError(f"axis: expected 0 or 1, got {axis!r}")
    _check(x2, op, hadamard_size, compiled, interpret, key)
    if hadamard_size and x2.shape[axis] % hadamard_size:
        widths = [(0, 0), (0, 0)]
        widths[axis] = (0, (-x2.shape[axis]) % hadamard_size)
        x2 = jnp.pad(x2, widths)
    (out,) = _run(x2, (axis,), op, hadamard_size, signs, bf16_values, compiled, interpret,
                  launch, key)
    return _trimmed(out, x2.shape[1 - axis], x2.shape[axis])


def nvfp4_operand_pair(x2: jax.Array, op, *, hadamard_size: int | None, signs,
                       bf16_values: bool = False, compiled: bool = False,
                       interpret: bool = False, launch: fp4k.Launch | None = None):
    """Both of x2's NVFP4 operands from one read of the kernel (and one tensor-scale
    reduction per direction): blocks along its rows and along its columns.

    Args:
      x2: bf16 or f32 ``[R, C]``, R and C multiples of 32.
      op, hadamard_size, signs, bf16_values, compiled, interpret, launch: as for
        `nvfp4_operand`.
    Returns:
      ``(along_rows, along_columns)``: `nvfp4_operand`'s result for axis 1 and for axis 0.
    """
    if op.rounding is Rounding.STOCHASTIC:
        raise ValueError("op: a pair takes deterministic rounding: each GEMM rounds "
                         "stochastically with its own key (nvfp4_operand, one axis a call)")
    _check(x2, op, hadamard_size, compiled, interpret)
    for k in x2.shape:
        fp4k.check_contraction(k, hadamard_size)
    row, col = _run(x2, (1, 0), op, hadamard_size, signs, bf16_values, compiled, interpret,
                    launch)
    r, c = x2.shape
    return _trimmed(row, r, c), _trimmed(col, c, r)
