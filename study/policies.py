"""The policies of the ladder study: the paper's rungs and the ablations that locate an effect.

Rungs are presets of ``mxjax.policies``. Ablations are built here from the
same operand recipes (MXFP4, EVEN scales, nearest-even): each changes one thing
against a rung, so a difference in training can be pinned on one GEMM, one
operand, or the rotation itself.
"""

from __future__ import annotations

from collections.abc import Callable

from mxjax import BF16, MXFP4, GemmRecipe, Hadamard, OperandRecipe, PrecisionPolicy, ScaleRule
from mxjax import policies as presets

# The paper's Table 1, in reading order (fp8 is its baseline).
RUNGS: tuple[str, ...] = ("fp8", "mxfp4_fprop", "mxfp4_fprop_dgrad", "mxfp4_all",
                          "mxfp4_all_sr", "mxfp4_all_rht16", "mxfp4_all_h16", "mxfp4_all_h32")

_PASS = OperandRecipe(fmt=BF16)
_MX = OperandRecipe(fmt=MXFP4, scale_rule=ScaleRule.EVEN)
_H16 = Hadamard(block_size=16)


def _gemm(lhs: OperandRecipe = _MX, rhs: OperandRecipe = _MX,
          hadamard: Hadamard | None = None) -> GemmRecipe:
    return GemmRecipe(lhs=lhs, rhs=rhs, hadamard=hadamard)


def _all_mx_with_h16_on(gemm: str, name: str) -> PrecisionPolicy:
    recipes = {g: _gemm(hadamard=_H16 if g == gemm else None) for g in ("fprop", "dgrad", "wgrad")}
    return PrecisionPolicy(**recipes, name=name)


def _wgrad_only(name: str, *, dy: OperandRecipe = _MX, x: OperandRecipe = _MX,
                hadamard: Hadamard | None = None) -> PrecisionPolicy:
    # wgrad's lhs is dY, its rhs is X; fprop and dgrad stay exact.
    return PrecisionPolicy(fprop=_gemm(_PASS, _PASS), dgrad=_gemm(_PASS, _PASS),
                           wgrad=_gemm(dy, x, hadamard), name=name)


ABLATIONS: dict[str, tuple[Callable[[], PrecisionPolicy], str]] = {
    "h16_fprop_only": (lambda: _all_mx_with_h16_on("fprop", "h16_fprop_only"),
                       "MXFP4 in all three GEMMs, H16 on Fprop only"),
    "h16_dgrad_only": (lambda: _all_mx_with_h16_on("dgrad", "h16_dgrad_only"),
                       "MXFP4 in all three GEMMs, H16 on Dgrad only"),
    "mxfp4_wgrad_h16": (presets.mxfp4_wgrad_h16,
                        "MXFP4 in all three GEMMs, H16 on Wgrad only (preset)"),
    "wgrad_mx": (lambda: _wgrad_only("wgrad_mx"),
                 "MXFP4 in Wgrad only (dY and X), no rotation"),
    "wgrad_mx_h16": (lambda: _wgrad_only("wgrad_mx_h16", hadamard=_H16),
                     "MXFP4 in Wgrad only, H16 on both operands"),
    "wgrad_mx_rht16": (lambda: _wgrad_only("wgrad_mx_rht16",
                                           hadamard=Hadamard(block_size=16, randomized=True)),
                       "MXFP4 in Wgrad only, random-sign H16"),
    "wgrad_mx_h32": (lambda: _wgrad_only("wgrad_mx_h32", hadamard=Hadamard(block_size=32)),
                     "MXFP4 in Wgrad only, H32"),
    "wgrad_dy_h16": (lambda: _wgrad_only("wgrad_dy_h16", x=_PASS, hadamard=_H16),
                     "Wgrad H16, only dY in MXFP4 (X exact)"),
    "wgrad_x_h16": (lambda: _wgrad_only("wgrad_x_h16", dy=_PASS, hadamard=_H16),
                    "Wgrad H16, only X in MXFP4 (dY exact)"),
    "wgrad_dy": (lambda: _wgrad_only("wgrad_dy", x=_PASS),
                 "Wgrad, only dY in MXFP4, no rotation"),
    "wgrad_x": (lambda: _wgrad_only("wgrad_x", dy=_PASS),
                "Wgrad, only X in MXFP4, no rotation"),
    "wgrad_rot16": (lambda: _wgrad_only("wgrad_rot16", dy=_PASS, x=_PASS, hadamard=_H16),
                    "Wgrad H16 rotation with no quantization (must match exact)"),
}


def names() -> tuple[str, ...]:
    """Every policy name the study knows: ``none``, the presets, then the ablations."""
    return ("none",) + presets.names() + tuple(a for a in ABLATIONS if a not in presets.PRESETS)


def get(name: str) -> PrecisionPolicy | None:
    """The policy called `name` (None for ``none``, the exact reference).

    Raises:
      ValueError: unknown name (the message lists the valid ones).
    """
    if name == "none":
        return None
    if name in ABLATIONS:
        return ABLATIONS[name][0]()
    if name in presets.PRESETS:
        return presets.get(name)
    raise ValueError(f"policy: unknown study policy {name!r}; valid: {', '.join(names())}")


def describe(name: str) -> str:
    """One line on what `name` quantizes."""
    if name in ABLATIONS:
        return ABLATIONS[name][1]
    if name == "none":
        return "exact (fp32, no policy)"
    doc = (presets.PRESETS[name].__doc__ or "").strip().splitlines()
    return doc[0] if doc else name
