"""The policies of the ladder study: the paper's rungs and the ablations that locate an effect.

Rungs are presets of ``mxjax.policies``. Ablations are presets changed with
``dataclasses.replace`` (``mxfp4_all``'s MXFP4 operand recipe, EVEN scales and
nearest-even; ``bf16``'s pass-through): each changes one thing against a rung,
so a difference in training can be pinned on one GEMM, one operand, or the
rotation itself. Names are looked up by `get` (ablations first, then
``mxjax.policies.resolve``).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping

from mxjax import Hadamard, PrecisionPolicy
from mxjax import policies as presets

# The paper's Table 1, in reading order (fp8 is its baseline).
RUNGS: tuple[str, ...] = ("fp8", "mxfp4_fprop", "mxfp4_fprop_dgrad", "mxfp4_all",
                          "mxfp4_all_sr", "mxfp4_all_rht16", "mxfp4_all_h16", "mxfp4_all_h32")

_H16 = Hadamard(block_size=16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ablation:
    """One ablation: how to build it and one line on what it quantizes."""

    build: Callable[[], PrecisionPolicy]
    description: str


def _all_mx_with_h16_on(gemm: str, name: str) -> PrecisionPolicy:
    mx = presets.get("mxfp4_all")
    return dataclasses.replace(mx, **{gemm: dataclasses.replace(mx.gemms[gemm], hadamard=_H16)},
                               name=name)


def _wgrad_only(name: str, *, dy: bool = True, x: bool = True,
                hadamard: Hadamard | None = None) -> PrecisionPolicy:
    """fprop and dgrad exact (``bf16``); wgrad's lhs dY and rhs X in MXFP4 where asked
    (``mxfp4_all``'s wgrad operands), else pass-through, with `hadamard`."""
    exact, mx = presets.get("bf16"), presets.get("mxfp4_all")
    wgrad = dataclasses.replace(
        mx.wgrad, lhs=(mx if dy else exact).wgrad.lhs, rhs=(mx if x else exact).wgrad.rhs,
        hadamard=hadamard)
    return dataclasses.replace(exact, wgrad=wgrad, name=name)


def _ablation(build: Callable[[], PrecisionPolicy], description: str) -> Ablation:
    return Ablation(build=build, description=description)


ABLATIONS: Mapping[str, Ablation] = types.MappingProxyType({
    "h16_fprop_only": _ablation(lambda: _all_mx_with_h16_on("fprop", "h16_fprop_only"),
                                "MXFP4 in all three GEMMs, H16 on Fprop only"),
    "h16_dgrad_only": _ablation(lambda: _all_mx_with_h16_on("dgrad", "h16_dgrad_only"),
                                "MXFP4 in all three GEMMs, H16 on Dgrad only"),
    "mxfp4_wgrad_h16": _ablation(lambda: presets.get("mxfp4_wgrad_h16"),
                                 "MXFP4 in all three GEMMs, H16 on Wgrad only (preset)"),
    "wgrad_mx": _ablation(lambda: _wgrad_only("wgrad_mx"),
                          "MXFP4 in Wgrad only (dY and X), no rotation"),
    "wgrad_mx_h16": _ablation(lambda: _wgrad_only("wgrad_mx_h16", hadamard=_H16),
                              "MXFP4 in Wgrad only, H16 on both operands"),
    "wgrad_mx_rht16": _ablation(
        lambda: _wgrad_only("wgrad_mx_rht16", hadamard=Hadamard(block_size=16, randomized=True)),
        "MXFP4 in Wgrad only, random-sign H16"),
    "wgrad_mx_h32": _ablation(lambda: _wgrad_only("wgrad_mx_h32", hadamard=Hadamard(block_size=32)),
                              "MXFP4 in Wgrad only, H32"),
    "wgrad_dy_h16": _ablation(lambda: _wgrad_only("wgrad_dy_h16", x=False, hadamard=_H16),
                              "Wgrad H16, only dY in MXFP4 (X exact)"),
    "wgrad_x_h16": _ablation(lambda: _wgrad_only("wgrad_x_h16", dy=False, hadamard=_H16),
                             "Wgrad H16, only X in MXFP4 (dY exact)"),
    "wgrad_dy": _ablation(lambda: _wgrad_only("wgrad_dy", x=False),
                          "Wgrad, only dY in MXFP4, no rotation"),
    "wgrad_x": _ablation(lambda: _wgrad_only("wgrad_x", dy=False),
                         "Wgrad, only X in MXFP4, no rotation"),
    "wgrad_rot16": _ablation(lambda: _wgrad_only("wgrad_rot16", dy=False, x=False, hadamard=_H16),
                             "Wgrad H16 rotation with no quantization (must match exact)"),
})


def names() -> tuple[str, ...]:
    """Every policy name the study knows: ``none``, the presets, then the ablations."""
    return ("none",) + presets.names() + tuple(a for a in ABLATIONS if a not in presets.PRESETS)


def get(name: str) -> PrecisionPolicy | None:
    """The policy called `name` (None for ``none``, the exact reference).

    Raises:
      ValueError: unknown name (the message lists the valid ones).
    """
    if name in ABLATIONS:
        return ABLATIONS[name].build()
    try:
        return presets.resolve(name)
    except ValueError:
        raise ValueError(f"policy: unknown study policy {name!r}; valid: "
                         f"{', '.join(names())}") from None


def describe(name: str) -> str:
    """One line on what `name` quantizes."""
    if name in ABLATIONS:
        return ABLATIONS[name].description
    if name == "none":
        return "exact (fp32, no policy)"
    doc = (presets.PRESETS[name].__doc__ or "").strip().splitlines()
    return doc[0] if doc else name
