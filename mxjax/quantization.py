"""Quantize, dequantize and fake-quantize to MX, NVFP4 and per-tensor FP8 formats.

The numerics are specified in docs/NUMERICS.md and tested bit for bit against an
independent numpy reference. Everything is pure `jnp` (jit/vmap friendly).

Two entry points per operation, one implementation:

* the recipe form, ``quantize_with(x, recipe, axis, key=...)`` (also
  ``fake_quantize_with``, ``fake_quantize_parts_with``), takes a validated
  ``mxjax.OperandRecipe``: the GEMMs, the kernels and diagnostics use it and
  check only what belongs to the call (the array, the axis, the key);
* the keyword form, ``quantize(x, fmt, axis, scale_rule=..., rounding=...,
  key=..., sr_prescale=...)`` (the public API), checks its keyword arguments
  with messages that name them and builds the recipe.

Both run the format's scaling scheme (``recipe.scheme``, ``mxjax.scaling``) on
the block axis moved last and padded: ``prepare``, round onto the element grid
(``mxjax.elements``), then the stored scales (``quantize``), the dequantized
values (``fake_quantize``) or the values with their per-tensor factors left out
(``fake_quantize_parts``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mxjax import e2m1_bits
from mxjax import formats as F
from mxjax._platform import cpu_barrier
from mxjax.elements import encode, round_to_grid, round_to_value, signed_value
from mxjax.formats import Format, Rounding, ScaleRule
from mxjax.operand_recipe import OperandRecipe
from mxjax.scaling import scheme_for, to_blocks

__all__ = [
    "FLOAT_DTYPES",
    "MXArray",
    "dequantize",
    "fake_quantize",
    "fake_quantize_parts",
    "fake_quantize_parts_with",
    "fake_quantize_with",
    "quantize",
    "quantize_blocks",
    "quantize_with",
]

# The input dtypes the quantizer (and every quantized GEMM) accepts.
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Element format name -> the ml_dtypes dtype of one element (MXArray.dtype).
_ELEMENT_DTYPES = {"e2m1": jnp.float4_e2m1fn, "e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


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
# Validation: what belongs to the call (array, axis, key), and the keyword form
# --------------------------------------------------------------------------- #
def _check_array(x: Any, axis: Any) -> tuple[jax.Array, int]:
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
    return x, axis % ndim


def _check_key(rounding: Rounding, key: Any) -> None:
    if rounding is Rounding.STOCHASTIC and key is None:
        raise ValueError("key: STOCHASTIC rounding needs a PRNG key (key=jax.random.key(...))")


def _check_recipe(recipe: Any) -> OperandRecipe:
    if not isinstance(recipe, OperandRecipe):
        raise TypeError(f"recipe: expected an mxjax.OperandRecipe, got {type(recipe).__name__}")
    return recipe


def _call(x: Any, recipe: Any, axis: Any, key: Any) -> tuple[jax.Array, OperandRecipe, int]:
    """The recipe form's checks: the recipe's type, the array, the axis and the key."""
    recipe = _check_recipe(recipe)
    x, axis = _check_array(x, axis)
    _check_key(recipe.rounding, key)
    return x, recipe, axis


def _keyword_call(x: Any, fmt: Any, axis: Any, scale_rule: Any, rounding: Any, key: Any,
                  sr_prescale: Any) -> tuple[jax.Array, OperandRecipe, int]:
    """The keyword form's checks (messages name its arguments) and the recipe they build.

    A pass-through format (BF16) builds ``OperandRecipe(fmt=BF16)`` whatever the scale
    rule; the key and pre-scale arguments are checked all the same.
    """
    fmt = F.get(fmt)
    x, axis = _check_array(x, axis)
    rounding = F.rounding(rounding)
    rule = ScaleRule.FLOOR if scale_rule is None else F.scale_rule(scale_rule)
    if not fmt.is_passthrough and rule not in scheme_for(fmt).scale_rules:
        raise ValueError(
            f"scale_rule: {rule.name} applies to E8M0-scaled MX formats only; "
            f"{fmt.name} has a fixed scale computation (pass ScaleRule.FLOOR or None)"
        )
    _check_key(rounding, key)
    if not isinstance(sr_prescale, (bool, np.bool_)):
        raise TypeError(f"sr_prescale: expected a bool, got {sr_prescale!r}")
    if sr_prescale and rounding is not Rounding.STOCHASTIC:
        raise ValueError(f"sr_prescale: True needs rounding=STOCHASTIC, got {rounding.name}")
    if fmt.is_passthrough:
        return x, OperandRecipe(fmt=fmt), axis
    return x, OperandRecipe(fmt=fmt, scale_rule=rule, rounding=rounding,
                            sr_prescale=bool(sr_prescale)), axis


# --------------------------------------------------------------------------- #
# One implementation: the recipe's scaling scheme on the block axis moved last
# --------------------------------------------------------------------------- #
def _uniforms(key: jax.Array | None, shape: tuple[int, ...]) -> jnp.ndarray:
    return jax.random.uniform(key, shape, jnp.float32)


def _prepared(x: jax.Array, recipe: OperandRecipe, axis: int, key):
    """(scheme, padded shape, n, y, scales, uniforms | None) with the block axis last."""
    scheme = recipe.scheme
    xm, n = to_blocks(x.astype(jnp.float32), axis, scheme.block_size)
    u = scheme.split(_uniforms(key, xm.shape)) if recipe.needs_key else None
    y, scales = scheme.prepare(scheme.split(xm), recipe.scale_rule, recipe.sr_prescale, x.dtype)
    return scheme, xm.shape, n, y, scales, u


def _encoded(scheme, recipe: OperandRecipe, y, scales, u):
    sign, code = round_to_grid(y, scheme.element, recipe.rounding, u)
    scale_bytes, tensor_scale = scheme.stored(scales)
    return encode(sign, code, scheme.element), scale_bytes, tensor_scale


def quantize_blocks(xb: jax.Array, recipe: OperandRecipe, u: jax.Array | None,
                    dtype=jnp.float32):
    """The block quantizer on values already in the scheme's view (``scheme.split``).

    ``xb`` f32 ``[..., nb, block]`` (per tensor: ``[..., n]``) -> ``(codes uint8
    like xb (unpacked), scale bytes uint8 [..., nb] | None, f32 tensor scale |
    None)``. Also the body of the fused Pallas kernel. ``u``: uniforms like ``xb``
    for STOCHASTIC (else None); ``dtype``: the input's dtype before the f32
    upcast (it bounds E8M0 scales so that dequantized values are finite in it).
    """
    scheme = recipe.scheme
    y, scales = scheme.prepare(xb, recipe.scale_rule, recipe.sr_prescale, dtype)
    return _encoded(scheme, recipe, y, scales, u)


# The implementations below are jitted with the recipe (and axis) static: JAX then
# caches their traces per operand type, an eager call runs one compiled program
# instead of dispatching each of its ~100 operations, and a call inside a jitted
# program is inlined by XLA (the same compiled program).
_static_recipe = functools.partial(jax.jit, inline=True, static_argnames=("recipe", "axis"))


@_static_recipe
def _quantize(x: jax.Array, recipe: OperandRecipe, axis: int, key) -> MXArray:
    if recipe.is_passthrough:
        raise ValueError("fmt: BF16 is pass-through; there is nothing to quantize")
    scheme, shape, _, y, scales, u = _prepared(x, recipe, axis, key)
    codes, scale_bytes, tensor_scale = _encoded(scheme, recipe, y, scales, u)
    codes = codes.reshape(shape)
    if recipe.fmt.packed:
        # Packing fused into the quantizer's loop defeats XLA:CPU vectorization;
        # materializing the byte codes first is ~4x faster there (CPU only).
        codes = _pack(cpu_barrier(codes))
    codes = jnp.moveaxis(codes, -1, axis)
    if scale_bytes is not None:
        scale_bytes = jnp.moveaxis(scale_bytes, -1, axis)
    return MXArray(codes, scale_bytes, tensor_scale, tuple(x.shape), axis, recipe.fmt,
                   recipe.sr_prescale)


@_static_recipe
def _e2m1_block_values(x: jax.Array, recipe: OperandRecipe, axis: int) -> jax.Array:
    """f32 values of an E2M1 x E8M0 operand by `mxjax.e2m1_bits` (block axis `axis`)."""
    scheme = recipe.scheme
    xm, n = to_blocks(x.astype(jnp.float32), axis, scheme.block_size)
    xb = scheme.split(xm)
    s, nonfinite = scheme.block_scales(xb, recipe.scale_rule, False, x.dtype)
    values = e2m1_bits.e2m1_values(xb, s, nonfinite, recipe.rounding).reshape(xm.shape)
    return jnp.moveaxis(values[..., :n], -1, axis)


@_static_recipe
def _fake_quantize_generic(x: jax.Array, recipe: OperandRecipe, axis: int, key) -> jax.Array:
    """`fake_quantize` by the scheme's prepare / round / values (every format)."""
    scheme, shape, n, y, scales, u = _prepared(x, recipe, axis, key)
    v = round_to_value(y, scheme.element, recipe.rounding, u)
    values = scheme.values(v, scales, recipe.sr_prescale).reshape(shape)
    return jnp.moveaxis(values[..., :n], -1, axis).astype(x.dtype)


def _fake_quantize(x: jax.Array, recipe: OperandRecipe, axis: int, key) -> jax.Array:
    if recipe.is_passthrough:
        return x
    if e2m1_bits.applies(recipe):  # the same values in about half the operations
        return _e2m1_block_values(x, recipe, axis).astype(x.dtype)
    return _fake_quantize_generic(x, recipe, axis, key)


@_static_recipe
def _fake_quantize_parts(x: jax.Array, recipe: OperandRecipe, axis: int, key):
    if recipe.is_passthrough:
        raise ValueError("fmt: BF16 is pass-through; there is nothing to quantize")
    if e2m1_bits.applies(recipe):  # E8M0 scales: no per-tensor factor
        return _e2m1_block_values(x, recipe, axis), None
    scheme, shape, n, y, scales, u = _prepared(x, recipe, axis, key)
    values, tensor_scale = scheme.parts(round_to_value(y, scheme.element, recipe.rounding, u),
                                        scales)
    return jnp.moveaxis(values.reshape(shape)[..., :n], -1, axis), tensor_scale


def _pack(codes: jnp.ndarray) -> jnp.ndarray:
    """uint8 4-bit codes [..., n] (n even) -> [..., n // 2], first in low nibble."""
    pairs = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack(packed: jnp.ndarray) -> jnp.ndarray:
    lo = packed & 0x0F
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))


# --------------------------------------------------------------------------- #
# Public API: the recipe form and the keyword form
# --------------------------------------------------------------------------- #
def quantize_with(x: jnp.ndarray, recipe: OperandRecipe, axis: int = -1, *,
                  key: jax.Array | None = None) -> MXArray:
    """``quantize`` under a validated ``mxjax.OperandRecipe`` (see :func:`quantize`).

    Args:
      x: float32/bfloat16/float16 array of any rank >= 1.
      recipe: the operand recipe (a quantized format; BF16 raises).
      axis: the block axis.
      key: PRNG key, required when ``recipe.rounding`` is STOCHASTIC.
    """
    x, recipe, axis = _call(x, recipe, axis, key)
    return _quantize(x, recipe, axis, key)


def fake_quantize_with(x: jnp.ndarray, recipe: OperandRecipe, axis: int = -1, *,
                       key: jax.Array | None = None) -> jnp.ndarray:
    """``fake_quantize`` under a validated ``mxjax.OperandRecipe``; BF16 returns ``x``."""
    x, recipe, axis = _call(x, recipe, axis, key)
    return _fake_quantize(x, recipe, axis, key)


def fake_quantize_parts_with(x: jnp.ndarray, recipe: OperandRecipe, axis: int = -1, *,
                             key: jax.Array | None = None
                             ) -> tuple[jnp.ndarray, jnp.ndarray | None]:
    """``fake_quantize_parts`` under a validated ``mxjax.OperandRecipe``."""
    x, recipe, axis = _call(x, recipe, axis, key)
    return _fake_quantize_parts(x, recipe, axis, key)


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
    x, recipe, axis = _keyword_call(x, fmt, axis, scale_rule, rounding, key, sr_prescale)
    return _quantize(x, recipe, axis, key)


def dequantize(q: MXArray, dtype=jnp.float32) -> jnp.ndarray:
    """The values `q` holds, as a `dtype` array of ``q.shape`` (exact in f32).

    Codes times their scales (block scales, then the tensor scale, then the SR
    3/4 unscale where present); NaN for a block (or tensor) that held NaN/Inf.
    """
    if not isinstance(q, MXArray):
        raise TypeError(f"q: expected an MXArray, got {type(q).__name__}")
    return _dequantize(q, jnp.dtype(dtype))


@functools.partial(jax.jit, inline=True, static_argnames="dtype")
def _dequantize(q: MXArray, dtype) -> jnp.ndarray:
    scheme = scheme_for(q.fmt)
    codes = jnp.moveaxis(q.codes, q.axis, -1)
    if q.fmt.packed:
        codes = _unpack(codes)
    scales = None if q.scales is None else jnp.moveaxis(q.scales, q.axis, -1)
    v = signed_value(scheme.split(codes), scheme.element)
    out = scheme.values(v, scheme.from_stored(scales, q.tensor_scale), q.sr_prescale)
    out = out.reshape(codes.shape)[..., : q.shape[q.axis]]
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
    x, recipe, axis = _keyword_call(x, fmt, axis, scale_rule, rounding, key, sr_prescale)
    return _fake_quantize(x, recipe, axis, key)


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
    x, recipe, axis = _keyword_call(x, fmt, axis, scale_rule, rounding, key, sr_prescale)
    return _fake_quantize_parts(x, recipe, axis, key)
