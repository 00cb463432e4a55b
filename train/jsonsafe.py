"""One conversion of run values (configs, policies, metrics) to plain JSON/YAML data."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any


def jsonable(x: Any, *, nonfinite_as_str: bool = False) -> Any:
    """Plain nested dicts/lists/scalars for `x`.

    Dataclass instances become dicts of their fields, mappings dicts with str
    keys, tuples/lists lists, enums their value, numpy/jax scalars and arrays
    Python numbers and lists; other objects (dtypes, formats) their ``str``.
    With ``nonfinite_as_str`` NaN/Inf floats become 'nan'/'inf'/'-inf', which
    keeps a record strict JSON (metrics and MLPerf logs); YAML and the
    checkpoint's metadata keep them as floats.
    """
    def go(v: Any) -> Any:
        if isinstance(v, bool) or v is None or isinstance(v, (str, int)):
            return v
        if isinstance(v, float):
            if nonfinite_as_str and not math.isfinite(v):
                return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
            return v
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: go(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, Mapping):
            return {str(k): go(e) for k, e in v.items()}
        if isinstance(v, (list, tuple)):
            return [go(e) for e in v]
        if isinstance(v, type):
            return str(v)
        if isinstance(v, enum.Enum):
            return go(v.value)
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # numpy / jax scalars
            return go(v.item())
        if hasattr(v, "tolist"):
            return go(v.tolist())
        return str(v)

    return go(x)
