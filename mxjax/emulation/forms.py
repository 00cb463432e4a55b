"""The emulation (backend 'xla'): quantize, dequantize, one GEMM with f32 accumulation.

Its program depends on the platform it is lowered for (`mxjax._platform.per_platform`),
not on the tracing machine. XLA:CPU gets canonical operands (`mxjax.operands`),
dequantized to f32 and each materialized, in one f32 GEMM at HIGHEST. GPUs and TPUs get
bf16 operands at DEFAULT (exact, see docs/NUMERICS.md) with per-tensor scales applied to
the f32 result and no CPU-only barriers: MX operands quantized in place
(`mxjax.emulation.in_place`, its TPU kernel `in_place_tpu`), others canonical. CUDA
runs per-tensor FP8 and MXFP8 recipes on FP8 tensor cores
(`mxjax.emulation.fp8_units`). Every form gives the same values. `emulated_packed_rhs_gemm`
runs the canonical forms on an rhs the forward pass quantized (`mxjax.residuals`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from mxjax._platform import cpu_barrier, cuda_or_other, per_platform
from mxjax.dimensions import Dims, free_axes
from mxjax.emulation import fp8_units, in_place
from mxjax.emulation.in_place import cast_operands
from mxjax.layout import canonical_dimension_numbers
from mxjax.operands import (
    canonical_operand,
    canonical_operands,
    free_size,
    rotate,
    rotate_operand,
    rotation_signs,
    split_key,
)
from mxjax.quantization import MXArray, dequantize, fake_quantize_parts_with, fake_quantize_with
from mxjax.rotation import hadamard
from mxjax.scaling import SR_UNSCALE, OperandRange

__all__ = ["accelerator_gemm", "accelerator_operand_dtype", "emulated_gemm",
           "emulated_packed_rhs_gemm", "emulates_packed_rhs", "emulation_packs_rhs",
           "operand_range",
           "takes_f8_on_cuda"]


def _prepare_operand(x, recipe, key) -> jax.Array:
    """The operand's f32 values: `x` quantized under `recipe`, or, for an `MXArray` (an
    operand the forward pass quantized already, `emulated_packed_rhs_gemm`), the values it
    holds (``fake_quantize``'s, bit for bit)."""
    if isinstance(x, MXArray):
        return dequantize(x, jnp.float32)
    return fake_quantize_with(x, recipe, -1, key=key)


def _prepare_operand_parts(x, recipe, key):
    """(values, per-tensor f32 factors): the operand is ``values * factors[0] * ...``.

    The factors (NVFP4's and per-tensor FP8's tensor scale, the 4/3 SR unscale)
    are left out of ``values`` so that they can be applied to the GEMM's f32 result.
    ``x``: an operand to quantize under `recipe`, or an `MXArray` quantized already.
    """
    if isinstance(x, MXArray):  # its values without the tensor scale and the SR unscale
        one = None if x.tensor_scale is None else jnp.float32(1.0)
        bare = dataclasses.replace(x, tensor_scale=one, sr_prescale=False)
        values, tensor_scale, prescaled = dequantize(bare), x.tensor_scale, x.sr_prescale
    else:
        values, tensor_scale = fake_quantize_parts_with(x, recipe, -1, key=key)
        prescaled = recipe.sr_prescale
    factors = () if tensor_scale is None else (tensor_scale,)
    if prescaled:
        factors += (jnp.float32(SR_UNSCALE),)
    return values, factors


def operand_range(recipe) -> OperandRange:
    """Trace-time range of an operand's `fake_quantize_parts` values, from its format.

    The scaling scheme's range (``mxjax.scaling``: E8M0 formats: element grid
    times 2^s, s in [-127, 127]; NVFP4: E2M1 times an E4M3 block scale, the
    tensor scale being a factor; per-tensor FP8: the element grid); a
    pass-through operand can be any f32 value.
    """
    if recipe.is_passthrough:
        return OperandRange(None, None)
    return recipe.scheme.operand_range()


def accelerator_operand_dtype(recipe):
    """The dtype of a quantized GEMM's operands on GPU/TPU, decided at trace time.

    bf16 (at DEFAULT precision, f32 accumulation) when every value of both
    operands is exactly a bf16 value (`OperandRange.bf16_exact`): MXFP4, NVFP4,
    per-tensor FP8. Otherwise f32 at HIGHEST, the explicit fallback documented in
    docs/NUMERICS.md: MXFP8 (E4M3/E5M2 x E8M0 reaches 2^-136 / 2^-143, below
    bf16's 2^-133) and a pass-through operand inside a quantized GEMM.
    """
    if operand_range(recipe.lhs).bf16_exact and operand_range(recipe.rhs).bf16_exact:
        return jnp.bfloat16
    return jnp.float32


def _cpu_gemm(a3, b3, recipe, k_lhs, k_rhs):
    """XLA:CPU form: dequantized f32 operands, each materialized, one f32 GEMM at HIGHEST.

    ``b3``: the canonical rhs, or an `MXArray` of it quantized already (its values)."""
    aq = cpu_barrier(_prepare_operand(a3, recipe.lhs, k_lhs))
    bq = cpu_barrier(_prepare_operand(b3, recipe.rhs, k_rhs))
    return lax.dot_general(aq, bq, canonical_dimension_numbers(a3.ndim - 2),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def accelerator_gemm(a3, b3, recipe, k_lhs, k_rhs):
    """GPU/TPU form: no barriers; bf16 operands at DEFAULT with f32 accumulation.

    Per-tensor factors are applied to the f32 result, lhs's then rhs's, one
    multiply each. Formats whose values bf16 cannot hold fall back to f32 at
    HIGHEST (`accelerator_operand_dtype`). ``b3``: the canonical rhs, or an `MXArray` of
    it quantized already.
    """
    dims = canonical_dimension_numbers(a3.ndim - 2)
    if accelerator_operand_dtype(recipe) != jnp.bfloat16:
        aq = _prepare_operand(a3, recipe.lhs, k_lhs)
        bq = _prepare_operand(b3, recipe.rhs, k_rhs)
        return lax.dot_general(aq, bq, dims, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    av, a_factors = _prepare_operand_parts(a3, recipe.lhs, k_lhs)
    bv, b_factors = _prepare_operand_parts(b3, recipe.rhs, k_rhs)
    out = lax.dot_general(av.astype(jnp.bfloat16), bv.astype(jnp.bfloat16), dims,
                          precision=lax.Precision.DEFAULT, preferred_element_type=jnp.float32)
    for factor in a_factors + b_factors:
        out = out * factor
    return out


def _layout_free(recipe) -> bool:
    """Whether both operands' quantized values do not depend on their layout.

    Per-tensor FP8 without a rotation or uniforms: the scale is the whole tensor's
    amax, the rounding elementwise, so quantizing an operand before or after the
    transpose into the canonical layout gives the same values.
    """
    return (recipe.lhs.fmt.is_per_tensor and recipe.rhs.fmt.is_per_tensor
            and recipe.hadamard is None and not recipe.needs_key)


def _canonical_cpu_form(a, b, dims: Dims, recipe, k_lhs, k_rhs, k_had):
    if _layout_free(recipe):
        # Quantized where they are, then laid out: the same operand quantized by two
        # GEMMs of a layer (X by fprop and wgrad, W by fprop and dgrad, dY by dgrad and
        # wgrad) is then the same computation, which XLA computes once.
        aq = cpu_barrier(_prepare_operand(a.astype(jnp.float32), recipe.lhs, None))
        bq = cpu_barrier(_prepare_operand(b.astype(jnp.float32), recipe.rhs, None))
        a3, b3 = canonical_operands(aq, bq, dims)
        return lax.dot_general(a3, b3, canonical_dimension_numbers(a3.ndim - 2),
                               precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    if _blockwise_mx(recipe):
        # MX operands, deterministic: each device rotates and quantizes its own shard
        # (`in_place.blockwise`), where XLA's partitioner would gather it first.
        a3, b3 = canonical_operands(a, b, dims)
        h = None if recipe.hadamard is None else recipe.hadamard.block_size
        signs = None if h is None else rotation_signs(recipe.hadamard, None)
        extra = () if signs is None else (jnp.asarray(signs, jnp.float32),)
        k = a3.shape[-1]
        k_out = k if h is None else -(-k // h) * h
        step = max(in_place.MX_BLOCK, h or 1)
        aq, bq = (in_place.blockwise(functools.partial(_cpu_operand, op=op, h=h), x3, *extra,
                                     axis=-1, k_out=k_out, step=step)
                  for x3, op in ((a3, recipe.lhs), (b3, recipe.rhs)))
        return lax.dot_general(aq, bq, canonical_dimension_numbers(a3.ndim - 2),
                               precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    a3, b3 = rotate(*canonical_operands(a, b, dims), recipe, k_had)
    return _cpu_gemm(a3, b3, recipe, k_lhs, k_rhs)


def _blockwise_mx(recipe) -> bool:
    """Whether both operands are E8M0-scaled (no per-tensor scale) and nothing is random."""
    return (recipe.lhs.fmt.scale == "e8m0" and recipe.rhs.fmt.scale == "e8m0"
            and not recipe.needs_key)


def _cpu_operand(x3, k_out, *signs, op, h):
    """One canonical operand as `_cpu_gemm` gets it from `rotate`: zero-padded to k_out,
    rotated (each materialized), fake-quantized along K."""
    if h is not None:
        pad = k_out - x3.shape[-1]
        if pad:
            x3 = jnp.pad(x3, [(0, 0)] * (x3.ndim - 1) + [(0, pad)])
        x3 = cpu_barrier(hadamard(x3, h, axis=-1, signs=signs[0] if signs else None))
    return cpu_barrier(_prepare_operand(x3, op, None))


def _in_place_mx(recipe) -> bool:
    """Whether the accelerator form quantizes the operands in place (MX formats, bf16-exact)."""
    return (recipe.lhs.fmt.scale == "e8m0" and recipe.rhs.fmt.scale == "e8m0"
            and accelerator_operand_dtype(recipe) == jnp.bfloat16)


def _accelerator_form(a, b, dims: Dims, recipe, k_lhs, k_rhs, k_had, *,
                      form: str, operand_dtypes=None):
    """GPU/TPU forms: MX operands in place (`mxjax.emulation.in_place`), others canonical.

    ``operand_dtypes``: the GEMM of the operands cast to them (`gemm`); the in-place
    forms take the casts into their quantize pass.
    """
    if _in_place_mx(recipe):
        signs = None if recipe.hadamard is None else rotation_signs(recipe.hadamard, k_had)
        out = in_place.mx_gemm(a, b, dims, recipe, k_lhs, k_rhs, signs, form=form,
                                  operand_dtypes=operand_dtypes)
        (ca, cb), (ba, bb) = dims
        nb = len(ba)
        return out.reshape(out.shape[:nb] + (
            math.prod(a.shape[i] for i in free_axes(a.ndim, ba, ca)),
            math.prod(b.shape[i] for i in free_axes(b.ndim, bb, cb))))
    a3, b3 = rotate(*canonical_operands(*cast_operands(a, b, operand_dtypes), dims), recipe, k_had)
    return accelerator_gemm(a3, b3, recipe, k_lhs, k_rhs)


def _cuda_f8_form(a, b, dims: Dims, recipe, k_lhs, k_rhs, k_had, *,
                  operand_dtypes=None, swap: bool = False):
    """CUDA form of FP8 recipes: f8 operands on FP8 tensor cores (`mxjax.emulation.fp8_units`).

    Per-tensor FP8 operands are quantized in place (their scale is the whole tensor's,
    whatever the layout) unless the recipe rotates or draws uniforms, which follow
    the canonical layout; MXFP8 operands always take the canonical layout
    (``jax.nn.scaled_matmul``'s). ``swap`` (the wgrad): the in-place GEMM is computed as
    ``dot_general(b, a)`` and transposed back, the same products and factors (applied in
    the same order), so that XLA writes the f32 result in the layout of the weight it is
    the gradient of and fuses the factors into the GEMM (as ``dot_general(a, b)`` the
    FP8 GEMM's result comes out transposed, and scaling it is a kernel of its own).
    Returns f32 ``[batch..., Fa, Fb]``.
    """
    a, b = cast_operands(a, b, operand_dtypes)
    (ca, cb), (ba, bb) = dims
    if fp8_units.takes_block_scaled(recipe):
        a3, b3 = rotate(*canonical_operands(a, b, dims), recipe, k_had)
        return fp8_units.block_scaled_dot(a3, b3, recipe, k_lhs, k_rhs)
    if recipe.hadamard is None and not recipe.needs_key:
        aq, a_factors = fp8_units.f8_operand(a, recipe.lhs, None)
        bq, b_factors = fp8_units.f8_operand(b, recipe.rhs, None)
        fa, fb = free_size(a, ba, ca), free_size(b, bb, cb)
        if not swap:
            out = fp8_units.f8_dot(aq, bq, dims.as_lax(), a_factors, b_factors)
            return out.reshape(out.shape[:len(ba)] + (fa, fb))
        # dot(b, a), transposed back (the factors in the same order as above).
        out = fp8_units.f8_dot(bq, aq, ((cb, ca), (bb, ba)), a_factors, b_factors)
        out = out.reshape(out.shape[:len(ba)] + (fb, fa))
        return jnp.swapaxes(out, -1, -2)
    a3, b3 = rotate(*canonical_operands(a, b, dims), recipe, k_had)
    aq, a_factors = fp8_units.f8_operand(a3, recipe.lhs, k_lhs)
    bq, b_factors = fp8_units.f8_operand(b3, recipe.rhs, k_rhs)
    return fp8_units.f8_dot(aq, bq, canonical_dimension_numbers(a3.ndim - 2),
                                  a_factors, b_factors)


def takes_f8_on_cuda(recipe) -> bool:
    """Whether the GEMM's CUDA form runs on FP8 tensor cores (per-tensor FP8 or MXFP8)."""
    return fp8_units.takes_f8_operands(recipe) or fp8_units.takes_block_scaled(recipe)


# Jitted (inlined into the caller's jaxpr) so that JAX caches its trace per operand
# types and static arguments: all three platform forms are traced (lowering keeps one),
# and a program with many GEMMs of the same shapes (a model's layers, a GEMM and its
# rematerialization, a test suite) would otherwise trace them again at every call. Its
# ops carry the scope 'jit(emulated_gemm)' below the caller's.
@functools.partial(jax.jit, inline=True,
                   static_argnames=("dims", "recipe", "gemm_name", "operand_dtypes", "out_dtype"))
def emulated_gemm(a: jax.Array, b: jax.Array, dims: Dims, recipe, key,
                  gemm_name: str, operand_dtypes=None, out_dtype=None) -> jax.Array:
    """The XLA reference backend.

    The program depends on the platform it is lowered for (not on the tracing
    machine): XLA:CPU gets canonical operands and `_cpu_gemm`, GPUs and TPUs
    `_accelerator_form` (docs/NUMERICS.md, "Emulated GEMM"), except that CUDA gets
    f8 operands on FP8 tensor cores for per-tensor FP8 and MXFP8 recipes
    (`_cuda_f8_form`, `mxjax.emulation.fp8_units`).

    Args:
      a, b: the GEMM's operands (any float dtype) and its dimension numbers.
      recipe: the GEMM's recipe.
      key: the GEMM's key (None when the recipe needs none); split into (lhs
        rounding, rhs rounding, Hadamard signs).
      gemm_name: 'fprop', 'dgrad' or 'wgrad' (for backends' error messages).
      operand_dtypes: the GEMM is that of the operands cast to these (`gemm`), or None.
      out_dtype: the f32 result is cast to it (None: f32).
    Returns:
      [batch..., Fa, Fb] (free axes flattened, as `canonical_operands`), f32 or out_dtype.
    """
    k_lhs, k_rhs, k_had = split_key(key if recipe.needs_key else None)
    form = functools.partial(_accelerator_form, dims=dims, recipe=recipe, k_lhs=k_lhs,
                             k_rhs=k_rhs, k_had=k_had, operand_dtypes=operand_dtypes)

    def cpu(a, b):
        return _canonical_cpu_form(*cast_operands(a, b, operand_dtypes), dims, recipe, k_lhs, k_rhs,
                                   k_had)

    gpu = functools.partial(form, form="gpu")
    if takes_f8_on_cuda(recipe):
        cuda = functools.partial(_cuda_f8_form, dims=dims, recipe=recipe, k_lhs=k_lhs,
                                 k_rhs=k_rhs, k_had=k_had, operand_dtypes=operand_dtypes,
                                 swap=gemm_name == "wgrad")
        gpu = functools.partial(cuda_or_other, cuda=cuda, other=gpu)
    out = per_platform(
        a, b,
        cpu=cpu,
        gpu=gpu,
        tpu=functools.partial(form, form="tpu"))
    return out if out_dtype is None else out.astype(out_dtype)


def emulates_packed_rhs(recipe, platform: str) -> bool:
    """Whether the GEMM under `recipe`, lowered for `platform` ('cpu', 'gpu', 'tpu'), may take
    its rhs quantized by the forward pass (`emulated_packed_rhs_gemm`) with the same bits:
    block-scaled operands, whose canonical form (XLA:CPU; NVFP4 on GPUs and TPUs) and
    in-place forms (the MX formats on GPUs and TPUs: `mxjax.emulation.in_place`'s
    `mx_gemm_packed_rhs`) contract the packed values in the GEMM's own layout. Not where an
    operand is per-tensor (quantized in place on XLA:CPU and CUDA, in no canonical layout),
    nor on GPUs where CUDA runs the recipe on FP8 tensor cores (`takes_f8_on_cuda`)."""
    if recipe.lhs.fmt.is_per_tensor or recipe.rhs.fmt.is_per_tensor:
        return False
    return platform != "gpu" or not takes_f8_on_cuda(recipe)


def emulation_packs_rhs(recipe, platform: str) -> bool:
    """Whether packing the backward GEMMs' rhs operands is the emulation's choice on
    `platform` (where `emulates_packed_rhs` allows it): not on GPUs and TPUs for MX
    operands, whose in-place forms (the GPU's bit view, the TPU's Pallas kernel) quantize
    X and W in place in the backward, one read each, where packing would add XLA's
    canonical quantizer to the forward (deviceless H200 matmul: 1.70 GB moved against
    bf16's 0.40); on a CPU and for NVFP4, yes."""
    return emulates_packed_rhs(recipe, platform) and not (
        platform in ("gpu", "tpu") and _in_place_mx(recipe))


@functools.partial(jax.jit, inline=True,  # cached per types, as emulated_gemm
                   static_argnames=("b_shape", "dims", "recipe", "operand_dtypes", "out_dtype",
                                    "platform"))
def emulated_packed_rhs_gemm(a: jax.Array, b_q: MXArray, b_shape: tuple[int, ...], dims: Dims,
                             recipe, key, operand_dtypes=None, out_dtype=None,
                             platform: str | None = None) -> jax.Array:
    """`emulated_gemm` with the rhs given quantized: ``b_q``, the canonical rhs
    ``[batch..., Fb, K']`` of the primal of shape ``b_shape``, rotated by the recipe's
    Hadamard and quantized along K' under ``recipe.rhs`` with the GEMM's rhs key
    (`mxjax.residuals.pack_rhs`).

    Each platform's form of `emulated_gemm` ('cpu': `_cpu_gemm`; 'gpu', 'tpu': the in-place
    MX forms, `mxjax.emulation.in_place.mx_gemm_packed_rhs`, or `accelerator_gemm`; None:
    each under ``lax.platform_dependent``), its lhs quantized as there, contracting the
    values ``b_q`` holds: `emulated_gemm`'s bits wherever `emulates_packed_rhs` holds.
    ``operand_dtypes[0]`` casts `a` (``[1]`` is already applied to ``b_q``). Returns
    ``[batch..., Fa, Fb]``, f32 or out_dtype.
    """
    (ca, _), (ba, _) = dims
    da = None if operand_dtypes is None else operand_dtypes[0]
    k_lhs, _, k_had = split_key(key if recipe.needs_key else None)

    def canonical(form):
        def run(a, b_q):
            a3 = rotate_operand(canonical_operand(a if da is None else a.astype(da), ba, ca),
                                recipe, k_had)
            return form(a3, b_q, recipe=recipe, k_lhs=k_lhs, k_rhs=None)
        return run

    def accelerator(form):
        if not _in_place_mx(recipe):
            return canonical(accelerator_gemm)

        def run(a, b_q):
            signs = None if recipe.hadamard is None else rotation_signs(recipe.hadamard, k_had)
            out = in_place.mx_gemm_packed_rhs(a, b_q, b_shape, dims, recipe, k_lhs, signs,
                                              form=form, operand_dtype=da)
            nb = len(ba)
            return out.reshape(out.shape[:nb] + (
                math.prod(a.shape[i] for i in free_axes(a.ndim, ba, ca)), b_q.shape[-2]))
        return run

    branches = {"cpu": canonical(_cpu_gemm), "gpu": accelerator("gpu"),
                "tpu": accelerator("tpu")}
    if platform is None:
        out = per_platform(a, b_q, **branches)
    else:
        out = branches[platform](a, b_q)
    return out if out_dtype is None else out.astype(out_dtype)
