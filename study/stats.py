"""The statistics of the ladder study: equivalent steps, efficiencies, intervals.

Pure NumPy on plain floats; every function is tested against hand-worked cases
(tests/study/test_study_stats.py).

Branch-and-compare. From one reference state, the exact branch gives a curve
of held-out loss decrease ``D(k)`` after ``k`` exact steps (evaluated on a
grid); a policy's branch of ``K`` steps on the same batches and keys decreases
the loss by ``d``. Its *equivalent exact steps* are the ``k`` where the exact
curve first reaches ``d`` (linear interpolation between grid points), its
*efficiency* is ``k / K`` and its *token overhead* ``1 / efficiency - 1``: the
extra tokens it needs for the progress the exact recipe makes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats as scipy_stats

__all__ = [
    "Crossing",
    "Interval",
    "crossing_step",
    "efficiency",
    "log_overhead",
    "mean_interval",
    "paired_interval",
    "steps_to_reach",
    "t_quantile",
]


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df: expected >= 1, got {df}")
    return float(scipy_stats.t.ppf(p, df))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Interval:
    """A mean with its two-sided confidence interval (t interval over `n` units)."""

    mean: float
    low: float
    high: float
    n: int
    sd: float
    level: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def excludes(self, value: float) -> bool:
        """True when the interval lies entirely on one side of `value`."""
        return self.low > value or self.high < value


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """t interval for the mean of independent `values` (n >= 2; NaN if fewer or non-finite)."""
    v = np.asarray(values, dtype=np.float64)
    n = int(v.size)
    if n == 0 or not np.all(np.isfinite(v)):
        m = float(np.mean(v)) if n else math.nan
        return Interval(mean=m, low=math.nan, high=math.nan, n=n, sd=math.nan, level=level)
    m = float(v.mean())
    if n < 2:
        return Interval(mean=m, low=math.nan, high=math.nan, n=n, sd=math.nan, level=level)
    sd = float(v.std(ddof=1))
    h = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return Interval(mean=m, low=m - h, high=m + h, n=n, sd=sd, level=level)


def paired_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Interval:
    """t interval for mean(a - b) over pairs (a[i], b[i]) (e.g. the same seed)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired_interval: a and b must pair up, got shapes {a.shape} and "
                         f"{b.shape}")
    return mean_interval(a - b, level)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Crossing:
    """Where a decrease `d` falls on a curve: ``step`` (interpolated) and whether it is censored.

    censored: 'above' when the curve never reaches `d` on its grid (step is the
    last grid point, a lower bound), 'below' when `d` <= the curve's first value
    (step is the first grid point, an upper bound), '' otherwise.
    """

    step: float
    censored: str = ""


def crossing_step(steps: Sequence[float], curve: Sequence[float], value: float) -> Crossing:
    """The first step at which a piecewise-linear `curve` over `steps` reaches `value`.

    `steps` must increase strictly. The curve need not be monotone: the first
    segment that reaches `value` is used (interpolated linearly inside it).
    """
    s = np.asarray(steps, np.float64)
    c = np.asarray(curve, np.float64)
    if s.ndim != 1 or s.shape != c.shape or s.size < 2:
        raise ValueError(f"crossing_step: steps and curve must be 1-D of equal length >= 2, got "
                         f"{s.shape} and {c.shape}")
    if not np.all(np.diff(s) > 0):
        raise ValueError(f"crossing_step: steps must increase strictly, got {s.tolist()}")
    if not (math.isfinite(value) and np.all(np.isfinite(c))):
        return Crossing(step=math.nan, censored="nonfinite")
    if value <= c[0]:
        return Crossing(step=float(s[0]), censored="below")
    for i in range(1, s.size):
        if c[i] >= value:
            frac = (value - c[i - 1]) / (c[i] - c[i - 1])
            return Crossing(step=float(s[i - 1] + frac * (s[i] - s[i - 1])))
    return Crossing(step=float(s[-1]), censored="above")


def efficiency(exact_steps: Sequence[float], exact_decrease: Sequence[float],
               policy_decrease: float, policy_steps: int) -> tuple[float, str]:
    """(equivalent exact steps / policy_steps, censoring) for one branch.

    ``exact_decrease`` is the exact branch's loss decrease at ``exact_steps``
    (starting with 0 at step 0). A policy whose branch made no progress gets
    efficiency 0 (censored 'below'); one beyond the exact curve's grid gets the
    grid's end (censored 'above', a lower bound).
    """
    if policy_steps < 1:
        raise ValueError(f"policy_steps: expected >= 1, got {policy_steps}")
    c = crossing_step(exact_steps, exact_decrease, policy_decrease)
    return c.step / policy_steps, c.censored


def log_overhead(numerator_eff: Sequence[float], policy_eff: Sequence[float],
                 level: float = 0.95) -> tuple[Interval, tuple[float, float, float]]:
    """A policy's token overhead against a reference, from paired efficiencies.

    Per pair, ``log(numerator_eff / policy_eff)`` is the log of the tokens the
    policy needs per token of the reference (use 1.0 as the numerator for the
    exact recipe); its t interval over pairs, exponentiated minus one, gives
    ``(overhead, low, high)`` as fractions (a geometric-mean overhead). Pairs
    with a non-positive efficiency have no finite log and make the interval NaN.
    """
    num = np.asarray(numerator_eff, np.float64)
    pol = np.asarray(policy_eff, np.float64)
    if num.shape != pol.shape:
        raise ValueError(f"log_overhead: efficiencies must pair up, got {num.shape} and "
                         f"{pol.shape}")
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where((num > 0) & (pol > 0), np.log(num / np.where(pol > 0, pol, 1.0)), np.nan)
    iv = mean_interval(logs, level)
    return iv, (math.expm1(iv.mean), math.expm1(iv.low), math.expm1(iv.high))


def steps_to_reach(steps: Sequence[float], losses: Sequence[float], loss: float) -> Crossing:
    """Where a (decreasing) loss curve first comes down to `loss` (see `crossing_step`)."""
    c = np.asarray(losses, np.float64)
    return crossing_step(steps, c[0] - c, float(c[0] - loss))
