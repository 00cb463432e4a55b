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
form's 9.12 ms), so the route keeps the canonical operands.

**On a GPU** (`nvfp4_kernel_gemm`) the operands the one-pass kernel takes
(`mxjax.routes.xla_nvfp4_kernel`: no batch axes) are quantized in their own layout: the
tensor scale by one reduction, then codes and scales by one read, both directions from
one call where two GEMMs quantize the operand alike (the weight in fprop and dgrad).
Stochastically rounded operands (dY) draw the emulation's uniforms inside the kernel,
from the GEMM's key (`mxjax.routes.threefry`): no uniforms in memory. The same bits.

Deviceless compiles (``tests/accelerators/test_deviceless_block_formats.py``): on B200
every GEMM of the 4096^3 matmul's train step is ``__cudnn$blockScaledDot`` on f4e2m1fn
operands, and none is a bf16 GEMM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from mxjax.chips import Chip
from mxjax.emulation import in_place
from mxjax.emulation.in_place import cast_operands
from mxjax.formats import Rounding
from mxjax.operands import (
    canonical_operand,
    canonical_operands,
    free_size,
    quantizer_operands,
    rotate_operand,
    rotation_signs,
    split_key,
)
from mxjax.quantization import MXArray, quantize_with
from mxjax.rotation import hadamard
from mxjax.routes import xla_fp8
from mxjax.routes.spec import NO_GPU_TARGET, Route, check_canonical_operand, in_place_route_gemm
from mxjax.routes.xla_fp4 import kernel_pack_input, kernel_view
from mxjax.scaling import SR_UNSCALE

__all__ = ["ROUTE", "kernel_operand", "nvfp4_gemm", "nvfp4_kernel_gemm", "nvfp4_operand",
           "packed_operand", "takes_nvfp4"]

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
    return packed_operand(quantize_with(x3, op, -1, key=key))


def packed_operand(q: MXArray):
    """`nvfp4_operand`'s result for an operand quantized already: ``q``, the canonical
    NVFP4 MXArray ``[batch..., F, K]`` (blocked along its last axis), e.g. a quantized
    residual (`mxjax.residuals`): its codes and scale bytes reinterpreted, padded to 32."""
    check_canonical_operand(q, "NVFP4", lambda fmt: fmt.name == "nvfp4")
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
    out = _block_scaled(nvfp4_operand(a3, recipe.lhs, k_lhs),
                        nvfp4_operand(b3, recipe.rhs, k_rhs), recipe)
    return out.reshape(a3.shape[:-2] + (a3.shape[-2], b3.shape[-2]))


def _block_scaled(lhs, rhs, recipe) -> jax.Array:
    """scaled_matmul of two NVFP4 operands ``(elements, scales, tensor scale)`` times the
    tensor scales (lhs's, then rhs's) and each SR unscale: f32 ``[B, Fa, Fb]``."""
    (ae, asc, ta), (be, bsc, tb) = lhs, rhs
    out = jax.nn.scaled_matmul(ae, be, asc, bsc, preferred_element_type=jnp.float32)
    out = out * ta * tb
    for op in (recipe.lhs, recipe.rhs):
        if op.sr_prescale:
            out = out * jnp.float32(SR_UNSCALE)
    return out


def nvfp4_kernel_gemm(a: jax.Array, b: jax.Array, dims, recipe, k_lhs, k_rhs, signs, *,
                      operand_dtypes=None, out_dtype=None, pair_rhs: bool = False,
                      compiled: bool = False, interpret: bool = False) -> jax.Array:
    """``dot_general(a, b, dims)`` under an NVFP4 recipe, operands by the one-pass kernel.

    Each operand the kernel takes (`mxjax.routes.xla_nvfp4_kernel.takes_kernel`: h in
    {None, 16}, stochastic rounding from a threefry key; `xla_fp4.kernel_view`: no batch
    axes, the free axes on one side of the contraction) is quantized in its own layout by
    `kernel_operand`: its tensor scale by one reduction, its codes and scales by one read
    (the uniforms of stochastic rounding drawn inside). Any other operand takes
    `nvfp4_operand` on its canonical, rotated layout (the same uniforms). The same
    elements, scales and tensor scales as `nvfp4_gemm`'s either way.

    Args:
      a, b: the GEMM's operands, ``dims`` lax dimension numbers.
      recipe: a GemmRecipe that `takes_nvfp4`.
      k_lhs, k_rhs: the rounding keys (stochastic rounding) or None.
      signs: the Hadamard's ±1 vector or None.
      operand_dtypes: None or a pair of dtypes (or None) a and b are cast to first (the
        kernel reads an f32 operand cast to bf16 as it is and rounds it itself).
      out_dtype: the f32 result is cast to this (None: f32).
      pair_rhs: quantize b in both directions by one kernel call (both sizes multiples
        of 32, fixed signs): the other GEMM that reads b with the same recipe makes the
        identical call, which XLA merges. `_gemm` sets it for the weight in fprop and
        dgrad without a Hadamard (NVIDIA's recipe quantizes W alike in both); X and dY,
        whose wgrad copy has the H16 the other GEMM's lacks, are quantized per GEMM
        (a pair would write a copy no GEMM reads).
      compiled: the kernel divides by PTX's ``div.rn.f32`` (GPU lowering).
      interpret: run the kernel in the Pallas interpreter (CPU tests).
    Returns:
      ``[B, Fa, Fb]`` (batch and free axes flattened), f32 or out_dtype.
    """
    a0, b0 = a, b
    _, _, va, vb, h = xla_fp8.in_place_views(a, b, dims, recipe, operand_dtypes, "xla_nvfp4",
                                             takes=takes_nvfp4, formats="NVFP4 x NVFP4")
    operand = functools.partial(_route_operand, recipe=recipe, h=h, signs=signs,
                                compiled=compiled, interpret=interpret)
    (ca, cb), (ba, bb) = dims
    da, db = operand_dtypes or (None, None)
    out = _block_scaled(operand(va, recipe.lhs, k_lhs, a0, ba, ca, da, False),
                        operand(vb, recipe.rhs, k_rhs, b0, bb, cb, db, pair_rhs), recipe)
    return _narrowed(out, out_dtype)


def _narrowed(out: jax.Array, out_dtype) -> jax.Array:
    """The block-scaled dot's f32 result, tensor-scaled, cast to out_dtype (None: f32 as it
    is). A narrower result is fenced (``optimization_barrier``) so that the cast runs right
    after the GEMM: XLA otherwise fuses it into the result's consumer and keeps the f32
    result alive until then (8B layer, B200: the gate projection's 448 MiB f32 result live
    across the up projection, at the layer's peak)."""
    if out_dtype is None:
        return out
    out = out.astype(out_dtype)
    if jnp.dtype(out_dtype).itemsize < 4:
        out = lax.optimization_barrier(out)
    return out


def _route_operand(view, op, key, x, batch, contract, dtype, pair, *, recipe, h, signs,
                   compiled, interpret):
    """One operand of `nvfp4_kernel_gemm`: by the one-pass kernel where it takes it, else
    `nvfp4_operand` of the canonical, rotated layout."""
    from mxjax.routes import xla_nvfp4_kernel as kernel  # Pallas: loaded on first use

    bf16_values = (dtype is not None and jnp.dtype(dtype) == jnp.bfloat16
                   and x.dtype == jnp.float32)
    kview = in_place.contraction_view(x, batch, contract) if bf16_values else view
    x2 = kernel_view(kview)
    if x2 is None or not kernel.takes_kernel(op, h, x2[0].dtype, key):
        k = view.x.shape[view.axis]
        # f32, as `canonical_operands` hands the operands to the rotation
        x3 = in_place.canonical_layout(view.x, view, k).astype(jnp.float32)
        if h is not None:
            x3 = jnp.pad(x3, ((0, 0), (0, 0), (0, (-k) % h)))
            x3 = hadamard(x3, h, axis=-1, signs=signs)
        return nvfp4_operand(x3, op, key)
    fixed_signs = recipe.hadamard is None or not recipe.hadamard.randomized
    stochastic = op.rounding is Rounding.STOCHASTIC
    pair = (pair and fixed_signs and not stochastic
            and all(n % _K_MULTIPLE == 0 for n in x2[0].shape))
    return kernel_operand(*x2, op, hadamard_size=h, signs=signs, pair=pair,
                          bf16_values=bf16_values, compiled=compiled, interpret=interpret,
                          key=key if stochastic else None)


def _packed_rhs_gemm(a, packed_q, *, b_shape, dims, recipe, key, gemm_name,
                     operand_dtypes=None, out_dtype=None, platform=None,
                     interpret: bool = False) -> jax.Array:
    """``Route.packed_rhs_gemm``: `_gemm` with the rhs given quantized (a packed residual):
    the lhs as `_gemm` quantizes it for `platform`, the rhs's codes and scales as they are.
    ``interpret``: the GPU path's kernel in the Pallas interpreter (CPU tests)."""
    del b_shape, gemm_name  # NVFP4's block-scaled dot reads the canonical rhs directly
    if not takes_nvfp4(recipe):
        raise ValueError(f"recipe: the 'xla_nvfp4' backend takes NVFP4 x NVFP4, got "
                         f"{recipe.lhs.fmt.name} x {recipe.rhs.fmt.name}")
    k_lhs, _, k_had = split_key(key if recipe.needs_key else None)
    da = None if operand_dtypes is None else operand_dtypes[0]
    (ca, _), (ba, _) = dims
    if platform == "gpu" or interpret:
        h = None if recipe.hadamard is None else recipe.hadamard.block_size
        signs = None if h is None else rotation_signs(recipe.hadamard, k_had)
        cast = a if da is None else a.astype(da)
        lhs = _route_operand(in_place.contraction_view(cast, ba, ca), recipe.lhs, k_lhs, a,
                             ba, ca, da, False, recipe=recipe, h=h, signs=signs,
                             compiled=not interpret, interpret=interpret)
    else:
        a3 = rotate_operand(canonical_operand(a if da is None else a.astype(da), ba, ca),
                            recipe, k_had)
        lhs = nvfp4_operand(a3, recipe.lhs, k_lhs)
    out = _block_scaled(lhs, packed_operand(packed_q), recipe)
    out = out.reshape(tuple(a.shape[i] for i in ba)
                      + (free_size(a, ba, ca), packed_q.shape[-2]))
    return _narrowed(out, out_dtype)


def _pack_rhs(b, *, dims, recipe, key, operand_dtype=None,
              interpret: bool = False) -> MXArray | None:
    """``Route.pack_rhs`` (lowering for a GPU): the rhs of the GEMM `dims` as
    `mxjax.residuals.pack_rhs` makes it, by the one-pass kernel (its tensor scale by one
    reduction, codes and scales by one read); None where the kernel does not take it
    (stochastic rounding, which draws with the GEMM's key; batch axes, ...)."""
    from mxjax.routes import xla_nvfp4_kernel as kernel  # Pallas: loaded on first use

    read = kernel_pack_input(b, dims=dims, recipe=recipe, key=key,
                             operand_dtype=operand_dtype, takes_recipe=takes_nvfp4,
                             takes_kernel=kernel.takes_kernel)
    if read is None:
        return None
    x2, axis, h, signs, bf16_values = read
    kw = {"hadamard_size": h, "signs": signs, "bf16_values": bf16_values,
          "compiled": not interpret, "interpret": interpret}
    if h is None and all(n % _K_MULTIPLE == 0 for n in x2.shape):
        # The weight without a Hadamard: fprop's pair call (`_gemm`'s pair_rhs), which
        # XLA merges with this one, quantizes it in both directions in one read.
        row, col = kernel.nvfp4_operand_pair(x2, recipe.rhs, **kw)
        codes, scale_bytes, t = row if axis == 1 else col
    else:
        codes, scale_bytes, t = kernel.nvfp4_operand(x2, axis, recipe.rhs, **kw)
    k = x2.shape[axis]
    k_logical = k if h is None else -(-k // h) * h
    k16 = -(-k_logical // _NV_BLOCK) * _NV_BLOCK  # quantize_with's codes stop at 16
    return MXArray(codes[:, :k16 // 2], scale_bytes[:, :k16 // _NV_BLOCK], t,
                   (x2.shape[1 - axis], k_logical), 1, recipe.rhs.fmt,
                   bool(recipe.rhs.sr_prescale))


def kernel_operand(x2: jax.Array, axis: int, op, *, hadamard_size: int | None, signs,
                   pair: bool = False, bf16_values: bool = False, compiled: bool = False,
                   interpret: bool = False, key=None):
    """`nvfp4_operand`'s result for a 2-D operand by the one-pass kernel
    (`mxjax.routes.xla_nvfp4_kernel`): ``(float4_e2m1fn [1, F, Kp], float8_e4m3fn
    [1, F, Kp // 16], f32 tensor scale)``, Kp the contraction padded to 32.

    ``pair``: quantize x2 along both axes in one kernel call and take this axis' copy
    (both sizes multiples of 32; deterministic rounding). ``key``: the rounding key of a
    stochastically rounded operand (the kernel draws the emulation's uniforms from it).
    """
    from mxjax.routes import xla_nvfp4_kernel as kernel  # Pallas: loaded on first use

    kw = {"hadamard_size": hadamard_size, "signs": signs, "bf16_values": bf16_values,
          "compiled": compiled, "interpret": interpret}
    if pair:
        row, col = kernel.nvfp4_operand_pair(x2, op, **kw)
        codes, scale_bytes, t = row if axis == 1 else col
    else:
        codes, scale_bytes, t = kernel.nvfp4_operand(x2, axis, op, key=key, **kw)
    f = codes.shape[0]
    # u8 -> f4 bitcast: XLA puts the first element in the low nibble, as the kernel packs.
    elements = lax.bitcast_convert_type(codes, jnp.float4_e2m1fn).reshape(1, f, -1)
    scales = lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn).reshape(1, f, -1)
    return elements, scales, t


def _gemm(a, b, *, dims, recipe, key, gemm_name, operand_dtypes=None, out_dtype=None,
          platform=None) -> jax.Array:
    if platform == "gpu":
        # The one-pass operand kernel (mxjax.routes.xla_nvfp4_kernel) where it takes an
        # operand; the same bits as the XLA form below.
        pair_rhs = gemm_name in ("fprop", "dgrad") and recipe.hadamard is None
        route = functools.partial(nvfp4_kernel_gemm, pair_rhs=pair_rhs, compiled=True)
        return in_place_route_gemm(route, a, b, dims=dims, recipe=recipe, key=key,
                                   operand_dtypes=operand_dtypes, out_dtype=out_dtype)
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
    packed_rhs_gemm=_packed_rhs_gemm,
    pack_rhs=_pack_rhs,
)
