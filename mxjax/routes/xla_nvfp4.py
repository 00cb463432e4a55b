"""NVFP4 GEMMs on Blackwell's block-scaled FP4 MMA: the 'xla_nvfp4' backend.

NVFP4 is one of the two operand configurations XLA lowers ``jax.nn.scaled_matmul`` to
cuDNN's block-scaled MMA for (``__cudnn$blockScaledDot`` on B200): ``float4_e2m1fn``
elements with ``float8_e4m3fn`` scales per 16 along K. mxjax's NVFP4 (E2M1 elements, an
E4M3 scale per 16 and one f32 scale per tensor, `mxjax.scaling.E4M3BlocksTensorScale`)
is that configuration and one f32 factor per operand, so no re-encoding is needed:

* each canonical operand (``[batch..., F, K]``, rotated by the recipe's Hadamard as the
  emulation rotates it) is quantized by mxjax's own quantizer (`mxjax.quantize_with`:
  the emulation's codes, scale bytes and tensor scale bit for bit, stochastic rounding
  included: the same uniforms from the same key);
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

**Where the quantization runs.** XLA fuses the quantizer into the operand's passes (the
tensor amax, the block scales, the codes: the random bits of stochastic rounding and the
wgrad's fixed H16 fused in); the transposes into the canonical layout fuse into the
passes that read them. The tensor amax must be known before any block is scaled, so an
NVFP4 operand is read at least twice. Quantizing the operands in place instead (their
16-blocks as bit axes of their own layout, only the one-byte codes transposed, the same
bits) was estimated slower on the 8B layer (B200 rates roofline, 9.57 ms against this
form's 9.12 ms), so the route keeps the canonical operands. No Pallas kernel yet.

Deviceless compiles (``tests/accelerators/test_deviceless_block_formats.py``): on B200
every GEMM of the 4096^3 matmul's train step is ``__cudnn$blockScaledDot`` on f4e2m1fn
operands, and none is a bf16 GEMM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mxjax.chips import Chip
from mxjax.emulation.in_place import cast_operands
from mxjax.operands import canonical_operands, quantizer_operands
from mxjax.quantization import quantize_with
from mxjax.routes.spec import NO_GPU_TARGET, Route
from mxjax.scaling import SR_UNSCALE

__all__ = ["ROUTE", "nvfp4_gemm", "nvfp4_operand", "takes_nvfp4"]

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
    codes = q.codes.reshape(-1, f, half)
    scales = q.scales.reshape(-1, f, q.scales.shape[-1])
    pad = (-2 * half) % _K_MULTIPLE
    if pad:
        codes = jnp.pad(codes, ((0, 0), (0, 0), (0, pad // 2)))
        scales = jnp.pad(scales, ((0, 0), (0, 0), (0, pad // _NV_BLOCK)))
    # u8 -> f4 bitcast: XLA puts the first element in the low nibble, as mxjax packs.
    elements = lax.bitcast_convert_type(codes, jnp.float4_e2m1fn).reshape(
        codes.shape[0], f, -1)
    return elements, lax.bitcast_convert_type(scales, jnp.float8_e4m3fn), q.tensor_scale


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
    out = jax.nn.scaled_matmul(ae, be, asc, bsc, preferred_element_type=jnp.float32)
    out = out * ta * tb
    for op in (recipe.lhs, recipe.rhs):
        if op.sr_prescale:
            out = out * jnp.float32(SR_UNSCALE)
    return out.reshape(a3.shape[:-2] + (a3.shape[-2], b3.shape[-2]))


def _gemm(a, b, *, dims, recipe, key, gemm_name, operand_dtypes=None, out_dtype=None,
          platform=None) -> jax.Array:
    del gemm_name, platform  # one program: XLA lowers scaled_matmul per chip
    a3, b3 = canonical_operands(*cast_operands(a, b, operand_dtypes), dims)
    a3, b3, k_lhs, k_rhs = quantizer_operands(a3, b3, recipe, key)
    out = nvfp4_gemm(a3, b3, recipe, k_lhs, k_rhs)
    return out if out_dtype is None else out.astype(out_dtype)


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
