"""One GEMM under a recipe: ``lax.dot_general``'s contract around the chosen route.

A pass-through recipe is ``lax.dot_general`` itself. A quantized GEMM
``dot_general(a, b, ((ca, cb), (ba, bb)))`` runs on the route its backend resolves to
(`mxjax.backends.run_gemm`: the emulation `mxjax.emulation.forms`, or another route of
`mxjax.routes`), on the canonical operands of `mxjax.operands`, and comes back in
``lax.dot_general``'s layout, result dtype and sharding.

`gemm_packed_rhs` is the same GEMM with the rhs given quantized by the forward pass
(`mxjax.residuals`), on the route's ``packed_rhs_gemm``.

No custom gradient here: the interceptor (``mxjax.interceptor``) puts three of these
GEMMs under one ``custom_vjp``.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from mxjax.backends import run_gemm, run_packed_rhs_gemm
from mxjax.dimensions import Dims, free_axes
from mxjax.emulation.in_place import cast_operands, whole_operands
from mxjax.quantization import MXArray
from mxjax.recipes import GemmRecipe

__all__ = ["gemm", "gemm_packed_rhs", "has_explicit_axes"]


def has_explicit_axes(*xs: jax.Array) -> bool:
    """Whether any of the arrays' types carries a mesh with explicit axes (``jax.set_mesh``
    of a mesh made with ``AxisType.Explicit``, ``jax.make_mesh``'s default in jax 0.12)."""
    return any(jax.typeof(x).sharding.mesh.explicit_axes for x in xs)


def _abstract(x: jax.Array, sharded: bool, dtype=None) -> jax.ShapeDtypeStruct:
    sharding = jax.typeof(x).sharding if sharded else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype if dtype is None else dtype,
                                sharding=sharding)


def _result_type(a, b, dims: Dims, preferred_element_type, operand_dtypes, sharded: bool,
                 **extra) -> jax.ShapeDtypeStruct:
    """``lax.dot_general``'s result type for the operands (cast to `operand_dtypes`)."""
    return jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=dims.as_lax(),
                          preferred_element_type=preferred_element_type, **extra),
        *(_abstract(x, sharded, d) for x, d in zip((a, b), operand_dtypes or (None, None))))


def _unflattened(out: jax.Array, a_shape, b_shape, dims: Dims, dtype) -> jax.Array:
    """A route's ``[batch..., Fa, Fb]`` in ``lax.dot_general``'s layout and `dtype`."""
    (ca, cb), (ba, bb) = dims
    fa = [a_shape[i] for i in free_axes(len(a_shape), ba, ca)]
    fb = [b_shape[i] for i in free_axes(len(b_shape), bb, cb)]
    out = out.reshape(tuple(a_shape[i] for i in ba) + tuple(fa) + tuple(fb))
    return out.astype(dtype)


def gemm(a: jax.Array, b: jax.Array, dims: Dims, recipe: GemmRecipe, key, *,
         precision=None, preferred_element_type=None, gemm_name: str = "gemm",
         out_sharding=None, operand_dtypes=None) -> jax.Array:
    """One GEMM ``dot_general(a, b, dims)`` under `recipe` (no custom gradient).

    ``operand_dtypes``: None or a pair (for a, for b) of dtypes or None; the GEMM
    is then that of ``a.astype(operand_dtypes[0])`` and ``b.astype(operand_dtypes[1])``
    (None: not cast), bit for bit, result dtype included. The emulation takes the
    casts into its quantize pass where it can (the TPU kernel reads an f32 operand
    and rounds it to bf16 itself) instead of materializing a cast copy.

    Pass-through recipes call ``lax.dot_general(a, b, dims, precision,
    preferred_element_type, out_sharding=...)`` unchanged. Otherwise the result
    is computed in f32 (see the module docstring) and cast to ``lax.dot_general``'s
    result dtype. Sharding follows ``lax.dot_general``: under a mesh with explicit
    axes the result gets the sharding ``lax.dot_general(a, b, dims,
    out_sharding=out_sharding)`` would give it (and the same error where that
    is ambiguous: sharded contracting dims without ``out_sharding``), and the
    emulation inside runs with those axes made auto (``jax.sharding.auto_axes``:
    the partitioner places its reshapes, block reductions and collectives).
    Otherwise, given ``out_sharding``, the result is resharded to it with
    ``jax.sharding.reshard``.
    """
    if recipe.is_passthrough:
        a, b = cast_operands(a, b, operand_dtypes)
        extra = {} if out_sharding is None else {"out_sharding": out_sharding}
        return lax.dot_general(a, b, dims.as_lax(), precision=precision,
                               preferred_element_type=preferred_element_type, **extra)
    explicit = has_explicit_axes(a, b)
    extra = {"out_sharding": out_sharding} if explicit and out_sharding is not None else {}
    out_type = _result_type(a, b, dims, preferred_element_type, operand_dtypes, explicit,
                            **extra)

    def emulated(a, b, key):
        out = run_gemm(a, b, dims=dims, recipe=recipe,
                       key=key if recipe.needs_key else None, gemm_name=gemm_name,
                       operand_dtypes=operand_dtypes, out_dtype=out_type.dtype)
        return _unflattened(out, a.shape, b.shape, dims, out_type.dtype)

    if explicit:
        with whole_operands():
            return jax.sharding.auto_axes(emulated, out_sharding=out_type.sharding)(a, b, key)
    out = emulated(a, b, key)
    if out_sharding is not None:
        out = jax.sharding.reshard(out, out_sharding)
    return out


def gemm_packed_rhs(a: jax.Array, packed_q: MXArray, b: jax.ShapeDtypeStruct, dims: Dims,
                    recipe: GemmRecipe, key, *, preferred_element_type=None,
                    gemm_name: str = "gemm", operand_dtypes=None) -> jax.Array:
    """`gemm` ``(a, b, dims, recipe, key)`` with the rhs given quantized (no custom gradient).

    ``packed_q``: the canonical MXArray of ``b`` as the GEMM quantizes it
    (`mxjax.residuals.pack_rhs`, ``operand_dtypes[1]`` applied before quantizing); ``b``:
    the primal's shape and dtype (``jax.ShapeDtypeStruct``), for the result's layout and
    dtype. Runs ``Route.packed_rhs_gemm`` of the route each platform resolves to
    (`mxjax.backends.run_packed_rhs_gemm`) and returns `gemm`'s result, bit for bit, in
    ``lax.dot_general``'s layout and result dtype. Quantized recipes only; no sharding is
    imposed on the result (the interceptor packs no residual of a primal under a mesh with
    explicit axes).
    """
    if recipe.is_passthrough:
        raise ValueError(f"{gemm_name}: a pass-through recipe quantizes no rhs to pack")
    out_type = _result_type(a, b, dims, preferred_element_type, operand_dtypes, False)
    out = run_packed_rhs_gemm(a, packed_q, b_shape=tuple(b.shape), dims=dims, recipe=recipe,
                              key=key if recipe.needs_key else None, gemm_name=gemm_name,
                              operand_dtypes=operand_dtypes, out_dtype=out_type.dtype)
    return _unflattened(out, a.shape, b.shape, dims, out_type.dtype)
