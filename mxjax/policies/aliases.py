"""Former preset names: still accepted, with a DeprecationWarning naming the new one.

``bf16`` → ``passthrough`` (it never cast to bf16: an f32 model stays f32; to compute in
bf16 set the model's dtype), ``mxfp4_wgrad_h16`` → ``mxfp4_all_h16_wgrad``. The policy
an alias gives carries the new name.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Mapping

__all__ = ["ALIASES", "canonical_name"]

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
