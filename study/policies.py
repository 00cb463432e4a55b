"""The policies of the ladder study: the paper's rungs and the ablations that locate an effect.

The rungs are presets of ``mxjax.policies``; the ablations are the study's own
(:data:`ABLATION_PRESETS`: ``mxfp4_all_h16_<gemm>``, the ``mxfp4_wgrad_only*`` family and
the ``passthrough_wgrad_h16`` control, built from the library's recipes; the library's
``mxfp4_all_h16_wgrad`` is one of them): each changes one thing against a rung, so a
difference in training can be pinned on one GEMM, one operand, or the rotation
itself. A study config may also define its own policies inline (a policy dict or
a PrecisionPolicy where a name goes: ``study.config``); `get` takes those as
``custom`` (name -> policy dict).

The study's former private names (``wgrad_mx_h16``, ``h16_fprop_only``, ...) are
still read, with a DeprecationWarning naming the current one (:data:`LEGACY`).
"""

from __future__ import annotations

import dataclasses
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from mxjax import GemmRecipe, Hadamard, PrecisionPolicy
from mxjax import policies as presets

# The paper's Table 1, in reading order (fp8 is its baseline).
RUNGS: tuple[str, ...] = ("fp8", "mxfp4_fprop", "mxfp4_fprop_dgrad", "mxfp4_all",
                          "mxfp4_all_sr", "mxfp4_all_rht16", "mxfp4_all_h16", "mxfp4_all_h32")


def _h16_on(gemm: str, name: str) -> PrecisionPolicy:
    """MXFP4 in all three GEMMs (``mxfp4_all``), `gemm` the H16 one (``mxfp4_all_h16``'s)."""
    return dataclasses.replace(presets.get("mxfp4_all"),
                               **{gemm: getattr(presets.get("mxfp4_all_h16"), gemm)}, name=name)


def _wgrad_only(name: str, *, dy: bool = True, x: bool = True,
                hadamard: Hadamard | None = None) -> PrecisionPolicy:
    """fprop and dgrad pass-through; wgrad's dY (lhs) and X (rhs) in ``mxfp4_all``'s MXFP4
    (EVEN, nearest-even) where asked, else pass-through; `hadamard` on both wgrad operands."""
    passthrough = presets.get("passthrough")
    mx, pt = presets.get("mxfp4_all").wgrad.lhs, passthrough.wgrad.lhs
    wgrad = GemmRecipe(lhs=mx if dy else pt, rhs=mx if x else pt, hadamard=hadamard)
    return PrecisionPolicy(fprop=passthrough.fprop, dgrad=passthrough.dgrad, wgrad=wgrad,
                           name=name)


def mxfp4_all_h16_fprop() -> PrecisionPolicy:
    """Ablation: MXFP4 in all three GEMMs, deterministic H16 on fprop only.

    fprop (X, W): fixed H16 along K, then MXFP4. dgrad (dY, W) and wgrad (dY, X):
    MXFP4, no Hadamard. EVEN scales, nearest-even throughout. Deterministic.
    """
    return _h16_on("fprop", "mxfp4_all_h16_fprop")


def mxfp4_all_h16_dgrad() -> PrecisionPolicy:
    """Ablation: MXFP4 in all three GEMMs, deterministic H16 on dgrad only.

    dgrad (dY, W): fixed H16 along N, then MXFP4. fprop (X, W) and wgrad (dY, X):
    MXFP4, no Hadamard. EVEN scales, nearest-even throughout. Deterministic.
    """
    return _h16_on("dgrad", "mxfp4_all_h16_dgrad")


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


# The study's own ablation presets, by name.
ABLATION_PRESETS: Mapping[str, Callable[[], PrecisionPolicy]] = types.MappingProxyType({
    f.__name__: f for f in (
        mxfp4_all_h16_fprop, mxfp4_all_h16_dgrad, mxfp4_wgrad_only, mxfp4_wgrad_only_h16,
        mxfp4_wgrad_only_rht16, mxfp4_wgrad_only_h32, mxfp4_wgrad_only_dy,
        mxfp4_wgrad_only_dy_h16, mxfp4_wgrad_only_x, mxfp4_wgrad_only_x_h16,
        passthrough_wgrad_h16,
    )
})

# Every preset the study knows by name: the library's, then its ablations.
PRESETS: Mapping[str, Callable[[], PrecisionPolicy]] = types.MappingProxyType(
    {**presets.PRESETS, **ABLATION_PRESETS})

# The ablations, in the order the study reports: each changes one thing (a GEMM, an
# operand, a rotation) of a rung.
ABLATIONS: tuple[str, ...] = (
    "mxfp4_all_h16_fprop", "mxfp4_all_h16_dgrad", "mxfp4_all_h16_wgrad",
    "mxfp4_wgrad_only", "mxfp4_wgrad_only_h16", "mxfp4_wgrad_only_rht16", "mxfp4_wgrad_only_h32",
    "mxfp4_wgrad_only_dy", "mxfp4_wgrad_only_dy_h16", "mxfp4_wgrad_only_x",
    "mxfp4_wgrad_only_x_h16", "passthrough_wgrad_h16",
)

# The study's former names of its ablations -> their names now (study presets).
LEGACY: Mapping[str, str] = types.MappingProxyType({
    "h16_fprop_only": "mxfp4_all_h16_fprop",
    "h16_dgrad_only": "mxfp4_all_h16_dgrad",
    "wgrad_mx": "mxfp4_wgrad_only",
    "wgrad_mx_h16": "mxfp4_wgrad_only_h16",
    "wgrad_mx_rht16": "mxfp4_wgrad_only_rht16",
    "wgrad_mx_h32": "mxfp4_wgrad_only_h32",
    "wgrad_dy": "mxfp4_wgrad_only_dy",
    "wgrad_dy_h16": "mxfp4_wgrad_only_dy_h16",
    "wgrad_x": "mxfp4_wgrad_only_x",
    "wgrad_x_h16": "mxfp4_wgrad_only_x_h16",
    "wgrad_rot16": "passthrough_wgrad_h16",
})


def canonical_name(name: str, *, stacklevel: int = 2) -> str:
    """`name`, or the name a former study name or deprecated preset name became (with a
    DeprecationWarning naming it); other names unchanged."""
    if name in LEGACY:
        warnings.warn(f"study policy {name!r} is now {LEGACY[name]!r}; "
                      "use that name", DeprecationWarning, stacklevel=stacklevel + 1)
        return LEGACY[name]
    return presets.canonical_name(name, stacklevel=stacklevel + 1)


def names() -> tuple[str, ...]:
    """Every policy name the study knows: ``none``, the library's presets and the study's
    ablations."""
    return ("none",) + tuple(PRESETS)


def get(name: str, custom: Mapping[str, Any] | None = None) -> PrecisionPolicy | None:
    """The policy called `name` (None for ``none``, the exact reference).

    Args:
      name: ``none``, a preset name, or a key of `custom`.
      custom: a study config's inline policies (``StudyConfig.custom_policies``:
        name -> policy dict).
    Raises:
      ValueError: unknown name (the message lists the valid ones).
    """
    if custom and name in custom:
        return presets.resolve(custom[name])
    try:
        current = canonical_name(name, stacklevel=2)
        base, at, backend = current.partition("@")
        if base in ABLATION_PRESETS:
            policy = ABLATION_PRESETS[base]()
            return policy.with_backend(backend) if at else policy
        return presets.resolve(current)
    except ValueError:
        valid = names() + tuple(custom or ())
        raise ValueError(f"policy: unknown study policy {name!r}; valid: "
                         f"{', '.join(valid)}") from None


def describe(name: str, custom: Mapping[str, Any] | None = None) -> str:
    """One line on what `name` quantizes."""
    if custom and name in custom:
        return "a policy defined in the study config (custom_policies)"
    if name == "none":
        return "exact (fp32, no policy)"
    doc = (PRESETS[name].__doc__ or "").strip().splitlines()
    return doc[0] if doc else name
