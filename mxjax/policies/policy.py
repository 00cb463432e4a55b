"""`PrecisionPolicy`: the recipes of the three GEMMs of every dot_general it is applied to.

It runs through the interceptor (``mxjax.interceptor``, the layer below):
``policy.dot_general(key)`` calls it, so the recipe types never import the interceptor.
``policy.with_backend(name)`` is the one way to set a policy's backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mxjax import formats as F
from mxjax import interceptor
from mxjax.backends import (
    Capabilities,
    capabilities,
    check_backend_name,
    chip_name,
    route_for,
)
from mxjax.formats import BF16
from mxjax.recipes import GEMMS, GemmRecipe, OperandRecipe
from mxjax.routes.spec import Route

__all__ = ["GemmSpec", "PrecisionPolicy"]


GemmSpec = GemmRecipe | OperandRecipe | F.Format | str | None


def _is_format(name: str) -> bool:
    try:
        F.get(name)
    except (TypeError, ValueError, KeyError):
        return False
    return True


def _coerce_gemm(value: Any, name: str) -> GemmRecipe:
    """One GEMM's recipe from what ``PrecisionPolicy`` accepts for it (see there)."""
    if isinstance(value, GemmRecipe):
        return value
    if value is None:
        return GemmRecipe(lhs=BF16, rhs=BF16)
    if isinstance(value, (OperandRecipe, F.Format, str)):
        try:
            return GemmRecipe(lhs=value, rhs=value)
        except (TypeError, ValueError) as e:
            hint = (f" (a preset's {name} GEMM is mxjax.policies.get({value!r}).{name})"
                    if isinstance(value, str) and not _is_format(value) else "")
            raise type(e)(f"PrecisionPolicy: {name}={value!r}: {e}{hint}") from None
    raise TypeError(
        f"PrecisionPolicy: {name} must be a GemmRecipe, an OperandRecipe or a format name such "
        f"as 'mxfp4' (both operands), or None / 'bf16' for pass-through; got "
        f"{type(value).__name__} {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """Recipes for the three GEMMs of every dot_general it is applied to.

    Attributes:
      fprop: Y = X·W, operands (X, W), blocks along the forward contraction K.
      dgrad: dX = dY·Wᵀ, operands (dY, W), blocks along N (rhs free axes).
      wgrad: dW = Xᵀ·dY, operands (dY, X), blocks along M (lhs free axes).
      name: optional label (presets carry their name). Not part of equality or
        the hash: two policies with the same recipes are the same policy.

    Each GEMM takes a :class:`GemmRecipe`, a preset's GEMM (``get('mxfp4_all_h16').wgrad``:
    a GemmRecipe), an :class:`OperandRecipe`, a Format or a format name (``'mxfp4'``:
    ``GemmRecipe(lhs='mxfp4', rhs='mxfp4')``, both operands, no Hadamard), or ``None`` /
    ``'bf16'`` for pass-through (plain ``lax.dot_general``: nothing is cast, an f32
    model stays f32). An omitted GEMM is pass-through. A format name takes
    ``OperandRecipe``'s defaults, i.e. OCP's FLOOR scales; the presets use EVEN
    (the paper's), so build the paper's recipe from ``OperandRecipe(fmt='mxfp4',
    scale_rule='even')`` or start from a preset: ``get('mxfp4_all_h16').replace(fprop=None)``.

    Use ``policy.dot_general(key)`` for a drop-in ``lax.dot_general`` and
    ``print(policy.describe())`` for the 3×2 table of what each operand gets.
    """

    fprop: GemmSpec = None
    dgrad: GemmSpec = None
    wgrad: GemmSpec = None
    name: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        for g in GEMMS:
            object.__setattr__(self, g, _coerce_gemm(getattr(self, g), g))
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"PrecisionPolicy: name must be a str or None, got {self.name!r}")

    @property
    def gemms(self) -> dict[str, GemmRecipe]:
        """{'fprop': ..., 'dgrad': ..., 'wgrad': ...}."""
        return {g: getattr(self, g) for g in GEMMS}

    @property
    def needs_key(self) -> bool:
        """True when any GEMM uses STOCHASTIC rounding or a randomized Hadamard."""
        return any(r.needs_key for r in self.gemms.values())

    @property
    def is_passthrough(self) -> bool:
        """True when all three GEMMs are plain ``lax.dot_general`` (the bf16 policy)."""
        return all(r.is_passthrough for r in self.gemms.values())

    def describe(self) -> str:
        """The 3×2 table (GEMM × operand) of what each operand gets, as text."""
        operand_names = {"fprop": ("X", "W"), "dgrad": ("dY", "W"), "wgrad": ("dY", "X")}
        rows = []
        for g, r in self.gemms.items():
            ln, rn = operand_names[g]
            had = r.hadamard.describe() if r.hadamard else "-"
            rows.append((g, f"{ln}: {r.lhs.describe()}", f"{rn}: {r.rhs.describe()}", had,
                         r.backend))
        header = ("GEMM", "lhs", "rhs", "hadamard", "backend")
        widths = [max(len(str(row[i])) for row in rows + [header]) for i in range(len(header))]
        fmt_row = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
        title = f"PrecisionPolicy {self.name!r}" if self.name else "PrecisionPolicy"
        lines = [title + (" (needs a PRNG key)" if self.needs_key else ""), fmt_row(header)]
        lines.append("  ".join("-" * w for w in widths))
        lines += [fmt_row(row) for row in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def dot_general(self, key=None):
        """A drop-in for ``jax.lax.dot_general`` under this policy.

        Args:
          key: PRNG key (typed or raw uint32); required when ``needs_key``.
        Returns:
          ``f(lhs, rhs, dimension_numbers, precision=None,
          preferred_element_type=None, **kwargs)``; ``operand_dtype`` and
          ``out_sharding`` are ``mxjax.interceptor.dot_general``'s, other
          keyword arguments are accepted and ignored.
        """
        if self.needs_key and key is None:
            raise ValueError(
                f"key: policy {self.name or ''!s} uses stochastic rounding or a randomized "
                "Hadamard; policy.dot_general(key) needs a PRNG key"
            )
        policy = self

        def policy_dot_general(lhs, rhs, dimension_numbers, precision=None,
                               preferred_element_type=None, **kwargs):
            return interceptor.dot_general(lhs, rhs, dimension_numbers, precision,
                                           preferred_element_type, policy=policy, key=key,
                                           **kwargs)

        policy_dot_general.policy = policy
        return policy_dot_general

    def with_backend(self, backend: str) -> PrecisionPolicy:
        """A copy whose quantized GEMMs all run on `backend` (pass-through GEMMs unchanged).

        The one way to set a policy's backend (the ``preset@backend`` names, a training
        config's ``backend`` and ``mxjax.testing.reference_policy`` all call it). A
        pass-through GEMM runs ``lax.dot_general`` whatever its backend, so it is left
        as it is. ``backend``: one of ``mxjax.backends.BACKENDS`` ('auto': the fastest
        route the chip compiled for has, per ``mxjax.backends.AUTO_CHOICES``); another
        name raises ValueError naming them. The copy is named ``'<name>@<backend>'``
        (the form `resolve` and `get` accept), or None if this policy has no name.
        """
        check_backend_name(backend)
        gemms = {g: (r if r.is_passthrough else dataclasses.replace(r, backend=backend))
                 for g in GEMMS for r in (getattr(self, g),)}
        base = self.name.split("@", 1)[0] if self.name else None
        return dataclasses.replace(self, name=None if base is None else f"{base}@{backend}",
                                   **gemms)

    def check_backends(self, *, caps: Capabilities | None = None) -> None:
        """Raises unless every quantized GEMM's backend can run on the chip compiled for
        (``mxjax.backends.BackendUnavailableError``, a RuntimeError) and implements its
        formats (ValueError); each message names the GEMM (``policy.fprop.backend: ...``).

        The GEMMs raise the same errors when traced or lowered; this checks them before
        anything compiles (e.g. a training run's ``--check``). ``caps``: another chip's
        capabilities (`mxjax.backends.capabilities_for`) instead of the target's.
        """
        for gemm in GEMMS:
            self._route(gemm, caps)

    def _route(self, gemm: str, caps: Capabilities | None) -> Route | None:
        """The route of `gemm` (a quantized one) on the chip of `caps` (None: the target's);
        errors name the GEMM (``policy.fprop.backend: ...``). None for a pass-through GEMM."""
        recipe = getattr(self, gemm)
        if recipe.is_passthrough:
            return None
        where = f"policy.{gemm}.backend"
        try:
            return route_for(recipe.backend, recipe.lhs.fmt, recipe.rhs.fmt, where=where,
                             caps=caps)
        except (RuntimeError, ValueError) as e:
            if str(e).startswith(f"{where}: "):  # a formats error names it already
                raise
            raise type(e)(f"{where}: {e}") from None

    def routes(self, platform: str | None = None, *,
               caps: Capabilities | None = None) -> dict[str, str]:
        """What each GEMM runs on, on the chip compiled for: ``{'chip': 'NVIDIA B200',
        'fprop': 'xla_fp4', 'dgrad': ..., 'wgrad': ...}``, each GEMM the route its backend
        resolves to there (`mxjax.backends.route_for`; 'auto' becomes the chip's choice) or
        'passthrough' (plain ``lax.dot_general``).

        ``platform``: the lowering platform ('cpu', 'gpu', 'tpu'; None: the target's own,
        e.g. the context mesh's abstract device in a deviceless compile). Raises as
        :meth:`check_backends` does for a backend that cannot run there. ``caps``: another
        chip's capabilities (`mxjax.backends.capabilities_for`) instead of the target's.
        """
        caps = capabilities(platform) if caps is None else caps
        out = {"chip": chip_name(caps)}
        for gemm in GEMMS:
            route = self._route(gemm, caps)
            out[gemm] = "passthrough" if route is None else route.name
        return out

    def replace(self, **changes: Any) -> PrecisionPolicy:
        """A copy with some fields replaced, each GEMM in any form the constructor takes.

        The copy keeps ``name`` only if you pass it: a changed preset is no longer
        that preset (``get('mxfp4_all_h16').replace(fprop=None).name is None``).
        """
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"PrecisionPolicy.replace: unknown field(s) {', '.join(unknown)}; "
                            f"valid: {', '.join((*GEMMS, 'name'))}")
        changes.setdefault("name", None)
        return dataclasses.replace(self, **changes)
