"""OperandRecipe: how one operand is quantized, validated once at construction.

The quantizer's one spec (``mxjax.quantization.quantize_with`` and friends, the
fused Pallas quantizer) and one GEMM operand's recipe (``mxjax.GemmRecipe``):
a format, its scale rule, the element rounding and the stochastic-rounding
pre-scale. ``recipe.scheme`` is the format's scaling scheme
(``mxjax.scaling``). Re-exported as ``mxjax.OperandRecipe`` and
``mxjax.recipes.OperandRecipe``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mxjax import formats as F
from mxjax.formats import Format, Rounding, ScaleRule
from mxjax.scaling import ScalingScheme, scheme_for

__all__ = ["OperandRecipe", "check_bool"]


def check_bool(value: Any, name: str) -> bool:
    """`value` if it is a bool; TypeError naming `name` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class OperandRecipe:
    """How one GEMM operand is quantized.

    Attributes:
      fmt: a :class:`mxjax.formats.Format` (or its name, e.g. ``'mxfp4'``).
        ``BF16`` means pass-through: the operand is used as is.
      scale_rule: E8M0 scale rule (MX formats only; NVFP4, per-tensor FP8 and
        BF16 have a fixed scale computation and accept only ``FLOOR``). The
        default is ``FLOOR``, OCP v1.0's rule and ``mxjax.quantize``'s default;
        every ``mxfp4_*`` preset (the paper's kernels) uses ``EVEN`` instead, so
        a recipe "like the paper's" must say ``scale_rule=ScaleRule.EVEN``.
      rounding: element rounding. ``STOCHASTIC`` needs a PRNG key at call time.
        BF16 accepts only ``NEAREST_EVEN`` (nothing is rounded).
      sr_prescale: multiply by 3/4 before stochastic rounding (Tseng et al.);
        only with ``STOCHASTIC``.
    """

    fmt: Format | str
    # OCP v1.0's rule, as in ``mxjax.quantize``. The presets (the paper's recipe) use EVEN:
    # ``OperandRecipe(fmt='mxfp4', scale_rule='even')``; describe() always names the rule.
    scale_rule: ScaleRule | str = ScaleRule.FLOOR
    rounding: Rounding | str = Rounding.NEAREST_EVEN
    sr_prescale: bool = False

    def __post_init__(self):
        fmt = F.get(self.fmt)
        rule = F.scale_rule(self.scale_rule)
        mode = F.rounding(self.rounding)
        check_bool(self.sr_prescale, "sr_prescale")
        if fmt.is_passthrough and (rule is not ScaleRule.FLOOR or mode is not Rounding.NEAREST_EVEN
                                   or self.sr_prescale):
            raise ValueError(
                "OperandRecipe: fmt=BF16 is pass-through (nothing is quantized), so "
                f"scale_rule={rule.name}, rounding={mode.name}, sr_prescale={self.sr_prescale} "
                "would have no effect; use the defaults or a quantized format"
            )
        if not fmt.is_passthrough and rule not in scheme_for(fmt).scale_rules:
            raise ValueError(
                f"OperandRecipe: scale_rule={rule.name} applies to E8M0-scaled MX formats only; "
                f"fmt={fmt.name} has a fixed scale computation (use ScaleRule.FLOOR)"
            )
        if self.sr_prescale and mode is not Rounding.STOCHASTIC:
            raise ValueError(
                f"OperandRecipe: sr_prescale=True needs rounding=STOCHASTIC, got {mode.name}"
            )
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "scale_rule", rule)
        object.__setattr__(self, "rounding", mode)

    def replace(self, **changes: Any) -> OperandRecipe:
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def is_passthrough(self) -> bool:
        """True for BF16: the operand is not quantized."""
        return self.fmt.is_passthrough

    @property
    def needs_key(self) -> bool:
        """True when rounding is STOCHASTIC."""
        return self.rounding is Rounding.STOCHASTIC

    @property
    def scheme(self) -> ScalingScheme | None:
        """The format's scaling scheme (``mxjax.scaling``); None for pass-through."""
        return None if self.is_passthrough else scheme_for(self.fmt)

    def describe(self) -> str:
        """Short text, e.g. ``'mxfp4 even/nearest_even'`` or ``'bf16 (pass-through)'``."""
        if self.is_passthrough:
            return "bf16 (pass-through)"
        parts = [self.fmt.name]
        if len(self.scheme.scale_rules) > 1:  # the scale rule is a choice: say which
            parts.append(f"{self.scale_rule.value}/{self.rounding.value}")
        else:
            parts.append(self.rounding.value)
        if self.sr_prescale:
            parts.append("x3/4")
        return " ".join(parts)
