"""Policies as plain dicts (YAML configs, JSON records): :func:`to_dict` and :func:`from_dict`.

``from_dict(to_dict(p)) == p`` for every policy; preset names are accepted where a dict
goes (the lookup, `mxjax.policies.lookup`, resolves them). A dict takes every form of a
GEMM that ``PrecisionPolicy`` takes in Python: ``null`` or an omitted GEMM (pass-through),
a format name (``mxfp4``: both operands), one operand's fields (both operands), or the
full ``{lhs, rhs, hadamard, backend}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxjax import formats as F
from mxjax.policies.policy import PrecisionPolicy
from mxjax.recipes import GEMMS, GemmRecipe, Hadamard, OperandRecipe
from mxjax.validation import check_keys

__all__ = ["from_dict", "to_dict"]


def _operand_to_dict(r: OperandRecipe) -> dict[str, Any]:
    return {"fmt": r.fmt.name, "scale_rule": r.scale_rule.value, "rounding": r.rounding.value,
            "sr_prescale": r.sr_prescale}


def _gemm_to_dict(g: GemmRecipe) -> dict[str, Any]:
    had = g.hadamard
    return {
        "lhs": _operand_to_dict(g.lhs),
        "rhs": _operand_to_dict(g.rhs),
        "hadamard": None if had is None else {"block_size": had.block_size,
                                             "randomized": had.randomized, "seed": had.seed},
        "backend": g.backend,
    }


def to_dict(policy: PrecisionPolicy) -> dict[str, Any]:
    """A plain dict (str/bool/int/None leaves) that ``from_dict`` turns back into `policy`."""
    p = policy
    d: dict[str, Any] = {"name": p.name}
    d.update({g: _gemm_to_dict(getattr(p, g)) for g in GEMMS})
    return d


def _operand_from(d: Any, where: str) -> OperandRecipe:
    if isinstance(d, str):
        return OperandRecipe(fmt=F.get(d))
    check_keys(d, _OPERAND_KEYS, {"fmt"}, where=where)
    return OperandRecipe(**d)


_OPERAND_KEYS = {"fmt", "scale_rule", "rounding", "sr_prescale"}
_GEMM_KEYS = {"lhs", "rhs", "hadamard", "backend"}


def _gemm_from(d: Any, where: str) -> GemmRecipe | OperandRecipe | str | None:
    if d is None or isinstance(d, str):
        return d  # PrecisionPolicy's own forms: pass-through, or a format for both operands
    if isinstance(d, Mapping) and "fmt" in d and not set(d) & _GEMM_KEYS:
        return _operand_from(d, where)  # one operand's fields: both operands
    forms = (f"a GEMM is null, a format name, one operand's fields ({sorted(_OPERAND_KEYS)}, "
             "fmt required) or {lhs, rhs, hadamard, backend}")
    if not isinstance(d, Mapping):
        raise TypeError(f"{where}: {forms}; got {type(d).__name__} {d!r}")
    if set(d) - _GEMM_KEYS and set(d) <= _GEMM_KEYS | _OPERAND_KEYS:
        raise ValueError(f"{where}: {forms}; got keys {sorted(map(str, d))}")
    check_keys(d, _GEMM_KEYS, {"lhs", "rhs"}, where=where)
    had = d.get("hadamard")
    if isinstance(had, Mapping):
        check_keys(had, {"block_size", "randomized", "seed"}, where=f"{where}.hadamard")
        had = Hadamard(**had)
    return GemmRecipe(
        lhs=_operand_from(d["lhs"], f"{where}.lhs"),
        rhs=_operand_from(d["rhs"], f"{where}.rhs"),
        hadamard=had,
        backend=d.get("backend", "xla"),
    )


def from_dict(d: Mapping[str, Any]) -> PrecisionPolicy:
    """Builds a PrecisionPolicy from ``to_dict``'s layout or any shorter form of a GEMM.

    Layout: ``{'name': str|None, 'fprop'|'dgrad'|'wgrad': gemm}`` where a gemm is (as
    ``PrecisionPolicy`` takes in Python) null or omitted (pass-through), a format name
    (both operands, e.g. ``'mxfp4'``; ``'bf16'``: pass-through), one operand's fields
    (both operands) or ``{'lhs': operand, 'rhs': operand, 'hadamard':
    None|int|{'block_size', 'randomized', 'seed'}, 'backend': 'xla'}``; an operand is a
    format name or ``{'fmt', 'scale_rule', 'rounding', 'sr_prescale'}`` (missing fields
    take their defaults). Unknown keys are errors naming the GEMM.
    """
    check_keys(d, {"name", *GEMMS}, where="policy dict")
    return PrecisionPolicy(name=d.get("name"),
                           **{g: _gemm_from(d[g], g) for g in GEMMS if g in d})
