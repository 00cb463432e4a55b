"""Policies as plain dicts (YAML configs, JSON records): :func:`to_dict` and :func:`from_dict`.

``from_dict(to_dict(p)) == p`` for every policy; preset names are accepted where a dict
goes (the lookup, `mxjax.policies.lookup`, resolves them).
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
    check_keys(d, {"fmt", "scale_rule", "rounding", "sr_prescale"}, {"fmt"}, where=where)
    return OperandRecipe(**d)


def _gemm_from(d: Any, where: str) -> GemmRecipe:
    check_keys(d, {"lhs", "rhs", "hadamard", "backend"}, {"lhs", "rhs"}, where=where)
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
    """Builds a PrecisionPolicy from ``to_dict``'s layout.

    Layout: ``{'name': str|None, 'fprop'|'dgrad'|'wgrad': {'lhs': operand,
    'rhs': operand, 'hadamard': None|int|{'block_size', 'randomized', 'seed'},
    'backend': 'xla'}}`` where an operand is a format name or ``{'fmt',
    'scale_rule', 'rounding', 'sr_prescale'}`` (missing fields take their
    defaults). Unknown keys are errors.
    """
    check_keys(d, {"name", *GEMMS}, GEMMS, where="policy dict")
    return PrecisionPolicy(name=d.get("name"), **{g: _gemm_from(d[g], g) for g in GEMMS})
