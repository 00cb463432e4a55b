"""GemmRecord: what an observer of the interceptor learns about one GEMM it ran.

The interceptor (``mxjax.interceptor``) runs three GEMMs per quantized
``dot_general``: fprop in the forward pass, dgrad and wgrad in the backward
pass. With an observer active (``mxjax.interceptor.observe``) it hands each one,
as it runs, to the observer as a :class:`GemmRecord`: which GEMM, its recipe,
its operands and dimension numbers (the backward ones from JAX's transpose
rule), its key already split, and its result. ``record.run(recipe)`` runs the
same GEMM, or a variant recipe, on the same canonical operands and keys, so an
observer never works out the key order, the backward dimension numbers or the
canonical layout again. Records exist at trace time only (their arrays are the
tracers of the pass that ran the GEMM); nothing is computed unless asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mxjax import gemm as G
from mxjax import operands as O
from mxjax.dimensions import Dims, free_axes
from mxjax.layout import canonical_dimension_numbers
from mxjax.recipes import GEMMS, GemmRecipe

__all__ = ["GemmKeys", "GemmRecord"]


class GemmKeys(NamedTuple):
    """The three keys one GEMM's key splits into (``mxjax.operands.split_key``).

    Each is None when the call has no key; a GEMM uses each only where its
    recipe needs one (STOCHASTIC rounding of that operand, a randomized Hadamard).
    """

    lhs: jax.Array | None  # rounding of the lhs operand
    rhs: jax.Array | None  # rounding of the rhs operand
    hadamard: jax.Array | None  # the randomized Hadamard's signs


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GemmRecord:
    """One GEMM of an intercepted ``dot_general`` call (see the module docstring).

    For ``dot_general(x, w, dims)`` (x: lhs, w: rhs, g: the cotangent of the result):

    ======  ====================  ===========  ===========================
    name    computes              lhs, rhs     ``dims``
    ======  ====================  ===========  ===========================
    fprop   y = x·w               x, w         the call's
    dgrad   dx (lhs cotangent)    g, w         JAX's transpose rule (lhs)
    wgrad   dw (rhs cotangent)    g, x         JAX's transpose rule (rhs)
    ======  ====================  ===========  ===========================

    Attributes:
      name: 'fprop', 'dgrad' or 'wgrad'.
      recipe: the GEMM's ``mxjax.GemmRecipe`` (``policy.fprop`` / ``.dgrad`` / ``.wgrad``).
      lhs, rhs: the operands as the GEMM takes them (their own layout and dtype).
      dims: this GEMM's normalized dimension numbers (``mxjax.dimensions.Dims``).
      call_dims: the intercepted call's (forward) dimension numbers.
      out_perm: the cotangent is ``transpose(out, out_perm)`` cast to the primal's
        dtype (identity for fprop).
      key: the GEMM's key (the call's key split into fprop, dgrad, wgrad), or None.
      out: the GEMM's result, ``lax.dot_general(lhs, rhs, dims)``'s layout and dtype.
      precision, preferred_element_type: the call's.
    """

    name: str
    recipe: GemmRecipe
    lhs: jax.Array
    rhs: jax.Array
    dims: Dims
    call_dims: Dims
    out_perm: tuple[int, ...]
    key: jax.Array | None
    out: jax.Array
    precision: Any = None
    preferred_element_type: Any = None

    def __post_init__(self):
        if self.name not in GEMMS:
            raise ValueError(f"name: expected one of {GEMMS}, got {self.name!r}")
        if not isinstance(self.recipe, GemmRecipe):
            raise TypeError(f"recipe: expected a GemmRecipe, got {self.recipe!r}")

    @property
    def keys(self) -> GemmKeys:
        """The GEMM's key split into (lhs rounding, rhs rounding, Hadamard signs)."""
        return GemmKeys(*O.split_key(self.key))

    @functools.cached_property
    def operands(self) -> tuple[jax.Array, jax.Array]:
        """Both operands in the canonical layout (``mxjax.layout``), f32.

        ``(a, b)``: ``[batch..., Fa, K]`` and ``[batch..., Fb, K]``, free and
        contracting axes flattened in the order of ``dims``.
        """
        return O.canonical_operands(self.lhs, self.rhs, self.dims)

    @property
    def out_canonical(self) -> jax.Array:
        """``out`` as ``[batch..., Fa, Fb]`` (its dtype), the canonical product's layout."""
        (ca, _), (ba, _) = self.dims
        fa = math.prod(self.lhs.shape[i] for i in free_axes(self.lhs.ndim, ba, ca))
        return self.out.reshape(tuple(self.lhs.shape[i] for i in ba) + (fa, -1))

    def _recipe(self, recipe: GemmRecipe | None) -> GemmRecipe:
        if recipe is None:
            return self.recipe
        if not isinstance(recipe, GemmRecipe):
            raise TypeError(f"recipe: expected a GemmRecipe or None, got {recipe!r}")
        if recipe.needs_key and self.key is None:
            raise ValueError(
                f"recipe: {recipe} needs a PRNG key, but this {self.name} GEMM was run "
                "without one (its policy needs none)")
        return recipe

    def quantizer_inputs(self, recipe: GemmRecipe | None = None
                         ) -> tuple[jax.Array, jax.Array]:
        """The canonical operands as the quantizer gets them under `recipe` (default:
        the GEMM's): rotated by its Hadamard along K (zero-padded to its size) if any.

        With the keys ``keys.lhs`` / ``keys.rhs`` (where the operand's rounding is
        STOCHASTIC), ``mxjax.quantization.quantize_with(a, recipe.lhs, -1, ...)``
        reproduces the GEMM's quantized operands bit for bit.
        """
        recipe = self._recipe(recipe)
        a, b, _, _ = O.quantizer_operands(*self.operands, recipe, self.key)
        return a, b

    def hadamard_signs(self, recipe: GemmRecipe | None = None) -> jax.Array | None:
        """The ±1 f32 sign vector of `recipe`'s Hadamard (default: the GEMM's), or None."""
        recipe = self._recipe(recipe)
        if recipe.hadamard is None:
            return None
        return O.rotation_signs(recipe.hadamard, self.keys.hadamard)

    def run(self, recipe: GemmRecipe | None = None) -> jax.Array:
        """f32 ``[batch..., Fa, Fb]``: this GEMM on the same canonical operands and keys.

        Under the GEMM's own recipe this is ``out_canonical`` before the cast to
        the result dtype, bit for bit; under another recipe it is the variant
        (e.g. the same Hadamard without quantization). A pass-through recipe is
        ``lax.dot_general`` of the f32 canonical operands at the call's precision.
        """
        recipe = self._recipe(recipe)
        a, b = self.operands
        batch = a.ndim - 2
        dims = Dims(*canonical_dimension_numbers(batch))
        return G.gemm(a, b, dims, recipe, self.key, precision=self.precision,
                      preferred_element_type=jnp.float32, gemm_name=self.name)
