"""NVFP4 GEMMs on Blackwell's block-scaled FP4 MMA: the 'xla_nvfp4' backend.

NVFP4 is one of the two operand configurations XLA lowers ``jax.nn.scaled_matmul`` to
cuDNN's block-scaled MMA for (``__cudnn$blockScaledDot`` on B200): ``float4_e2m1fn``
elements with ``float8_e4m3fn`` scales per 16 along K. mxjax's NVFP4 (E2M1 elements, an
E4M3 scale per 16 and one f32 scale per tensor, `mxjax.scaling.E4M3BlocksTensorScale`)
is that configuration and one f32 factor per operand, so no re-encoding is needed:

* each operand is quantized where it is (`in_place_operand`: its contraction split into
  bit axes, no transpose of the input), with the arithmetic of mxjax's quantizer: the
  codes, scale bytes and tensor scale of `mxjax.quantize_with` on the canonical operand
  rotated as the emulation rotates it (`nvfp4_operand`), bit for bit, stochastic rounding
  included (the same uniforms from the same key, drawn in the canonical shape);
* the packed codes are reinterpreted as ``float4_e2m1fn`` (XLA's sub-byte order is
  mxjax's: the first element in the low nibble) and the scale bytes as
  ``float8_e4m3fn``: no pass of their own;
* ``scaled_matmul`` contracts them with f32 accumulation, and the two tensor scales
  multiply its f32 result, lhs's then rhs's, as the emulation's accelerator form
  multiplies its bf16 GEMM's result (`mxjax.emulation.forms.accelerator_gemm`).

**Values.** Every product of two scaled elements (``2^-20 <= |e_a s_a e_b s_b| < 2^22``) is
exact in f32, so the result is the emulation's up to the order of the f32 sums. No
branch is needed: a non-finite operand has a NaN tensor scale (`mxjax.scaling`), which
makes the whole result NaN here as in the emulation, whatever the MMA makes of the
block scales (E4M3's NaN byte 0x7F); an all-zero block has scale 0 and zero codes.

**Where the quantization runs.** XLA fuses the quantizer: the tensor amax, then the block
amaxes and the E4M3 scales, then the codes (the random bits of stochastic rounding and
the wgrad's fixed H16 fused in); only the one-byte codes and scales are transposed into
``[B, F, K]``. The tensor amax must be known before any block is scaled, so an NVFP4
operand is read at least twice. No Pallas kernel yet.

Deviceless compiles (``tests/accelerators/test_deviceless_block_formats.py``): on B200
every GEMM of the 4096^3 matmul's train step is ``__cudnn$blockScaledDot`` on f4e2m1fn
operands, and none is a bf16 GEMM.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from mxjax import _bits
from mxjax.chips import Chip
from mxjax.elements import decode_magnitude, encode, round_to_grid
from mxjax.emulation import in_place
from mxjax.formats import Rounding
from mxjax.quantization import quantize_with
from mxjax.rotation import bit_view, hadamard_bit_view
from mxjax.routes.spec import NO_GPU_TARGET, Route, in_place_route_gemm
from mxjax.scaling import SR_PRESCALE, SR_UNSCALE

__all__ = ["ROUTE", "in_place_operand", "nvfp4_gemm", "nvfp4_in_place_gemm", "nvfp4_operand",
           "takes_nvfp4"]

_NV_BLOCK = 16
# cuDNN's block-scaled dot takes FP4 operands whose K is a multiple of 32.
_K_MULTIPLE = 32


def _nvfp4(op) -> bool:
    return (op.fmt.element is not None and op.fmt.element.name == "e2m1"
            and op.fmt.scale == "e4m3" and op.fmt.block_size == _NV_BLOCK)


def takes_nvfp4(recipe) -> bool:
    """Whether both operands of the GEMM recipe are NVFP4 (E2M1, E4M3 scales per 16, f32
    tensor scale)."""
    return _nvfp4(recipe.lhs) and _nvfp4(recipe.rhs)


def nvfp4_operand(x3: jax.Array, op, key):
    """A canonical operand quantized to NVFP4 by `mxjax.quantize_with`, as scaled_matmul takes it.

    Args:
      x3: f32/bf16 ``[batch..., F, K]`` (the canonical layout, contraction last, already
        rotated by the recipe's Hadamard if it has one).
      op: its OperandRecipe (NVFP4).
      key: the rounding key (stochastic rounding) or None.
    Returns:
      ``(elements, scales, tensor_scale)``: ``float4_e2m1fn [B, F, Kp]`` whose bits are
      mxjax's element codes, ``float8_e4m3fn [B, F, Kp // 16]`` whose bits are its scale
      bytes, and the f32 tensor scale; B the product of the batch axes, Kp K padded with
      zeros to a multiple of 32 (the quantizer pads to 16, so the uniforms of stochastic
      rounding are the emulation's; a further zero half-block has zero codes and scale).
    """
    if not _nvfp4(op):
        raise ValueError(f"op: expected an NVFP4 operand recipe, got {op!r}")
    if x3.ndim < 2:
        raise ValueError(f"x3: expected [batch..., F, K], got shape {x3.shape}")
    q = quantize_with(x3, op, -1, key=key)
    f, half = q.codes.shape[-2:]
    return _as_mma_operand(q.codes.reshape(-1, f, half),
                           q.scales.reshape(-1, f, q.scales.shape[-1]), q.tensor_scale)


def _as_mma_operand(codes, scales, tensor_scale):
    """Packed uint8 codes ``[B, F, Kp/2]`` and scale bytes ``[B, F, Kp/16]`` (Kp a multiple
    of 16) as scaled_matmul's f4 and E4M3 operands, K padded with zeros to 32."""
    pad = (-2 * codes.shape[-1]) % _K_MULTIPLE
    if pad:
        codes = jnp.pad(codes, ((0, 0), (0, 0), (0, pad // 2)))
        scales = jnp.pad(scales, ((0, 0), (0, 0), (0, pad // _NV_BLOCK)))
    # u8 -> f4 bitcast: XLA puts the first element in the low nibble, as mxjax packs.
    elements = lax.bitcast_convert_type(codes, jnp.float4_e2m1fn).reshape(
        codes.shape[:2] + (-1,))
    return elements, lax.bitcast_convert_type(scales, jnp.float8_e4m3fn), tensor_scale


def _block_scaled(ae, be, asc, bsc, ta, tb, recipe):
    """scaled_matmul times the tensor scales (lhs's, then rhs's) and the SR unscales."""
    out = jax.nn.scaled_matmul(ae, be, asc, bsc, preferred_element_type=jnp.float32)
    out = out * ta * tb
    for op in (recipe.lhs, recipe.rhs):
        if op.sr_prescale:
            out = out * jnp.float32(SR_UNSCALE)
    return out


def nvfp4_gemm(a3: jax.Array, b3: jax.Array, recipe, k_lhs, k_rhs) -> jax.Array:
    """The NVFP4 GEMM of canonical operands on the block-scaled dot: f32 ``[batch..., Fa, Fb]``.

    Args:
      a3: ``[batch..., Fa, K]``, b3: ``[batch..., Fb, K]`` (contraction last, rotated).
      recipe: a GemmRecipe with two NVFP4 operands (`takes_nvfp4`).
      k_lhs, k_rhs: the operands' rounding keys (stochastic rounding) or None.
    Returns:
      ``scaled_matmul(f4, f4, e4m3, e4m3) * t_a * t_b`` (times the SR 4/3 unscale of each
      operand that has it): the emulation's GEMM up to the order of its f32 sums.
    """
    if not takes_nvfp4(recipe):
        raise ValueError(f"recipe: the 'xla_nvfp4' backend takes NVFP4 x NVFP4, got "
                         f"{recipe.lhs.fmt.name} x {recipe.rhs.fmt.name}")
    if a3.ndim != b3.ndim or a3.shape[:-2] != b3.shape[:-2] or a3.shape[-1] != b3.shape[-1]:
        raise ValueError(f"a3, b3: expected [batch..., Fa, K] and [batch..., Fb, K], got "
                         f"{a3.shape} and {b3.shape}")
    ae, asc, ta = nvfp4_operand(a3, recipe.lhs, k_lhs)
    be, bsc, tb = nvfp4_operand(b3, recipe.rhs, k_rhs)
    out = _block_scaled(ae, be, asc, bsc, ta, tb, recipe)
    return out.reshape(a3.shape[:-2] + (a3.shape[-2], b3.shape[-2]))


def _canonical(x, view, k_len):
    """x laid out like view.x (K at view.axis) -> [B, F, k_len] (batch, free, contraction)."""
    p = view.axis
    free = [i for i in range(x.ndim) if i != p and i not in view.batch]
    perm = tuple(view.batch) + tuple(free) + (p,)
    b = math.prod(x.shape[i] for i in view.batch)
    f = math.prod(x.shape[i] for i in free)
    return jnp.transpose(x, perm).reshape(b, f, k_len)


def in_place_operand(view, op, key, *, hadamard_size: int | None, signs):
    """One NVFP4 operand quantized where it is: `nvfp4_operand`'s result, bit for bit.

    The operand keeps its layout (`in_place.contraction_view`: no transpose of the bf16
    input into ``[batch..., F, K]``); its 16-blocks are bit axes of its contraction
    (`mxjax.rotation.bit_view`), so the Hadamard, the tensor and block amaxes, the E4M3
    scales and the E2M1 codes are elementwise operations and reductions there, the
    arithmetic of `mxjax.scaling.E4M3BlocksTensorScale` (stochastic rounding's uniforms
    drawn in the canonical shape, laid out likewise). Only the one-byte codes and scales
    are transposed into ``[B, F, Kp]``.

    Args:
      view: the operand with its contraction merged (`in_place.contraction_view`).
      op: its OperandRecipe (NVFP4).
      key: the rounding key (stochastic rounding) or None.
      hadamard_size: h (16 or more) or None; signs: the rotation's ±1 vector or None.
    Returns:
      ``(elements f4e2m1fn [B, F, Kp], scales f8e4m3fn [B, F, Kp // 16], tensor_scale)``,
      Kp the contraction padded to 16 and h (as the emulation pads), then to 32.
    """
    if not _nvfp4(op):
        raise ValueError(f"op: expected an NVFP4 operand recipe, got {op!r}")
    scheme = op.scheme
    p = view.axis
    step = max(_NV_BLOCK, hadamard_size or 1)
    n_bits = step.bit_length() - 1
    k_pad = -(-view.x.shape[p] // step) * step
    z = bit_view(in_place._pad_axis(view.x, p, k_pad), p, n_bits)
    low = p + n_bits
    block_axes = tuple(range(low - 3, low + 1))  # the 4 lowest bits: a 16-block
    if hadamard_size is None:
        r = z.astype(jnp.float32)
    else:
        r = hadamard_bit_view(z, hadamard_size, low, signs)
    abs_bits = _bits.f32_bits(r) & _bits.ABS_MASK
    t_bits = jnp.max(abs_bits)
    t = _tensor_scale(t_bits, scheme)
    amax = _bits.bits_f32(jnp.max(abs_bits, axis=block_axes, keepdims=True))
    finite = t_bits < _bits.EXP_INF
    six_t = lax.optimization_barrier(
        jnp.broadcast_to(jnp.float32(scheme.element.max_normal) * t, amax.shape))
    _, bs_code = round_to_grid(jnp.where(finite, amax / six_t, 0.0), scheme.scale_element,
                               Rounding.NEAREST_EVEN)
    block_scale = decode_magnitude(bs_code, scheme.scale_element)
    y = _bits.exact_div(r, jnp.where(block_scale == 0, 1.0, block_scale * t))
    y = jnp.where(block_scale == 0, jnp.copysign(jnp.float32(0.0), r), y)
    y = jnp.where(finite, y, 0.0)
    if op.sr_prescale:
        y = y * jnp.float32(SR_PRESCALE)
    u = None
    if op.rounding is Rounding.STOCHASTIC:
        u = bit_view(in_place._uniforms_like(key, view, k_pad), p, n_bits)
    sign, code = round_to_grid(y, scheme.element, op.rounding, u)
    codes = encode(sign, code, scheme.element)
    # Elements 2i and 2i + 1 (the lowest bit) into one byte, the first in the low nibble.
    packed = (lax.index_in_dim(codes, 0, low, keepdims=False)
              | (lax.index_in_dim(codes, 1, low, keepdims=False) << 4))
    shape = list(view.x.shape)
    shape[p] = k_pad // 2
    packed = _canonical(packed.reshape(shape), view, k_pad // 2)
    shape[p] = k_pad // _NV_BLOCK
    bs_code = jnp.where(finite, bs_code, 0x7F).astype(jnp.uint8)
    scales = _canonical(bs_code.reshape(shape), view, k_pad // _NV_BLOCK)
    return _as_mma_operand(packed, scales, t)


def _tensor_scale(t_bits, scheme):
    from mxjax.scaling import _tensor_scale as tensor_scale

    return tensor_scale(t_bits, scheme.element.max_normal * scheme.scale_element.max_normal,
                        scheme.tensor_floor_exp)


def nvfp4_in_place_gemm(a: jax.Array, b: jax.Array, dims, recipe, k_lhs, k_rhs, signs, *,
                        operand_dtypes=None, out_dtype=None) -> jax.Array:
    """``dot_general(a, b, dims)`` under an NVFP4 recipe, operands quantized in place
    (`in_place_operand`), on the block-scaled dot: ``[B, Fa, Fb]``, f32 or out_dtype."""
    if not takes_nvfp4(recipe):
        raise ValueError(f"recipe: the 'xla_nvfp4' backend takes NVFP4 x NVFP4, got "
                         f"{recipe.lhs.fmt.name} x {recipe.rhs.fmt.name}")
    a, b = in_place.cast_operands(a, b, operand_dtypes)
    (ca, cb), (ba, bb) = dims
    va, vb = in_place.contraction_view(a, ba, ca), in_place.contraction_view(b, bb, cb)
    h = None if recipe.hadamard is None else recipe.hadamard.block_size
    ae, asc, ta = in_place_operand(va, recipe.lhs, k_lhs, hadamard_size=h, signs=signs)
    be, bsc, tb = in_place_operand(vb, recipe.rhs, k_rhs, hadamard_size=h, signs=signs)
    out = _block_scaled(ae, be, asc, bsc, ta, tb, recipe)
    return out if out_dtype is None else out.astype(out_dtype)


def _gemm(a, b, *, dims, recipe, key, gemm_name, operand_dtypes=None, out_dtype=None,
          platform=None) -> jax.Array:
    del gemm_name, platform  # one program: XLA lowers scaled_matmul per chip
    return in_place_route_gemm(nvfp4_in_place_gemm, a, b, dims=dims, recipe=recipe, key=key,
                               operand_dtypes=operand_dtypes, out_dtype=out_dtype)


def blackwell_block_scaled(chip: Chip) -> str:
    """'' where XLA reaches cuDNN's block-scaled MMA (NVIDIA sm_100+) or the CPU (which
    expands the block-scaled dot: tests), else why not."""
    cc = chip.compute_capability
    if chip.platform == "cpu" or (chip.platform == "gpu" and not chip.is_amd
                                  and cc is not None and cc >= (10, 0)):
        return ""
    if chip.platform == "gpu" and not chip.device_kind:
        return NO_GPU_TARGET
    return (f"needs the block-scaled MMA XLA reaches through cuDNN (NVIDIA Blackwell "
            f"sm_100+); device is {chip.device_kind or 'unknown'!r}")


ROUTE = Route(
    name="xla_nvfp4",
    summary=("NVFP4 as it is on XLA's block-scaled dot (cuDNN's FP4 MMA on Blackwell), "
             "tensor scales on the f32 result"),
    formats=("nvfp4",),
    runs_on=blackwell_block_scaled,
    gemm=_gemm,
    packed_dot=None,
    evidence=("layer_8b.b200.nvfp4_rates_roofline",),
)
