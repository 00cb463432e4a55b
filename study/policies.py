"""The policies of the ladder study: the paper's rungs and the ablations that locate an effect.

Rungs and ablations are presets of ``mxjax.policies`` (the ablations are the
library's ``mxfp4_all_h16_<gemm>`` and ``mxfp4_wgrad_only*`` presets and the
``passthrough_wgrad_h16`` control): each changes one thing against a rung, so a
difference in training can be pinned on one GEMM, one operand, or the rotation
itself. A study config may also define its own policies inline (a policy dict or
a PrecisionPolicy where a name goes: ``study.config``); `get` takes those as
``custom`` (name -> policy dict).

The study's former private names (``wgrad_mx_h16``, ``h16_fprop_only``, ...) are
still read, with a DeprecationWarning naming the library preset (:data:`LEGACY`).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Mapping
from typing import Any

from mxjax import PrecisionPolicy
from mxjax import policies as presets

# The paper's Table 1, in reading order (fp8 is its baseline).
RUNGS: tuple[str, ...] = ("fp8", "mxfp4_fprop", "mxfp4_fprop_dgrad", "mxfp4_all",
                          "mxfp4_all_sr", "mxfp4_all_rht16", "mxfp4_all_h16", "mxfp4_all_h32")

# The ablations: library presets (mxjax.policies.ABLATIONS), in the order the study reports.
ABLATIONS: tuple[str, ...] = presets.ABLATIONS

# The study's former names of its ablations -> the library presets they became.
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
    """`name`, or the library preset a former study name or deprecated preset name became
    (with a DeprecationWarning naming it); other names unchanged."""
    if name in LEGACY:
        warnings.warn(f"study policy {name!r} is now the library preset {LEGACY[name]!r}; "
                      "use that name", DeprecationWarning, stacklevel=stacklevel + 1)
        return LEGACY[name]
    return presets.canonical_name(name, stacklevel=stacklevel + 1)


def names() -> tuple[str, ...]:
    """Every policy name the study knows: ``none`` and the library's presets."""
    return ("none",) + presets.names()


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
        return presets.resolve(canonical_name(name, stacklevel=2))
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
    doc = (presets.PRESETS[name].__doc__ or "").strip().splitlines()
    return doc[0] if doc else name
