"""Training dynamics: per-layer gradient norms, collapse rate, update size, instability.

Jit-friendly pytree reductions used inside the step, and host-side summaries:
per-layer gradient norms (:func:`layer_norms`), gradient-collapse rate
(:func:`collapse_rate`, layers
with grad norm < 1e-6), weight-update size relative to the weight
(:func:`relative_update`), and the instability detector
(:class:`InstabilityDetector`, a pure state machine driven from the host).
Moved here from ``mxjax.diagnostics``, which keeps the per-GEMM statistics.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mxjax.diagnostics import safe_ratio

__all__ = [
    "InstabilityConfig",
    "InstabilityDetector",
    "InstabilityState",
    "collapse_rate",
    "expand_layers",
    "layer_norms",
    "relative_update",
]


def _path_name(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def layer_norms(tree: Any, *, stacked: Sequence[str] = ("layers",)) -> dict[str, jax.Array]:
    """L2 norm of every leaf of a pytree (e.g. gradients), per layer for stacked leaves.

    A "layer" is one weight tensor of one block: a leaf whose dotted path starts
    with a name in ``stacked`` holds one tensor per block along axis 0 and gets
    a norm per block (f32[L]); every other leaf one norm (f32 scalar).
    Jit-friendly (returns device arrays); see :func:`expand_layers` for names.
    """
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = _path_name(path)
        x = jnp.asarray(leaf).astype(jnp.float32)
        if name.split(".")[0] in stacked and x.ndim >= 1:
            out[name] = jnp.sqrt(jnp.sum(jnp.square(x.reshape(x.shape[0], -1)), axis=1))
        else:
            out[name] = jnp.sqrt(jnp.sum(jnp.square(x)))
    return out


def expand_layers(norms: Mapping[str, Any]) -> dict[str, float]:
    """Host side: ``{"layers.q.kernel": [a, b]}`` -> ``{"layers.0.q.kernel": a, ...}``."""
    out = {}
    for name, v in norms.items():
        arr = np.asarray(v, dtype=np.float64)
        if arr.ndim == 0:
            out[name] = float(arr)
            continue
        head, _, rest = name.partition(".")
        for i, val in enumerate(arr.ravel()):
            out[f"{head}.{i}.{rest}" if rest else f"{head}.{i}"] = float(val)
    return out


def collapse_rate(norms: Mapping[str, Any] | Sequence[float] | np.ndarray,
                  threshold: float = 1e-6) -> float:
    """Fraction of layers whose gradient L2 norm is below ``threshold`` (NaN counts as not)."""
    if isinstance(norms, Mapping):
        vals = np.asarray(list(expand_layers(norms).values()), dtype=np.float64)
    else:
        vals = np.asarray(norms, dtype=np.float64).ravel()
    if vals.size == 0:
        raise ValueError("norms: no layers given")
    return float(np.mean(vals < threshold))


def relative_update(old: Any, new: Any, *, stacked: Sequence[str] = ("layers",)
                    ) -> dict[str, jax.Array]:
    """Per layer ``‖new − old‖₂ / ‖old‖₂`` (0 where ``old`` is all zero); jit-friendly."""
    diff = jax.tree.map(lambda a, b: jnp.asarray(b, jnp.float32) - jnp.asarray(a, jnp.float32),
                        old, new)
    dn = layer_norms(diff, stacked=stacked)
    on = layer_norms(old, stacked=stacked)
    return {k: safe_ratio(dn[k], on[k]) for k in dn}


@dataclasses.dataclass(frozen=True, kw_only=True)
class InstabilityConfig:
    """Thresholds of the instability detector.

    A step is **exploding** when its gradient norm ``g`` is non-finite or
    ``g > growth · m`` where ``m`` is the running minimum of the positive,
    finite gradient norms of all earlier steps (no earlier such step: never
    exploding). A step is **dead** when ``g <= zero_tol`` (exactly zero by
    default). The instability point is the first step of the first run of
    ``growth_steps`` consecutive exploding steps, or of ``zero_steps``
    consecutive dead steps, whichever completes first.
    """

    growth: float = 100.0
    growth_steps: int = 5
    zero_steps: int = 10
    zero_tol: float = 0.0

    def __post_init__(self):
        if not self.growth > 1:
            raise ValueError(f"InstabilityConfig: growth must be > 1, got {self.growth!r}")
        for name in ("growth_steps", "zero_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"InstabilityConfig: {name} must be an int >= 1, got {v!r}")
        if not self.zero_tol >= 0:
            raise ValueError(f"InstabilityConfig: zero_tol must be >= 0, got {self.zero_tol!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class InstabilityState:
    """Detector state (immutable). ``event_step``/``event_kind`` once detected."""

    running_min: float = math.inf
    explode_start: int | None = None
    explode_len: int = 0
    zero_start: int | None = None
    zero_len: int = 0
    event_step: int | None = None
    event_kind: str | None = None  # 'grad_norm_growth' or 'zero_gradient'


class InstabilityDetector:
    """Pure state machine: ``state = det.update(state, step, grad_norm)``.

    Feed every training step in order (host side, plain floats). Once an event
    is detected the state keeps it (first event only). See
    :class:`InstabilityConfig` for the exact definition.
    """

    def __init__(self, config: InstabilityConfig | None = None):
        self.config = InstabilityConfig() if config is None else config

    @staticmethod
    def init() -> InstabilityState:
        return InstabilityState()

    def update(self, state: InstabilityState, step: int, grad_norm: float) -> InstabilityState:
        c = self.config
        g = float(grad_norm)
        finite = math.isfinite(g)
        exploding = (not finite) or (math.isfinite(state.running_min)
                                     and g > c.growth * state.running_min)
        dead = finite and g <= c.zero_tol
        if exploding:
            e_start = step if state.explode_len == 0 else state.explode_start
            e_len = state.explode_len + 1
        else:
            e_start, e_len = None, 0
        if dead:
            z_start = step if state.zero_len == 0 else state.zero_start
            z_len = state.zero_len + 1
        else:
            z_start, z_len = None, 0
        run_min = state.running_min
        if finite and g > 0:
            run_min = min(run_min, g)
        ev_step, ev_kind = state.event_step, state.event_kind
        if ev_step is None:
            if e_len >= c.growth_steps:
                ev_step, ev_kind = e_start, "grad_norm_growth"
            elif z_len >= c.zero_steps:
                ev_step, ev_kind = z_start, "zero_gradient"
        return InstabilityState(running_min=run_min, explode_start=e_start, explode_len=e_len,
                                zero_start=z_start, zero_len=z_len, event_step=ev_step,
                                event_kind=ev_kind)

    def run(self, grad_norms: Sequence[float], steps: Sequence[int] | None = None
            ) -> InstabilityState:
        """Feeds a whole series (steps default 0, 1, ...) and returns the final state."""
        steps = range(len(grad_norms)) if steps is None else steps
        state = self.init()
        for s, g in zip(steps, grad_norms, strict=True):
            state = self.update(state, int(s), g)
        return state
