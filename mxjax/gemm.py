"""One GEMM under a recipe: ``lax.dot_general``'s contract around the chosen route.

A pass-through recipe is ``lax.dot_general`` itself. A quantized GEMM
``dot_general(a, b, ((ca, cb), (ba, bb)))`` runs on the route its backend resolves to
(`mxjax.backends.run_gemm`: the emulation `mxjax.emulation.forms`, or another route of
`mxjax.routes`), on the canonical operands of `mxjax.operands`, and comes back in
``lax.dot_general``'s layout, result dtype and sharding.

No custom gradient here: the interceptor (``mxjax.interceptor``) puts three of these
GEMMs under one ``custom_vjp``.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from mxjax.backends import run_gemm
from mxjax.dimensions import Dims, free_axes
from mxjax.emulation.in_place import cast_operands, whole_operands
from mxjax.recipes import GemmRecipe

__all__ = ["gemm", "has_explicit_axes"]


def has_explicit_axes(*xs: jax.Array) -> bool:
    """Whether any of the arrays' types carries a mesh with explicit axes (``jax.set_mesh``
    of a mesh made with ``AxisType.Explicit``, ``jax.make_mesh``'s default in jax 0.12)."""
    return any(jax.typeof(x).sharding.mesh.explicit_axes for x in xs)


def _abstract(x: jax.Array, sharded: bool, dtype=None) -> jax.ShapeDtypeStruct:
    sharding = jax.typeof(x).sharding if sharded else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype if dtype is None else dtype,
                                sharding=sharding)


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
    out_type = jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=dims.as_lax(),
                          preferred_element_type=preferred_element_type, **extra),
        *(_abstract(x, explicit, d) for x, d in zip((a, b), operand_dtypes or (None, None))))

    def emulated(a, b, key):
        (ca, cb), (ba, bb) = dims
        out = run_gemm(a, b, dims=dims, recipe=recipe,
                       key=key if recipe.needs_key else None, gemm_name=gemm_name,
                       operand_dtypes=operand_dtypes, out_dtype=out_type.dtype)
        fa = [a.shape[i] for i in free_axes(a.ndim, ba, ca)]
        fb = [b.shape[i] for i in free_axes(b.ndim, bb, cb)]
        out = out.reshape(tuple(a.shape[i] for i in ba) + tuple(fa) + tuple(fb))
        return out.astype(out_type.dtype)

    if explicit:
        with whole_operands():
            return jax.sharding.auto_axes(emulated, out_sharding=out_type.sharding)(a, b, key)
    out = emulated(a, b, key)
    if out_sharding is not None:
        out = jax.sharding.reshard(out, out_sharding)
    return out
