"""MXFP8 GEMMs on Blackwell's block-scaled MMA, operands quantized in place: 'xla_mxfp8'.

MXFP8 (E4M3 or E5M2 elements, an E8M0 scale per 32 along K) is one of the two operand
configurations XLA lowers ``jax.nn.scaled_matmul`` to cuDNN's block-scaled MMA for
(``__cudnn$blockScaledDot`` on B200): the codes are the f8 elements and the scale bytes
``float8_e8m0fnu``, as they are.

The emulation's CUDA form already hands MXFP8 operands to ``scaled_matmul``
(`mxjax.emulation.fp8_units.block_scaled_dot`), but quantizes them canonically: each
operand transposed into ``[batch..., F, K]`` in bf16, then mxjax's quantizer. This route
quantizes each operand where it is instead, as 'xla_fp4' does for MXFP4
(`mxjax.emulation.in_place.mx_operand_values`: the block amax in one fused pass, the
scale, the rounding and the f8 encode in a second that writes one byte per element),
and lays the f8 codes (not the bf16 input) out as ``[B, F, K]`` for the dot.
``mxfp8_gemm(kernel=True)`` takes the operands the one-pass kernel takes
(`mxjax.routes.xla_mxfp8_kernel`: deterministic rounding, no batch axes) from it instead:
one read, both directions (`kernel_operand`), the same bits; the route's GEMM does so
when lowering for a GPU, rounding by PTX's FP8 cvt (`_gemm`).

**Values.** The in-place values are `mxjax.quantize`'s bit for bit (stochastic
rounding's uniforms drawn in the canonical shape from the same key,
`mxjax.emulation.in_place`), so the elements and scale bytes are the emulation's
(``tests/mxjax/routes/test_xla_mxfp8.py`` compares them with `mxjax.quantize_with`).
Encoding a value ``q * 2^s`` as its element is exact: ``s`` is within E8M0's
``[-127, 127]``, the values are exact in f32 (E4M3's smallest, ``2^-9 * 2^-127``, has
its last bit above f32's ``2^-149``), and ``2^-s`` is applied as two normal-range
multiplies. A non-finite block has E8M0's NaN byte (0xFF) and zero codes, as the quantizer
writes them and the emulation's CUDA form hands them to the same dot; an all-zero
block has zero codes.
The result is the emulation's up to the order of the f32 sums. A bf16 result (the
GEMM's output dtype, no SR unscale after it) is rounded by cuDNN from its f32 sums, as
'xla_fp8' and 'xla_fp4' let it (`xla_fp8.narrow_result`): with no factor after the dot,
the same bits as rounding the f32 result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from mxjax import _bits
from mxjax.emulation import in_place
from mxjax.operands import free_size, rotation_signs, split_key
from mxjax.quantization import MXArray
from mxjax.routes import xla_fp8
from mxjax.routes.spec import Route, check_canonical_operand, in_place_route_gemm
from mxjax.routes.xla_fp4 import kernel_pack_input, kernel_view
from mxjax.routes.xla_nvfp4 import blackwell_block_scaled
from mxjax.scaling import SR_UNSCALE

__all__ = ["F8_DTYPES", "ROUTE", "in_place_operand", "kernel_operand", "mxfp8_gemm",
           "packed_operand", "takes_mxfp8"]

F8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
_MX_BLOCK = 32


def _mxfp8_format(fmt) -> bool:
    return (fmt.element is not None and fmt.element.name in F8_DTYPES
            and fmt.scale == "e8m0" and fmt.block_size == _MX_BLOCK)


def _mxfp8(op) -> bool:
    return _mxfp8_format(op.fmt)


def takes_mxfp8(recipe) -> bool:
    """Whether both operands of the GEMM recipe are MXFP8 (E4M3/E5M2, E8M0 scales per 32)."""
    return _mxfp8(recipe.lhs) and _mxfp8(recipe.rhs)


def _f8_finish(v, amax_bits, op):
    """`mx_operand_values`' finish: the f32 values ``q * 2^s`` as f8 codes ``q``, and the
    blocks' E8M0 scale bytes; a non-finite block gets the quantizer's zero codes and
    E8M0's NaN byte 0xFF."""
    s, nonfinite = op.scheme.exponents(amax_bits, op.scale_rule, op.sr_prescale)
    half = (-s) // 2  # 2^-s as two normal-range factors (s in [-127, 127])
    q = jnp.where(nonfinite, 0.0, (v * _bits.pow2(half)) * _bits.pow2(-s - half))
    scale_bytes = jnp.where(nonfinite, 0xFF, s + 127).astype(jnp.uint8)
    return q.astype(F8_DTYPES[op.fmt.element.name]), scale_bytes


def in_place_operand(view, op, key, *, k_out: int, hadamard_size: int | None, signs):
    """One MXFP8 operand quantized in place: (f8 elements ``[B, F, k_out]``, E8M0 scales
    ``float8_e8m0fnu [B, F, k_out // 32]``).

    ``view``: the operand with its contraction merged (`in_place.contraction_view`);
    ``k_out``: the contraction padded with zeros to a multiple of 32 and of the Hadamard
    size.
    """
    if not _mxfp8(op):
        raise ValueError(f"op: expected an MXFP8 operand recipe, got {op!r}")
    q, scale_bytes = in_place.mx_operand_values(
        view, op, key=key, finish=functools.partial(_f8_finish, op=op), k_out=k_out,
        hadamard_size=hadamard_size, signs=signs, split_halves=False)
    shape = list(view.x.shape)
    shape[view.axis] = k_out // _MX_BLOCK
    scales = scale_bytes.reshape(shape)
    return (in_place.canonical_layout(q, view, k_out),
            lax.bitcast_convert_type(in_place.canonical_layout(scales, view, k_out // _MX_BLOCK),
                                     jnp.float8_e8m0fnu))


def mxfp8_gemm(a: jax.Array, b: jax.Array, dims, recipe, k_lhs, k_rhs, signs, *,
               operand_dtypes=None, out_dtype=None, kernel: bool = False,
               f8_cvt: bool = False, interpret: bool = False) -> jax.Array:
    """``dot_general(a, b, dims)`` under an MXFP8 recipe on the block-scaled dot.

    Args:
      a, b: the GEMM's operands (any float dtype), ``dims`` lax dimension numbers.
      recipe: a GemmRecipe that `takes_mxfp8`.
      k_lhs, k_rhs: the rounding keys (stochastic rounding) or None.
      signs: the Hadamard's ±1 vector or None.
      operand_dtypes: None or a pair of dtypes (or None) a and b are cast to first.
      out_dtype: the f32 result is cast to this (None: f32).
      kernel: quantize each operand the one-pass kernel takes
        (`mxjax.routes.xla_mxfp8_kernel.takes_kernel`, `xla_fp4.kernel_view`) by it
        (`kernel_operand`: one read, both directions where the signs are fixed and both
        sizes are multiples of the step), the others in place; the same bits either way.
        The route's GEMM sets it when lowering for a GPU (`_gemm`).
      f8_cvt: the kernel rounds by PTX's FP8 cvt (`xla_mxfp8_kernel.has_f8_cvt`).
      interpret: run the kernel in the Pallas interpreter (CPU tests).
    Returns:
      ``[B, Fa, Fb]`` (batch and free axes flattened), f32 or out_dtype, times each
      operand's SR unscale.
    """
    a0, b0 = a, b  # before the operand casts: the kernel rounds an f32 operand to bf16 itself
    _, _, va, vb, h = xla_fp8.in_place_views(a, b, dims, recipe, operand_dtypes, "xla_mxfp8",
                                             takes=takes_mxfp8, formats="MXFP8 x MXFP8")
    operand = functools.partial(_route_operand, recipe=recipe, h=h, signs=signs,
                                kernel=kernel, f8_cvt=f8_cvt, interpret=interpret)
    (ca, cb), (ba, bb) = dims
    da, db = operand_dtypes or (None, None)
    return _block_scaled(operand(va, recipe.lhs, k_lhs, a0, ba, ca, da),
                         operand(vb, recipe.rhs, k_rhs, b0, bb, cb, db), recipe, out_dtype)


def _route_operand(view, op, key, x, batch, contract, dtype, *, recipe, h, signs, kernel,
                   f8_cvt, interpret):
    """One operand of `mxfp8_gemm`: (f8 elements ``[B, F, Kp]``, E8M0 scales), by the
    one-pass kernel where ``kernel`` and it takes the operand, else quantized in place."""
    step = max(_MX_BLOCK, h or 1)
    if kernel:
        from mxjax.routes import xla_mxfp8_kernel as one_pass  # Pallas: on first use

        bf16_values = (dtype is not None and jnp.dtype(dtype) == jnp.bfloat16
                       and x.dtype == jnp.float32)
        kview = in_place.contraction_view(x, batch, contract) if bf16_values else view
        x2 = kernel_view(kview)
        if x2 is not None and one_pass.takes_kernel(op, h, x2[0].dtype):
            fixed_signs = recipe.hadamard is None or not recipe.hadamard.randomized
            pair = fixed_signs and all(n % step == 0 for n in x2[0].shape)
            return kernel_operand(*x2, op, hadamard_size=h, signs=signs, pair=pair,
                                  bf16_values=bf16_values, interpret=interpret,
                                  f8_cvt=f8_cvt)
    k = view.x.shape[view.axis]
    return in_place_operand(view, op, key, k_out=-(-k // step) * step, hadamard_size=h,
                            signs=signs)


def _block_scaled(lhs, rhs, recipe, out_dtype) -> jax.Array:
    """scaled_matmul of two MXFP8 operands ``(elements, scales)``: ``[B, Fa, Fb]``, the
    result cast to out_dtype (None: f32) after each SR unscale."""
    (ae, asc), (be, bsc) = lhs, rhs
    if xla_fp8.narrow_result(recipe, out_dtype):
        # cuDNN rounds its f32 sums to bf16 itself: 2 bytes per result, not 4 and a pass
        # (no factor follows, so the same bits as rounding the f32 result).
        return jax.nn.scaled_matmul(ae, be, asc, bsc, preferred_element_type=jnp.bfloat16)
    out = jax.nn.scaled_matmul(ae, be, asc, bsc, preferred_element_type=jnp.float32)
    for op in (recipe.lhs, recipe.rhs):
        if op.sr_prescale:
            out = out * jnp.float32(SR_UNSCALE)
    return out if out_dtype is None else out.astype(out_dtype)


def packed_operand(q: MXArray):
    """A canonical MXFP8 MXArray ``[batch..., F, K]`` (blocked along its last axis, e.g. a
    quantized residual, `mxjax.residuals`) as the block-scaled dot takes it: (f8 elements
    ``[B, F, Kp]``, ``float8_e8m0fnu`` scales ``[B, F, Kp // 32]``), its codes and scale
    bytes reinterpreted (Kp: K padded to 32, as the quantizer stores the codes)."""
    check_canonical_operand(q, "MXFP8", _mxfp8_format)
    f, kp = q.codes.shape[-2:]
    codes = q.codes.reshape(-1, f, kp)
    scales = q.scales.reshape(-1, f, q.scales.shape[-1])
    return (lax.bitcast_convert_type(codes, F8_DTYPES[q.fmt.element.name]),
            lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu))


def kernel_operand(x2: jax.Array, axis: int, op, *, hadamard_size: int | None, signs,
                   pair: bool = False, bf16_values: bool = False, interpret: bool = False,
                   f8_cvt: bool = False):
    """`in_place_operand`'s result for a 2-D operand by the one-pass kernel
    (`mxjax.routes.xla_mxfp8_kernel`): (f8 elements ``[1, F, Kp]``, ``float8_e8m0fnu``
    scales ``[1, F, Kp // 32]``), Kp the contraction padded to 32 and the Hadamard size.

    ``pair``: quantize x2 along both axes in one kernel call and take this axis' copy (the
    other GEMM that reads x2 with the same recipe makes the identical call, which XLA
    merges); both sizes multiples of 32 and of the Hadamard size. ``f8_cvt``: round by
    PTX's FP8 cvt (`xla_mxfp8_kernel.has_f8_cvt`; the same codes).
    """
    codes, scale_bytes = _kernel_codes(x2, axis, op, hadamard_size=hadamard_size, signs=signs,
                                       pair=pair, bf16_values=bf16_values,
                                       interpret=interpret, f8_cvt=f8_cvt)
    f = codes.shape[0]
    elements = lax.bitcast_convert_type(codes, F8_DTYPES[op.fmt.element.name])
    scales = lax.bitcast_convert_type(scale_bytes, jnp.float8_e8m0fnu)
    return elements.reshape(1, f, -1), scales.reshape(1, f, -1)


def _kernel_codes(x2, axis, op, *, hadamard_size, signs, pair, bf16_values, interpret,
                  f8_cvt):
    """The one-pass kernel's uint8 (codes ``[F, Kp]``, scale bytes ``[F, Kp // 32]``) of x2
    along `axis`; ``pair``: from the call that writes both directions."""
    from mxjax.routes import xla_mxfp8_kernel as one_pass  # Pallas: loaded on first use

    kw = {"hadamard_size": hadamard_size, "signs": signs, "bf16_values": bf16_values,
          "interpret": interpret, "f8_cvt": f8_cvt}
    if pair:
        row, col = one_pass.mxfp8_operand_pair(x2, op, **kw)
        return row if axis == 1 else col
    return one_pass.mxfp8_operand(x2, axis, op, **kw)


def _kernel_options(platform, interpret: bool = False) -> dict:
    """`mxfp8_gemm`'s kernel settings: on a GPU (or in the interpreter) the one-pass operand
    kernel, rounding by PTX's FP8 cvt where the GPU has it (the same bits as the XLA form).
    Without the cvt its integer rounding made it the slower form (B200 calibrated, 8B
    layer: 27.34 ms against the XLA form's 12.96); the cvt takes a pair kernel at [8192,
    4096] from 583 to 87 us (bench/operand_kernel_launch.py)."""
    if interpret:
        return {"kernel": True, "interpret": True}
    if platform != "gpu":
        return {}
    from mxjax.chips import target_chip
    from mxjax.routes.xla_mxfp8_kernel import has_f8_cvt  # Pallas: on first use

    return {"kernel": True, "f8_cvt": has_f8_cvt(target_chip("gpu").compute_capability)}


def _gemm(a, b, *, dims, recipe, key, gemm_name, operand_dtypes=None, out_dtype=None,
          platform=None) -> jax.Array:
    del gemm_name
    route = functools.partial(mxfp8_gemm, **_kernel_options(platform))
    return in_place_route_gemm(route, a, b, dims=dims, recipe=recipe, key=key,
                               operand_dtypes=operand_dtypes, out_dtype=out_dtype)


def _packed_rhs_gemm(a, packed_q, *, b_shape, dims, recipe, key, gemm_name,
                     operand_dtypes=None, out_dtype=None, platform=None,
                     interpret: bool = False) -> jax.Array:
    """``Route.packed_rhs_gemm``: `_gemm` with the rhs given quantized (a packed residual):
    the lhs as `_gemm` quantizes it for `platform` (``interpret``: the GPU path's kernel in
    the Pallas interpreter, CPU tests), the rhs's f8 codes and E8M0 bytes as they are."""
    del b_shape, gemm_name  # the block-scaled dot reads the canonical rhs directly
    if not takes_mxfp8(recipe):
        raise ValueError(f"recipe: the 'xla_mxfp8' backend takes MXFP8 x MXFP8, got "
                         f"{recipe.lhs.fmt.name} x {recipe.rhs.fmt.name}")
    k_lhs, _, k_had = split_key(key if recipe.needs_key else None)
    h = None if recipe.hadamard is None else recipe.hadamard.block_size
    signs = None if h is None else rotation_signs(recipe.hadamard, k_had)
    da = None if operand_dtypes is None else operand_dtypes[0]
    (ca, _), (ba, _) = dims
    opts = {"kernel": False, "f8_cvt": False, "interpret": False,
            **_kernel_options(platform, interpret)}
    view = in_place.contraction_view(a if da is None else a.astype(da), ba, ca)
    lhs = _route_operand(view, recipe.lhs, k_lhs, a, ba, ca, da, recipe=recipe, h=h,
                         signs=signs, **opts)
    out = _block_scaled(lhs, packed_operand(packed_q), recipe, out_dtype)
    return out.reshape(tuple(a.shape[i] for i in ba)
                       + (free_size(a, ba, ca), packed_q.shape[-2]))


def _pack_rhs(b, *, dims, recipe, key, operand_dtype=None,
              interpret: bool = False) -> MXArray | None:
    """``Route.pack_rhs`` (lowering for a GPU): the rhs of the GEMM `dims` as
    `mxjax.residuals.pack_rhs` makes it, by the one-pass kernel, from the call the forward
    GEMM makes for the same operand where it writes both directions (X's wgrad direction
    and W's dgrad one come with fprop's read); None where the kernel does not take it
    (stochastic rounding, batch axes, ...)."""
    from mxjax.routes import xla_mxfp8_kernel as one_pass  # Pallas: loaded on first use

    read = kernel_pack_input(b, dims=dims, recipe=recipe, key=key,
                             operand_dtype=operand_dtype, takes_recipe=takes_mxfp8,
                             takes_kernel=one_pass.takes_kernel)
    if read is None:
        return None
    x2, axis, h, signs, bf16_values = read
    step = max(_MX_BLOCK, h or 1)
    fixed_signs = recipe.hadamard is None or not recipe.hadamard.randomized
    opts = _kernel_options("gpu", interpret)
    codes, scale_bytes = _kernel_codes(
        x2, axis, recipe.rhs, hadamard_size=h, signs=signs,
        pair=fixed_signs and all(n % step == 0 for n in x2.shape), bf16_values=bf16_values,
        interpret=interpret, f8_cvt=opts.get("f8_cvt", False))
    k = x2.shape[axis]
    k_logical = k if h is None else -(-k // h) * h
    kp = -(-k_logical // _MX_BLOCK) * _MX_BLOCK  # quantize_with's codes stop at 32
    return MXArray(codes[:, :kp], scale_bytes[:, :kp // _MX_BLOCK], None,
                   (x2.shape[1 - axis], k_logical), 1, recipe.rhs.fmt,
                   bool(recipe.rhs.sr_prescale))


ROUTE = Route(
    name="xla_mxfp8",
    summary=("MXFP8 quantized in place for XLA's block-scaled dot (cuDNN's MXFP8 MMA on "
             "Blackwell)"),
    formats=("mxfp8_e4m3", "mxfp8_e5m2"),
    runs_on=blackwell_block_scaled,
    gemm=_gemm,
    packed_dot=None,
    evidence=("layer_8b.b200.mxfp8_rates_roofline",),
    packed_rhs_gemm=_packed_rhs_gemm,
    pack_rhs=_pack_rhs,
)
