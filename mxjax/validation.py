"""Validation helpers for plain-dict configuration (YAML/JSON loaded into mappings)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["check_keys"]


def check_keys(d: Any, allowed: Iterable[str], required: Iterable[str] = (), *, where: str,
               error: type[Exception] = ValueError) -> Mapping[str, Any]:
    """Checks that `d` is a mapping whose keys are among `allowed` and include `required`.

    Args:
      d: the value to check.
      allowed: the valid keys.
      required: the keys that must be present.
      where: what `d` is, for the message (e.g. ``'fprop.lhs'``).
      error: the exception raised for unknown or missing keys (a ValueError
        subclass such as a config error type).
    Returns:
      `d`, unchanged.
    Raises:
      TypeError: `d` is not a mapping.
      error: unknown keys (the message lists them and the valid ones), or missing
        required keys.
    """
    if not isinstance(d, Mapping):
        raise TypeError(f"{where}: expected a mapping, got {d!r}")
    allowed, required = set(allowed), set(required)
    unknown = set(map(str, d)) - allowed
    if unknown:
        raise error(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    missing = required - set(d)
    if missing:
        raise error(f"{where}: missing keys {sorted(missing)}")
    return d
