"""Precision policies: the PrecisionPolicy type, its presets and its dict form.

A :class:`PrecisionPolicy` holds one ``mxjax.recipes.GemmRecipe`` per GEMM of a
linear layer (fprop, dgrad, wgrad). It runs through the interceptor
(``mxjax.interceptor``, the layer below): ``policy.dot_general(key)`` and
:func:`dot_general` (which also takes a preset name) call it, so the recipe
types never import the interceptor.

Presets (``get(name)``; ``print(get(name).describe())`` prints what every operand
gets; each builder's docstring says where the recipe comes from). "MXFP4" below is
E2M1 with an E8M0 scale per 32 along the GEMM's contraction, EVEN scales,
nearest-even; "H16" is the fixed Sylvester Hadamard of size 16 on both operands:

========================  ==============================================================
name                      what it does
========================  ==============================================================
passthrough               no quantization: plain ``lax.dot_general`` (nothing is cast)
fp8                       FP8 per-tensor: E4M3 X, W; E5M2 dY (the paper's baseline)
mxfp4_fprop               MXFP4 in fprop; dgrad, wgrad pass-through
mxfp4_fprop_dgrad         MXFP4 in fprop and dgrad; wgrad pass-through
mxfp4_all                 MXFP4 in all three GEMMs, no rotation
mxfp4_all_sr              MXFP4 everywhere, stochastic rounding in dgrad and wgrad (key)
mxfp4_all_rht16           MXFP4 everywhere, random-sign H16 on every GEMM (key)
mxfp4_all_h16             the paper's recipe: MXFP4 everywhere, H16 on every GEMM
mxfp4_all_h32             MXFP4 everywhere, H32 on every GEMM
mxfp4_all_h16_fprop       MXFP4 everywhere, H16 on fprop only
mxfp4_all_h16_dgrad       MXFP4 everywhere, H16 on dgrad only
mxfp4_all_h16_wgrad       MXFP4 everywhere, H16 on wgrad only
mxfp4_wgrad_only          MXFP4 in wgrad only (dY and X); fprop, dgrad pass-through
mxfp4_wgrad_only_h16      MXFP4 in wgrad only, H16 there
mxfp4_wgrad_only_rht16    MXFP4 in wgrad only, random-sign H16 there (key)
mxfp4_wgrad_only_h32      MXFP4 in wgrad only, H32 there
mxfp4_wgrad_only_dy       wgrad's dY in MXFP4 only (X and the other GEMMs pass-through)
mxfp4_wgrad_only_dy_h16   as mxfp4_wgrad_only_dy, H16 on both wgrad operands
mxfp4_wgrad_only_x        wgrad's X in MXFP4 only
mxfp4_wgrad_only_x_h16    as mxfp4_wgrad_only_x, H16 on both wgrad operands
passthrough_wgrad_h16     control: H16 on wgrad, no quantization (equals passthrough
                          up to float rounding)
mxfp8                     MXFP8 E4M3 everywhere, RCEIL scales (NVIDIA's MXFP8 recipe)
nvfp4                     NVIDIA's NVFP4 recipe (SR on dY, fixed-sign H16 on wgrad; key)
tseng                     Tseng et al.: bf16 fprop; MXFP4 backward, random H64, SR x3/4
========================  ==============================================================

Deprecated names (:data:`ALIASES`; they still work and warn with the new name):
``bf16`` → ``passthrough`` (it never cast to bf16: an f32 model stays f32; to
compute in bf16 set the model's dtype), ``mxfp4_wgrad_h16`` → ``mxfp4_all_h16_wgrad``.
``"none"`` (:func:`resolve`) means no policy at all; it computes what
``passthrough`` computes.

One spec everywhere: :func:`resolve` takes a preset name, ``"none"``/None, a
dict (:func:`to_dict`'s layout) or a PrecisionPolicy, and so do
``mxjax.nn.wrap``, ``mxjax.nn.Rule``, the train config's ``policy:`` and the
study's policy lists.

The paper is "Pretraining large language models with MXFP4 on Native FP4
Hardware" (arXiv 2605.09825). Its MI355X kernels compute E8M0 scales with the
EVEN rule (torchao's EVEN: round amax to the element mantissa width, then
floor) and round elements to nearest-even, so every ``mxfp4_*`` preset uses
EVEN scales and nearest-even rounding unless it says otherwise.
"""

from __future__ import annotations

import dataclasses
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax

from mxjax import formats as F
from mxjax import interceptor
from mxjax.backends import BACKENDS, check_backend_name, route_for
from mxjax.formats import BF16, FP8_E4M3, FP8_E5M2, MXFP4, MXFP8_E4M3, NVFP4, Rounding, ScaleRule
from mxjax.recipes import GEMMS, GemmRecipe, Hadamard, OperandRecipe
from mxjax.validation import check_keys

__all__ = ["ABLATIONS", "ALIASES", "PRESETS", "PrecisionPolicy", "canonical_name", "dot_general",
           "from_dict", "get", "names", "resolve", "to_dict"]


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
        if isinstance(value, str) and value in (*PRESETS, *ALIASES) and not _is_format(value):
            raise ValueError(
                f"PrecisionPolicy: {name}={value!r} is a preset name, not a format; for that "
                f"preset's {name} GEMM pass mxjax.policies.get({value!r}).{name}")
        try:
            return GemmRecipe(lhs=value, rhs=value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"PrecisionPolicy: {name}={value!r}: {e}") from None
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

    def check_backends(self) -> None:
        """Raises unless every quantized GEMM's backend can run on the chip compiled for
        (``mxjax.backends.BackendUnavailableError``, a RuntimeError) and implements its
        formats (ValueError); each message names the GEMM (``policy.fprop.backend: ...``).

        The GEMMs raise the same errors when traced or lowered; this checks them before
        anything compiles (e.g. a training run's ``--check``).
        """
        for gemm, recipe in self.gemms.items():
            if recipe.is_passthrough:
                continue
            try:
                route_for(recipe.backend, recipe.lhs.fmt, recipe.rhs.fmt, where=f"policy.{gemm}")
            except (RuntimeError, ValueError) as e:
                raise type(e)(f"policy.{gemm}.backend: {e}") from None

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


# ---------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------
_PT = OperandRecipe(fmt=BF16)
_PASS = GemmRecipe(lhs=_PT, rhs=_PT)
_MX = OperandRecipe(fmt=MXFP4, scale_rule=ScaleRule.EVEN)
_MX_SR = OperandRecipe(fmt=MXFP4, scale_rule=ScaleRule.EVEN, rounding=Rounding.STOCHASTIC)
_MXGEMM = GemmRecipe(lhs=_MX, rhs=_MX)


def _mx_gemm(hadamard: Hadamard | None = None) -> GemmRecipe:
    return GemmRecipe(lhs=_MX, rhs=_MX, hadamard=hadamard)


def passthrough() -> PrecisionPolicy:
    """No quantization: all three GEMMs are plain ``lax.dot_general`` (bit for bit).

    fprop (X, W), dgrad (dY, W), wgrad (dY, X): pass-through, no Hadamard. Nothing
    is cast: an f32 model stays f32, a bf16 model stays bf16 (to compute in bf16,
    set the model's dtype). ``'none'`` (no policy) computes the same values. Formerly
    ``bf16`` (still accepted, deprecated: it named a dtype it never cast to).
    """
    return PrecisionPolicy(fprop=_PASS, dgrad=_PASS, wgrad=_PASS, name="passthrough")


def fp8() -> PrecisionPolicy:
    """The FP8 baseline (the paper's reference run): per-tensor current scaling.

    fprop: X and W in FP8 E4M3. dgrad: dY in FP8 E5M2, W in E4M3. wgrad: dY in
    E5M2, X in E4M3. Scale = amax of the tensor now / max_normal (fp32); elements
    round to nearest-even and saturate. No Hadamard.
    """
    e4 = OperandRecipe(fmt=FP8_E4M3)
    e5 = OperandRecipe(fmt=FP8_E5M2)
    return PrecisionPolicy(
        fprop=GemmRecipe(lhs=e4, rhs=e4),
        dgrad=GemmRecipe(lhs=e5, rhs=e4),
        wgrad=GemmRecipe(lhs=e5, rhs=e4),
        name="fp8",
    )


def mxfp4_fprop() -> PrecisionPolicy:
    """Paper's ladder, step 1: MXFP4 in the forward GEMM only (paper: +8–9% tokens vs FP8).

    fprop: X and W in MXFP4 (E2M1, E8M0 scale per 32 along K), EVEN scales,
    nearest-even. dgrad and wgrad: pass-through. No Hadamard.
    """
    return PrecisionPolicy(fprop=_MXGEMM, dgrad=_PASS, wgrad=_PASS, name="mxfp4_fprop")


def mxfp4_fprop_dgrad() -> PrecisionPolicy:
    """Paper's ladder, step 2: MXFP4 in fprop and dgrad (paper: +10–11% tokens).

    fprop: X, W in MXFP4 blocked along K. dgrad: dY, W in MXFP4 blocked along N.
    EVEN scales, nearest-even. wgrad: pass-through. No Hadamard.
    """
    return PrecisionPolicy(fprop=_MXGEMM, dgrad=_MXGEMM, wgrad=_PASS, name="mxfp4_fprop_dgrad")


def mxfp4_all() -> PrecisionPolicy:
    """Paper's ladder, step 3: MXFP4 in all three GEMMs, no stabilization (paper: +26–27%).

    fprop: X, W blocked along K; dgrad: dY, W along N; wgrad: dY, X along M
    (tokens). All MXFP4, EVEN scales, nearest-even, no Hadamard.
    """
    return PrecisionPolicy(fprop=_MXGEMM, dgrad=_MXGEMM, wgrad=_MXGEMM, name="mxfp4_all")


def mxfp4_all_sr() -> PrecisionPolicy:
    """Paper's stochastic-rounding row: MXFP4 everywhere, SR in the backward GEMMs.

    fprop: X, W MXFP4 nearest-even. dgrad (dY, W) and wgrad (dY, X): MXFP4 with
    stochastic rounding (no pre-scale). EVEN scales throughout, no Hadamard.
    Needs a key. The paper reports that this does not converge once wgrad is
    MXFP4.
    """
    sr = GemmRecipe(lhs=_MX_SR, rhs=_MX_SR)
    return PrecisionPolicy(fprop=_MXGEMM, dgrad=sr, wgrad=sr, name="mxfp4_all_sr")


def mxfp4_all_rht16() -> PrecisionPolicy:
    """Paper's randomized-Hadamard row: MXFP4 everywhere with a random-sign H16.

    All three GEMMs: both operands rotated by H16 with a fresh ±1 sign vector per
    call (per GEMM, layer and step via the key) along the GEMM's contraction,
    then MXFP4 with EVEN scales, nearest-even. Needs a key. The paper reports
    that this does not converge once wgrad is MXFP4.
    """
    g = _mx_gemm(Hadamard(block_size=16, randomized=True))
    return PrecisionPolicy(fprop=g, dgrad=g, wgrad=g, name="mxfp4_all_rht16")


def mxfp4_all_h16() -> PrecisionPolicy:
    """The paper's recipe: deterministic H16 on every operand of all three GEMMs.

    fprop (X, W along K), dgrad (dY, W along N), wgrad (dY, X along M): both
    operands rotated by the fixed Sylvester H16 (no signs), so each 32-element
    MXFP4 block is two rotated 16-halves; then MXFP4 with EVEN scales and
    nearest-even rounding. Deterministic (no key). Paper: +8–9% tokens with all
    three GEMMs in MXFP4, +20% step throughput on MI355X.
    """
    g = _mx_gemm(Hadamard(block_size=16))
    return PrecisionPolicy(fprop=g, dgrad=g, wgrad=g, name="mxfp4_all_h16")


def mxfp4_all_h32() -> PrecisionPolicy:
    """The paper's recipe with a deterministic H32 (one rotation per MXFP4 block).

    As ``mxfp4_all_h16`` with the fixed Sylvester H32 (no signs) on both operands
    of all three GEMMs; MXFP4, EVEN scales, nearest-even. Paper: about as good
    as H16.
    """
    g = _mx_gemm(Hadamard(block_size=32))
    return PrecisionPolicy(fprop=g, dgrad=g, wgrad=g, name="mxfp4_all_h32")


def _all_mx_h16_on(gemm: str, name: str) -> PrecisionPolicy:
    return dataclasses.replace(mxfp4_all(), **{gemm: _mx_gemm(Hadamard(block_size=16))},
                               name=name)


def mxfp4_all_h16_fprop() -> PrecisionPolicy:
    """Ablation: MXFP4 in all three GEMMs, deterministic H16 on fprop only.

    fprop (X, W): fixed H16 along K, then MXFP4. dgrad (dY, W) and wgrad (dY, X):
    MXFP4, no Hadamard. EVEN scales, nearest-even throughout. Deterministic.
    """
    return _all_mx_h16_on("fprop", "mxfp4_all_h16_fprop")


def mxfp4_all_h16_dgrad() -> PrecisionPolicy:
    """Ablation: MXFP4 in all three GEMMs, deterministic H16 on dgrad only.

    dgrad (dY, W): fixed H16 along N, then MXFP4. fprop (X, W) and wgrad (dY, X):
    MXFP4, no Hadamard. EVEN scales, nearest-even throughout. Deterministic.
    """
    return _all_mx_h16_on("dgrad", "mxfp4_all_h16_dgrad")


def mxfp4_all_h16_wgrad() -> PrecisionPolicy:
    """Ablation: MXFP4 in all three GEMMs, deterministic H16 on wgrad only (tests the
    paper's claim that the instability lives on the wgrad path).

    fprop (X, W) and dgrad (dY, W): MXFP4, no Hadamard. wgrad (dY, X): fixed H16
    along M, then MXFP4. EVEN scales, nearest-even throughout. Deterministic.
    Formerly ``mxfp4_wgrad_h16`` (still accepted, deprecated).
    """
    return _all_mx_h16_on("wgrad", "mxfp4_all_h16_wgrad")


def _wgrad_only(name: str, *, dy: bool = True, x: bool = True,
                hadamard: Hadamard | None = None) -> PrecisionPolicy:
    """fprop and dgrad pass-through; wgrad's dY (lhs) and X (rhs) in MXFP4 (EVEN,
    nearest-even) where asked, else pass-through; `hadamard` on both wgrad operands."""
    wgrad = GemmRecipe(lhs=_MX if dy else _PT, rhs=_MX if x else _PT, hadamard=hadamard)
    return PrecisionPolicy(fprop=_PASS, dgrad=_PASS, wgrad=wgrad, name=name)


def mxfp4_wgrad_only() -> PrecisionPolicy:
    """Ablation: MXFP4 in wgrad only (dY and X), no Hadamard.

    fprop (X, W) and dgrad (dY, W): pass-through. wgrad (dY, X): MXFP4 blocked
    along M, EVEN scales, nearest-even. Deterministic.
    """
    return _wgrad_only("mxfp4_wgrad_only")


def mxfp4_wgrad_only_h16() -> PrecisionPolicy:
    """Ablation: MXFP4 in wgrad only, deterministic H16 on both wgrad operands.

    fprop and dgrad: pass-through. wgrad (dY, X): fixed H16 along M, then MXFP4,
    EVEN scales, nearest-even. Deterministic.
    """
    return _wgrad_only("mxfp4_wgrad_only_h16", hadamard=Hadamard(block_size=16))


def mxfp4_wgrad_only_rht16() -> PrecisionPolicy:
    """Ablation: MXFP4 in wgrad only, random-sign H16 on both wgrad operands.

    fprop and dgrad: pass-through. wgrad (dY, X): H16 with a fresh ±1 sign vector
    per call along M, then MXFP4, EVEN scales, nearest-even. Needs a key.
    """
    return _wgrad_only("mxfp4_wgrad_only_rht16",
                       hadamard=Hadamard(block_size=16, randomized=True))


def mxfp4_wgrad_only_h32() -> PrecisionPolicy:
    """Ablation: MXFP4 in wgrad only, deterministic H32 on both wgrad operands.

    fprop and dgrad: pass-through. wgrad (dY, X): fixed H32 along M, then MXFP4,
    EVEN scales, nearest-even. Deterministic.
    """
    return _wgrad_only("mxfp4_wgrad_only_h32", hadamard=Hadamard(block_size=32))


def mxfp4_wgrad_only_dy() -> PrecisionPolicy:
    """Ablation: only wgrad's dY in MXFP4 (X pass-through), no Hadamard.

    fprop and dgrad: pass-through. wgrad: dY in MXFP4 along M (EVEN,
    nearest-even), X pass-through. Deterministic.
    """
    return _wgrad_only("mxfp4_wgrad_only_dy", x=False)


def mxfp4_wgrad_only_dy_h16() -> PrecisionPolicy:
    """Ablation: only wgrad's dY in MXFP4, H16 on both wgrad operands.

    fprop and dgrad: pass-through. wgrad: both operands rotated by the fixed H16
    along M; dY then MXFP4 (EVEN, nearest-even), X pass-through. Deterministic.
    """
    return _wgrad_only("mxfp4_wgrad_only_dy_h16", x=False, hadamard=Hadamard(block_size=16))


def mxfp4_wgrad_only_x() -> PrecisionPolicy:
    """Ablation: only wgrad's X in MXFP4 (dY pass-through), no Hadamard.

    fprop and dgrad: pass-through. wgrad: X in MXFP4 along M (EVEN,
    nearest-even), dY pass-through. Deterministic.
    """
    return _wgrad_only("mxfp4_wgrad_only_x", dy=False)


def mxfp4_wgrad_only_x_h16() -> PrecisionPolicy:
    """Ablation: only wgrad's X in MXFP4, H16 on both wgrad operands.

    fprop and dgrad: pass-through. wgrad: both operands rotated by the fixed H16
    along M; X then MXFP4 (EVEN, nearest-even), dY pass-through. Deterministic.
    """
    return _wgrad_only("mxfp4_wgrad_only_x_h16", dy=False, hadamard=Hadamard(block_size=16))


def passthrough_wgrad_h16() -> PrecisionPolicy:
    """A control: H16 on both wgrad operands and no quantization anywhere.

    fprop and dgrad: pass-through. wgrad (dY, X): fixed H16 along M on both
    operands, no quantization (the rotation cancels: equals ``passthrough`` up to
    float rounding). Deterministic.
    """
    return _wgrad_only("passthrough_wgrad_h16", dy=False, x=False,
                       hadamard=Hadamard(block_size=16))


def nvfp4() -> PrecisionPolicy:
    """NVIDIA's NVFP4 training recipe, as far as per-operand recipes express it.

    All three GEMMs in NVFP4 (E2M1, E4M3 scale per 16, fp32 per-tensor scale).
    fprop (X, W): nearest-even, no Hadamard. dgrad (dY, W): dY stochastic
    rounding, W nearest-even, no Hadamard. wgrad (dY, X): 16×16 Hadamard with a
    fixed random sign vector (seed 0, the same every step) on both operands along
    M, dY stochastic rounding, X nearest-even. Needs a key (for the SR).

    Not expressible here: NVIDIA quantizes weights in 2-D 16×16 blocks so fprop
    and dgrad share one quantized W; mxjax quantizes W with 1×16 blocks along each
    GEMM's own contraction (K for fprop, N for dgrad). NVIDIA also keeps the last
    few layers in BF16: use ``mxjax.nn.wrap`` rules for that.
    """
    rne = OperandRecipe(fmt=NVFP4)
    sr = OperandRecipe(fmt=NVFP4, rounding=Rounding.STOCHASTIC)
    return PrecisionPolicy(
        fprop=GemmRecipe(lhs=rne, rhs=rne),
        dgrad=GemmRecipe(lhs=sr, rhs=rne),
        wgrad=GemmRecipe(lhs=sr, rhs=rne, hadamard=Hadamard(block_size=16, seed=0)),
        name="nvfp4",
    )


def tseng() -> PrecisionPolicy:
    """Tseng et al. 2025, "Training LLMs with MXFP4": BF16 forward, MXFP4 backward.

    fprop: pass-through. dgrad (dY, W) and wgrad (dY, X): both operands rotated
    by a random-sign H64 (fresh signs per call) along the GEMM's contraction,
    then MXFP4 with OCP FLOOR scales and stochastic rounding with the 3/4
    pre-scale (so FLOOR never saturates). Needs a key.
    """
    sr = OperandRecipe(fmt=MXFP4, scale_rule=ScaleRule.FLOOR, rounding=Rounding.STOCHASTIC,
                       sr_prescale=True)
    g = GemmRecipe(lhs=sr, rhs=sr, hadamard=Hadamard(block_size=64, randomized=True))
    return PrecisionPolicy(fprop=_PASS, dgrad=g, wgrad=g, name="tseng")


def mxfp8() -> PrecisionPolicy:
    """MXFP8 everywhere, as NVIDIA publishes it: E4M3 x E8M0 per 32, RCEIL scales.

    fprop (X, W), dgrad (dY, W), wgrad (dY, X): MXFP8 E4M3 operands (gradients
    included) with round-up (RCEIL) scales and round-to-nearest-even elements, no
    Hadamard. Sources: Mishra et al., "Recipes for Pre-training LLMs with MXFP8"
    (arXiv 2506.08027: E4M3 for all tensors with scales rounded up matched BF16 on an
    8B model over 15T tokens, where OCP's FLOOR scales diverged), and Transformer
    Engine's ``MXFP8BlockScaling`` default (E4M3 forward and backward: the 32-element
    blocks give gradients the range that E5M2 gives per-tensor FP8). On CUDA the GEMMs
    go through ``jax.nn.scaled_matmul``: cuDNN's block-scaled MMA on Blackwell, XLA's
    dequantize + f32 GEMM on Hopper; other platforms run the emulation
    (docs/NUMERICS.md, "FP8 GEMMs on FP8 tensor cores").
    """
    e4 = OperandRecipe(fmt=MXFP8_E4M3, scale_rule=ScaleRule.RCEIL)
    g = GemmRecipe(lhs=e4, rhs=e4)
    return PrecisionPolicy(fprop=g, dgrad=g, wgrad=g, name="mxfp8")


PRESETS: Mapping[str, Callable[[], PrecisionPolicy]] = types.MappingProxyType({
    f.__name__: f
    for f in (
        # the paper's ladder (fp8 is its baseline)
        passthrough, fp8, mxfp4_fprop, mxfp4_fprop_dgrad, mxfp4_all, mxfp4_all_sr,
        mxfp4_all_rht16, mxfp4_all_h16, mxfp4_all_h32,
        # ablations: which GEMM, which operand, which rotation
        mxfp4_all_h16_fprop, mxfp4_all_h16_dgrad, mxfp4_all_h16_wgrad,
        mxfp4_wgrad_only, mxfp4_wgrad_only_h16, mxfp4_wgrad_only_rht16, mxfp4_wgrad_only_h32,
        mxfp4_wgrad_only_dy, mxfp4_wgrad_only_dy_h16, mxfp4_wgrad_only_x,
        mxfp4_wgrad_only_x_h16, passthrough_wgrad_h16,
        # peers' recipes
        mxfp8, nvfp4, tseng,
    )
})

# The ablation presets: each changes one thing (a GEMM, an operand, a rotation) of a ladder
# preset, from the same GEMM recipes (sweeps over "every recipe" may skip them).
ABLATIONS: tuple[str, ...] = (
    "mxfp4_all_h16_fprop", "mxfp4_all_h16_dgrad", "mxfp4_all_h16_wgrad",
    "mxfp4_wgrad_only", "mxfp4_wgrad_only_h16", "mxfp4_wgrad_only_rht16", "mxfp4_wgrad_only_h32",
    "mxfp4_wgrad_only_dy", "mxfp4_wgrad_only_dy_h16", "mxfp4_wgrad_only_x",
    "mxfp4_wgrad_only_x_h16", "passthrough_wgrad_h16",
)

# Former preset names -> current ones. Still accepted (with a DeprecationWarning naming the
# new name); the policy they give carries the new name.
ALIASES: Mapping[str, str] = types.MappingProxyType({
    "bf16": "passthrough",
    "mxfp4_wgrad_h16": "mxfp4_all_h16_wgrad",
})

_ALIAS_WHY = {
    "bf16": "it is a pass-through, not a cast to bf16 (an f32 model stays f32)",
    "mxfp4_wgrad_h16": "it is MXFP4 in all three GEMMs with H16 on Wgrad only; MXFP4 in "
                       "Wgrad only with H16 is 'mxfp4_wgrad_only_h16'",
}




def names() -> tuple[str, ...]:
    """Names of all presets, in ladder order (the deprecated :data:`ALIASES` excluded)."""
    return tuple(PRESETS)


def canonical_name(name: str, *, stacklevel: int = 2) -> str:
    """`name`, or the current name of a deprecated alias (warning with DeprecationWarning).

    Unknown names are returned unchanged (the caller reports them).
    """
    if name in ALIASES:
        new = ALIASES[name]
        warnings.warn(f"policy preset {name!r} is deprecated ({_ALIAS_WHY[name]}); use "
                      f"{new!r}", DeprecationWarning, stacklevel=stacklevel + 1)
        return new
    return name


def _valid_names(with_none: bool) -> str:
    return ", ".join((("none",) if with_none else ()) + names())


def get(name: str | PrecisionPolicy) -> PrecisionPolicy:
    """The preset called `name` (a PrecisionPolicy is returned unchanged).

    Deprecated names (:data:`ALIASES`) give their new preset with a DeprecationWarning.

    Raises:
      ValueError: unknown name (the message lists the valid ones).
    """
    if isinstance(name, PrecisionPolicy):
        return name
    if isinstance(name, str):
        policy = _preset(name, stacklevel=4)
        if policy is not None:
            return policy
    raise ValueError(f"policy: unknown preset {name!r}; valid names: {_valid_names(False)} "
                     f"(each optionally as '<name>@<backend>', backend one of {BACKENDS})")


def _preset(spec: str, *, stacklevel: int) -> PrecisionPolicy | None:
    """The preset `spec` names ('<name>' or '<name>@<backend>'), or None if unknown."""
    name, at, backend = spec.partition("@")
    name = canonical_name(name, stacklevel=stacklevel)
    if name not in PRESETS:
        return None
    policy = PRESETS[name]()
    return policy.with_backend(backend) if at else policy


def resolve(spec: str | Mapping[str, Any] | PrecisionPolicy | None) -> PrecisionPolicy | None:
    """The policy `spec` stands for: the one place a policy is looked up by name or dict.

    Args:
      spec: a preset name (:func:`names`; a deprecated :data:`ALIASES` name warns);
        ``None`` or ``"none"`` (any case) for no policy; a dict in :func:`to_dict`'s
        layout (:func:`from_dict`); or a PrecisionPolicy (returned unchanged).
    Returns:
      A PrecisionPolicy, or None for no policy.
    Raises:
      ValueError: an unknown name (the message lists the valid ones) or a dict
        with unknown/missing keys or bad values (the message names the key).
      TypeError: any other kind of `spec`, or a dict entry of the wrong type.
    """
    if spec is None or isinstance(spec, PrecisionPolicy):
        return spec
    if isinstance(spec, str):
        if spec.lower() == "none":
            return None
        policy = _preset(spec, stacklevel=4)
        if policy is not None:
            return policy
        raise ValueError(f"policy: unknown preset {spec!r}; valid names: "
                         f"{_valid_names(True)} (each optionally as '<name>@<backend>', "
                         f"backend one of {BACKENDS})")
    if isinstance(spec, Mapping):
        return from_dict(spec)
    raise TypeError(f"policy: expected a preset name, None or 'none', a policy dict or a "
                    f"PrecisionPolicy, got {type(spec).__name__} {spec!r}")


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    policy: PrecisionPolicy | str | Mapping[str, Any],
    key: jax.Array | None = None,
    **kwargs,
) -> jax.Array:
    """``jax.lax.dot_general`` whose fprop, dgrad and wgrad follow `policy` (``mxjax.dot_general``).

    ``policy`` is anything :func:`resolve` takes except no policy (a
    PrecisionPolicy, a preset name or a policy dict); everything else is
    ``mxjax.interceptor.dot_general``'s (see there for shapes, dtypes and ``key``).
    """
    resolved = resolve(policy) if isinstance(policy, (str, Mapping)) else policy
    if not isinstance(resolved, PrecisionPolicy):
        raise TypeError(f"policy: expected a PrecisionPolicy, a preset name or a policy dict, "
                        f"got {policy!r}")
    policy = resolved
    return interceptor.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                   policy=policy, key=key, **kwargs)


# --------------------------------------------------------------------------- #
# Plain-dict I/O (for YAML configs)
# --------------------------------------------------------------------------- #
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


def to_dict(policy: PrecisionPolicy | str) -> dict[str, Any]:
    """A plain dict (str/bool/int/None leaves) that ``from_dict`` turns back into `policy`."""
    p = get(policy)
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


def from_dict(d: Mapping[str, Any] | str) -> PrecisionPolicy:
    """Builds a PrecisionPolicy from ``to_dict``'s layout (or a preset name).

    Layout: ``{'name': str|None, 'fprop'|'dgrad'|'wgrad': {'lhs': operand,
    'rhs': operand, 'hadamard': None|int|{'block_size', 'randomized', 'seed'},
    'backend': 'xla'}}`` where an operand is a format name or ``{'fmt',
    'scale_rule', 'rounding', 'sr_prescale'}`` (missing fields take their
    defaults). Unknown keys are errors.
    """
    if isinstance(d, str):
        return get(d)
    check_keys(d, {"name", *GEMMS}, GEMMS, where="policy dict")
    return PrecisionPolicy(name=d.get("name"), **{g: _gemm_from(d[g], g) for g in GEMMS})
