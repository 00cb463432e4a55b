"""Per-GEMM recipes: what each operand of fprop, dgrad and wgrad gets.

A linear layer ``Y = X·W`` runs three GEMMs (see the design's GEMM table):

=======  ===============  ===================  ===========================
GEMM     computes         operands (lhs, rhs)  blocks run along
=======  ===============  ===================  ===========================
fprop    Y = X·W          (X, W)               K, the forward contraction
dgrad    dX = dY·Wᵀ       (dY, W)              N, the output (rhs free) axes
wgrad    dW = Xᵀ·dY       (dY, X)              M, the token (lhs free) axes
=======  ===============  ===================  ===========================

(wgrad's lhs is dY: the interceptor contracts dY with X over M and transposes
the product into W's layout, as JAX's transpose rule does.)

A ``PrecisionPolicy`` (``mxjax.policies``) holds one :class:`GemmRecipe` per
GEMM; a recipe holds one :class:`OperandRecipe` per operand and an optional
:class:`Hadamard` rotation applied to both operands along that GEMM's
contraction axis. All these classes
are frozen, keyword-only and hashable (usable as static ``jit`` arguments), and
validate their fields at construction. :class:`OperandRecipe` is defined in
``mxjax.operand_recipe`` (below the quantizer, which takes it) and re-exported here.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Protocol

from mxjax.backends import check_backend_name
from mxjax.formats import Format
from mxjax.operand_recipe import OperandRecipe
from mxjax.operand_recipe import check_bool as _check_bool
from mxjax.rotation import HADAMARD_SIZES

__all__ = [
    "GEMMS",
    "HADAMARD_SIZES",
    "GemmRecipe",
    "Hadamard",
    "OperandRecipe",
    "PolicyRecipes",
]

# GEMM names in the order fprop, dgrad, wgrad (also the order keys are split in).
GEMMS = ("fprop", "dgrad", "wgrad")


def _coerce_operand(value: Any, name: str) -> OperandRecipe:
    if isinstance(value, OperandRecipe):
        return value
    if isinstance(value, (Format, str)):
        return OperandRecipe(fmt=value)
    raise TypeError(f"{name}: expected an OperandRecipe, a Format or a format name, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hadamard:
    """A block-diagonal Walsh–Hadamard rotation of both operands along the contraction.

    Attributes:
      block_size: h in (16, 32, 64, 128). The contraction is padded with zeros to a
        multiple of h (a contraction shorter than h becomes one padded block).
      randomized: draw a fresh ±1 sign vector from the GEMM's key on every call
        (the caller folds step and layer into the key). Needs a key.
      seed: deterministic only: a fixed ±1 sign vector from this integer seed
        (``mxjax.rotation.fixed_signs``); None means no signs (plain H).
    """

    block_size: int = 16
    randomized: bool = False
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.block_size, bool):
            raise TypeError(f"Hadamard: block_size must be an int, got {self.block_size!r}")
        try:
            h = operator.index(self.block_size)
        except TypeError:
            raise TypeError(
                f"Hadamard: block_size must be an int, got {self.block_size!r}") from None
        if h not in HADAMARD_SIZES:
            raise ValueError(f"Hadamard: block_size must be one of {HADAMARD_SIZES}, got {h}")
        _check_bool(self.randomized, "Hadamard: randomized")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
                raise ValueError(
                    f"Hadamard: seed must be a non-negative int or None, got {self.seed!r}")
            if self.randomized:
                raise ValueError(
                    "Hadamard: seed fixes the sign vector, randomized=True draws a fresh one "
                    "from the key every call; set one or the other"
                )
        object.__setattr__(self, "block_size", h)

    @property
    def needs_key(self) -> bool:
        return self.randomized

    def replace(self, **changes: Any) -> Hadamard:
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        if self.randomized:
            return f"random H{self.block_size}"
        if self.seed is not None:
            return f"H{self.block_size} (fixed signs, seed {self.seed})"
        return f"H{self.block_size}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmRecipe:
    """The recipe of one GEMM: an OperandRecipe per operand plus an optional Hadamard.

    Attributes:
      lhs: first operand (X in fprop, dY in dgrad and wgrad). A Format or format
        name is accepted and becomes ``OperandRecipe(fmt=...)``.
      rhs: second operand (W in fprop and dgrad, X in wgrad).
      hadamard: rotation of both operands along the contraction, or None. An int
        h is accepted and becomes ``Hadamard(block_size=h)``.
      backend: where the GEMM runs; one of ``mxjax.backends.BACKENDS``.
    """

    lhs: OperandRecipe | Format | str
    rhs: OperandRecipe | Format | str
    hadamard: Hadamard | int | None = None
    backend: str = "xla"

    def __post_init__(self):
        object.__setattr__(self, "lhs", _coerce_operand(self.lhs, "GemmRecipe: lhs"))
        object.__setattr__(self, "rhs", _coerce_operand(self.rhs, "GemmRecipe: rhs"))
        had = self.hadamard
        if had is not None and not isinstance(had, Hadamard):
            if isinstance(had, int) and not isinstance(had, bool):
                had = Hadamard(block_size=had)
            else:
                raise TypeError(
                    f"GemmRecipe: hadamard must be a Hadamard, an int or None, got {had!r}")
        object.__setattr__(self, "hadamard", had)
        check_backend_name(self.backend, "GemmRecipe: backend")

    def replace(self, **changes: Any) -> GemmRecipe:
        """A copy with some fields replaced (validated again; format names are accepted)."""
        return dataclasses.replace(self, **changes)

    @property
    def is_passthrough(self) -> bool:
        """True when nothing happens: both operands pass through and no Hadamard."""
        return self.lhs.is_passthrough and self.rhs.is_passthrough and self.hadamard is None

    @property
    def needs_key(self) -> bool:
        return (self.lhs.needs_key or self.rhs.needs_key
                or (self.hadamard is not None and self.hadamard.needs_key))


class PolicyRecipes(Protocol):
    """What the interceptor reads of a policy: a GemmRecipe per GEMM (``mxjax.PrecisionPolicy``).

    Defined here, below the interceptor, so that the interceptor never imports
    the policy type (which sits above it and calls it for ``policy.dot_general``).
    """

    @property
    def fprop(self) -> GemmRecipe: ...

    @property
    def dgrad(self) -> GemmRecipe: ...

    @property
    def wgrad(self) -> GemmRecipe: ...

    @property
    def name(self) -> str | None: ...

    @property
    def needs_key(self) -> bool: ...

    @property
    def is_passthrough(self) -> bool: ...


def check_policy_recipes(policy: Any, name: str = "policy") -> PolicyRecipes:
    """Raises TypeError unless `policy` holds a GemmRecipe for each of :data:`GEMMS`."""
    if not all(isinstance(getattr(policy, g, None), GemmRecipe) for g in GEMMS):
        raise TypeError(f"{name}: expected a PrecisionPolicy, got {policy!r}")
    return policy
