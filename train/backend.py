"""The config's ``backend`` applied to a run's policies, and what each GEMM resolved to.

``backend: auto`` (the default) puts every quantized GEMM that a policy leaves on the
library's default route (``'xla'``, the emulation) and whose backend the config's policy
entry does not name (``name@backend``, a dict GEMM's ``backend:``) on the fastest exact
route of the chip compiled for (`mxjax.backends.AUTO_CHOICES`); the policy keeps its
name. Any other backend puts every quantized GEMM on it, named ``<policy>@<backend>``.
A backend that gives no speed-up on the chip is refused (`check_speedup`): training is
the one place a route's only point is speed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mxjax import PrecisionPolicy
from mxjax.backends import Capabilities, capabilities, chip_name, no_speedup_reason
from mxjax.recipes import GEMMS
from train.config import ConfigError

__all__ = ["apply_backend", "check_speedup", "describe_routes", "route_record",
           "stated_backends"]


def stated_backends(spec: Any) -> frozenset[str]:
    """The GEMMs whose backend a config's policy entry names: all three for a
    ``name@backend`` string or a PrecisionPolicy, those with a ``backend`` key in a dict."""
    if isinstance(spec, str):
        return frozenset(GEMMS) if "@" in spec else frozenset()
    if isinstance(spec, Mapping):
        return frozenset(g for g in GEMMS
                         if isinstance(spec.get(g), Mapping) and "backend" in spec[g])
    return frozenset(GEMMS) if isinstance(spec, PrecisionPolicy) else frozenset()


def apply_backend(policy: PrecisionPolicy | None, backend: str | None,
                  stated: frozenset[str] = frozenset()) -> PrecisionPolicy | None:
    """`policy` under the config's `backend` (module docstring); ``stated``: the GEMMs whose
    backend the policy entry names (`stated_backends`), which 'auto' leaves alone. A bad
    name is a ConfigError."""
    if policy is None or backend is None:
        return policy
    if backend != "auto":
        try:
            return policy.with_backend(backend)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    gemms = {g: dataclasses.replace(r, backend="auto")
             for g, r in policy.gemms.items()
             if g not in stated and not r.is_passthrough and r.backend == "xla"}
    return dataclasses.replace(policy, **gemms) if gemms else policy


def check_speedup(policy: PrecisionPolicy, *, caps: Capabilities | None = None) -> None:
    """ConfigError unless every quantized GEMM's explicit backend gives a speed-up on the
    chip compiled for, or the chip of ``caps`` (`mxjax.backends.no_speedup_reason`: e.g.
    'xla_fp4' on a CPU runs XLA:CPU's expansion of its dot, slower than the emulation with
    the same values)."""
    for gemm, recipe in policy.gemms.items():
        if recipe.is_passthrough:
            continue
        why = no_speedup_reason(recipe.backend, recipe.lhs.fmt, recipe.rhs.fmt,
                                caps=caps, where=f"policy.{gemm}.backend")
        if why:
            raise ConfigError(why)


def route_record(policy: PrecisionPolicy | None, backend: str | None, *,
                 caps: Capabilities | None = None) -> dict[str, Any]:
    """What each GEMM of the run's policy runs on, on the chip compiled for (or the chip of
    ``caps``, `mxjax.backends.capabilities_for`), for the log, summary.json and ``--check``:
    ``{'chip', 'backend' (the config's), 'fprop', 'dgrad', 'wgrad'}`` (each a route name or
    'passthrough'; every projection of every layer takes the policy's three GEMMs). Without
    a policy every GEMM is 'passthrough'."""
    if policy is None:
        routes = {"chip": chip_name(capabilities() if caps is None else caps),
                  **dict.fromkeys(GEMMS, "passthrough")}
    else:
        routes = policy.routes(caps=caps)
    return {"chip": routes.pop("chip"), "backend": backend, **routes}


def describe_routes(record: Mapping[str, Any]) -> str:
    """One log line's worth: 'fprop xla_fp4, dgrad xla_fp4, wgrad xla_fp4 on NVIDIA B200
    (backend auto)'."""
    gemms = ", ".join(f"{g} {record[g]}" for g in GEMMS)
    return f"{gemms} on {record['chip']} (backend {record['backend']})"
