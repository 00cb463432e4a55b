"""Looking a policy up: by preset name (optionally ``name@backend``), dict or value.

:func:`resolve` is the one place a policy spec becomes a policy; :func:`get`,
:func:`to_dict` / :func:`from_dict` on names and :func:`dot_general` go through it.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import jax

from mxjax import interceptor
from mxjax.policies import dict_form
from mxjax.policies.aliases import canonical_name
from mxjax.policies.policy import PrecisionPolicy
from mxjax.policies.presets import PRESETS, names

__all__ = ["dot_general", "from_dict", "get", "resolve", "to_dict"]


def _valid_names(with_none: bool) -> str:
    return ", ".join((("none",) if with_none else ()) + names())


def _unknown(spec: Any, with_none: bool) -> ValueError:
    """The one-paragraph error for an unknown preset name: the closest names first."""
    shown = repr(spec) if len(repr(spec)) <= 60 else repr(spec)[:56] + "...'"
    name, at, backend = spec.partition("@") if isinstance(spec, str) else ("", "", "")
    known = (("none",) if with_none and not at else ()) + names()
    close = difflib.get_close_matches(name.lower(), known, n=2, cutoff=0.6)
    if close:
        guess = " or ".join(repr(f"{c}{at}{backend}") for c in close)
        return ValueError(f"policy: unknown preset {shown}; did you mean {guess}? (every "
                          "preset: mxjax.policies.names(), python -m train --list-policies)")
    return ValueError(f"policy: unknown preset {shown}; valid names: "
                      f"{_valid_names(with_none)} (each optionally as '<name>@<backend>')")


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
    raise _unknown(name, with_none=False)


def _preset(spec: str, *, stacklevel: int) -> PrecisionPolicy | None:
    """The preset `spec` names ('<name>' or '<name>@<backend>'), or None if unknown."""
    name, at, backend = spec.partition("@")
    name = canonical_name(name, stacklevel=stacklevel)
    if name not in PRESETS:
        return None
    policy = PRESETS[name]()
    if not at:
        return policy
    try:
        return policy.with_backend(backend)
    except ValueError as e:  # the message names the whole spec, not just 'backend'
        raise ValueError(f"policy {spec!r}: {e}") from None


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
        raise _unknown(spec, with_none=True)
    if isinstance(spec, Mapping):
        return dict_form.from_dict(spec)
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


def to_dict(policy: PrecisionPolicy | str) -> dict[str, Any]:
    """A plain dict (str/bool/int/None leaves) that :func:`from_dict` turns back into
    `policy` (a PrecisionPolicy or a preset name)."""
    return dict_form.to_dict(get(policy))


def from_dict(d: Mapping[str, Any] | str) -> PrecisionPolicy:
    """A PrecisionPolicy from `to_dict`'s layout (`mxjax.policies.dict_form.from_dict`) or
    a preset name."""
    return get(d) if isinstance(d, str) else dict_form.from_dict(d)
