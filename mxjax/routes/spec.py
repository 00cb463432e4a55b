"""What every execution route declares: :class:`Route`, and the in-place routes' GEMM.

A route is one backend of a quantized GEMM (``GemmRecipe.backend``). Each route module
(`mxjax.routes.xla`, `xla_fp8`, `xla_fp4`, `triton`) ends with its ``ROUTE``: the
formats and chips it serves, its GEMM, the packed-operand dot `mxjax.backends.mx_dot`
runs (if it has one), where its evidence is in ``mxjax/measurements.json`` and, if it
takes one, its GEMM of a packed rhs (the quantized residuals of `mxjax.residuals`). The
registry (`mxjax.backends`) reads these and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from mxjax import formats as F
from mxjax.chips import Chip
from mxjax.operands import free_size, rotation_signs, split_key

__all__ = ["NO_GPU_TARGET", "Route", "check_canonical_operand", "in_place_route_gemm",
           "in_place_route_packed_rhs_gemm"]

# Why a GPU route cannot be chosen for a GPU lowering with no target in sight.
NO_GPU_TARGET = ("no GPU target known (trace under jax.set_mesh / "
                 "jax.sharding.use_abstract_mesh with the target's abstract device, "
                 "or on the GPU)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Route:
    """One execution route of a quantized GEMM.

    Attributes:
      name: the backend name (``GemmRecipe.backend``).
      summary: what the route does, in one line.
      formats: the ``mxjax.formats`` names both operands must have (e.g. ``('mxfp4',)``),
        or None: every quantized format.
      runs_on: ``runs_on(chip)`` is '' when the route runs on `chip`
        (`mxjax.chips.Chip`), else why not.
      gemm: ``gemm(a, b, *, dims, recipe, key, gemm_name, operand_dtypes, out_dtype,
        platform)``: the GEMM of the raw operands for lowering `platform`, f32 (or
        out_dtype) ``[batch..., Fa, Fb]`` (free axes flattened).
      packed_dot: ``packed_dot(lhs_q, rhs_q, *, platform, **tiles)``: the f32 dot of two
        quantized operands (MXArrays), or None when the route quantizes its own operands.
      evidence: keys of ``mxjax/measurements.json`` whose figures time this route.
      packed_rhs_gemm: ``packed_rhs_gemm(a, packed_q, *, b_shape, dims, recipe, key,
        gemm_name, operand_dtypes, out_dtype, platform)``: `gemm` with the rhs given
        quantized, or None (the route takes its rhs as the primal only). ``packed_q`` is the
        canonical `mxjax.MXArray` of the rhs ``b`` of shape ``b_shape`` (``[batch..., Fb,
        K']``: rotated by the recipe's Hadamard, K' padded to its size, quantized along K'
        under ``recipe.rhs`` with the GEMM's rhs key: `mxjax.residuals.pack_rhs`),
        ``operand_dtypes[1]`` already applied to it; the result is ``gemm(a, b, ...)``'s,
        bit for bit. A route that has it takes the packed residuals of the backward GEMMs
        (`mxjax.residuals.saves_packed`).
      pack_rhs: ``pack_rhs(b, *, dims, recipe, key, operand_dtype)``: the same MXArray as
        `mxjax.residuals.pack_rhs` of ``b``, bit for bit, made by the route's own operand
        kernels when lowering for a GPU (e.g. in the same read as the forward GEMM's
        operand), or None where the route has no such kernel (`mxjax.quantize_with` then).
      packs_rhs: ``packs_rhs(recipe, platform)``: whether packing the backward's rhs is the
        better choice for a program traced for `platform` (`mxjax.residuals.saves_packed`);
        None: wherever the route takes the packed rhs.
    """

    name: str
    summary: str
    formats: tuple[str, ...] | None
    runs_on: Callable[[Chip], str]
    gemm: Callable[..., jax.Array]
    packed_dot: Callable[..., jax.Array] | None
    evidence: tuple[str, ...]
    packed_rhs_gemm: Callable[..., jax.Array] | None = None
    pack_rhs: Callable[..., object] | None = None
    packs_rhs: Callable[..., bool] | None = None

    def serves(self, lhs_fmt, rhs_fmt) -> bool:
        """Whether the route implements a GEMM of these two operand formats."""
        if self.formats is None:
            return True
        return F.get(lhs_fmt).name in self.formats and F.get(rhs_fmt).name in self.formats


def in_place_route_gemm(route: Callable[..., jax.Array], a: jax.Array, b: jax.Array, *, dims,
                        recipe, key, operand_dtypes=None, out_dtype=None) -> jax.Array:
    """The GEMM of a route over the emulation's in-place operands ('xla_fp8', 'xla_fp4').

    ``route(a, b, dims, recipe, k_lhs, k_rhs, signs, operand_dtypes=, out_dtype=)`` is
    the route's function (each the emulation's result where the operands cannot be
    carried); this splits the key, draws the rotation's signs and flattens the free axes.
    Returns ``[batch..., Fa, Fb]``, f32 or out_dtype (cast inside the route's branches, so
    that XLA can fuse the cast into the GEMM).
    """
    k_lhs, k_rhs, k_had = split_key(key if recipe.needs_key else None)
    signs = None if recipe.hadamard is None else rotation_signs(recipe.hadamard, k_had)
    out = route(a, b, dims, recipe, k_lhs, k_rhs, signs, operand_dtypes=operand_dtypes,
                out_dtype=out_dtype)
    (ca, cb), (ba, bb) = dims
    return out.reshape(tuple(a.shape[i] for i in ba)
                       + (free_size(a, ba, ca), free_size(b, bb, cb)))


def in_place_route_packed_rhs_gemm(route: Callable[..., jax.Array], a: jax.Array, packed_q, *,
                                   b_shape, dims, recipe, key, operand_dtypes=None,
                                   out_dtype=None) -> jax.Array:
    """`in_place_route_gemm` with the rhs given quantized (``Route.packed_rhs_gemm`` of
    'xla_fp8' and 'xla_fp4'): ``route(a, packed_q, b_shape, dims, recipe, k_lhs, signs,
    operand_dtype=, out_dtype=)`` is the route's packed-rhs function. Returns ``[batch...,
    Fa, Fb]``, f32 or out_dtype."""
    k_lhs, _, k_had = split_key(key if recipe.needs_key else None)
    signs = None if recipe.hadamard is None else rotation_signs(recipe.hadamard, k_had)
    out = route(a, packed_q, b_shape, dims, recipe, k_lhs, signs,
                operand_dtype=None if operand_dtypes is None else operand_dtypes[0],
                out_dtype=out_dtype)
    (ca, _), (ba, _) = dims
    return out.reshape(tuple(a.shape[i] for i in ba)
                       + (free_size(a, ba, ca), packed_q.shape[-2]))


def check_canonical_operand(q, what: str, accepts: Callable[..., bool]) -> None:
    """Raise ValueError unless ``q`` is a canonical operand (an MXArray ``[batch..., F, K]``
    blocked along its last axis, e.g. a quantized residual) whose format ``accepts``;
    ``what`` names the format in the message."""
    if not accepts(q.fmt) or q.axis != len(q.shape) - 1 or len(q.shape) < 2:
        raise ValueError(f"q: expected an {what} MXArray blocked along the last axis of "
                         f"[batch..., F, K], got {q.fmt.name} with shape {q.shape}, axis "
                         f"{q.axis}")
