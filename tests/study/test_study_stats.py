"""The ladder study's statistics: intervals, interpolation on a curve, efficiencies."""

from __future__ import annotations

import math

import numpy as np
import pytest

from study import stats as S


def test_mean_interval_matches_a_hand_computation():
    iv = S.mean_interval([1.0, 2.0, 3.0, 4.0])
    sd = math.sqrt(((1.5**2) * 2 + (0.5**2) * 2) / 3)  # 1.2910
    half = 3.182446305284263 * sd / 2  # t_{0.975, 3} (tables) x sd / sqrt(4)
    assert iv.mean == 2.5 and iv.n == 4
    assert iv.sd == pytest.approx(sd, rel=1e-12)
    assert (iv.low, iv.high) == pytest.approx((2.5 - half, 2.5 + half), rel=1e-9)
    assert iv.half_width == pytest.approx(half, rel=1e-9)
    assert iv.excludes(0.0) and not iv.excludes(2.0)


def test_t_quantile_known_values():
    assert S.t_quantile(0.975, 1) == pytest.approx(12.706204736, rel=1e-8)
    assert S.t_quantile(0.975, 7) == pytest.approx(2.364624252, rel=1e-8)
    with pytest.raises(ValueError, match="df"):
        S.t_quantile(0.975, 0)


@pytest.mark.parametrize("values", [[3.0], [], [1.0, math.nan], [1.0, math.inf]])
def test_mean_interval_without_an_interval_is_nan(values):
    iv = S.mean_interval(values)
    assert math.isnan(iv.low) and math.isnan(iv.high)
    assert not iv.excludes(0.0)


def test_constant_values_give_a_zero_width_interval():
    iv = S.mean_interval([0.25] * 5)
    assert (iv.low, iv.mean, iv.high) == (0.25, 0.25, 0.25)


def test_paired_interval_is_the_interval_of_differences():
    a, b = [1.0, 2.5, 2.0], [0.5, 2.0, 2.1]
    iv = S.paired_interval(a, b)
    ref = S.mean_interval(np.subtract(a, b))
    assert (iv.mean, iv.low, iv.high) == (ref.mean, ref.low, ref.high)
    with pytest.raises(ValueError, match="pair up"):
        S.paired_interval([1.0, 2.0], [1.0])


@pytest.mark.parametrize("value, step, censored", [
    (0.0, 0.0, "below"),       # nothing gained: the first grid point, an upper bound
    (-1.0, 0.0, "below"),
    (2.0, 2.0, ""),            # on a grid point
    (1.0, 1.0, ""),            # halfway through the first segment
    (3.0, 4.0, ""),
    (3.5, 5.0, ""),            # inside the last segment: (4, 3) -> (6, 4)
    (4.0, 6.0, ""),
    (4.5, 6.0, "above"),       # beyond the grid: its end, a lower bound
])
def test_crossing_step_interpolates_linearly(value, step, censored):
    steps = [0, 2, 4, 6]
    curve = [0.0, 2.0, 3.0, 4.0]
    c = S.crossing_step(steps, curve, value)
    assert c.step == pytest.approx(step) and c.censored == censored


def test_crossing_step_takes_the_first_segment_that_reaches_the_value():
    c = S.crossing_step([0, 1, 2, 3], [0.0, 2.0, 1.0, 3.0], 1.5)
    assert c.step == pytest.approx(0.75)


def test_crossing_step_rejects_bad_grids_and_flags_nonfinite():
    with pytest.raises(ValueError, match="increase strictly"):
        S.crossing_step([0, 2, 2], [0.0, 1.0, 2.0], 1.0)
    with pytest.raises(ValueError, match="equal length"):
        S.crossing_step([0, 1], [0.0], 1.0)
    assert S.crossing_step([0, 1], [0.0, math.nan], 0.5).censored == "nonfinite"
    assert S.crossing_step([0, 1], [0.0, 1.0], math.nan).censored == "nonfinite"


def test_efficiency_is_equivalent_exact_steps_over_branch_steps():
    steps, dec = [0, 6, 12, 18, 24], [0.0, 0.03, 0.05, 0.06, 0.07]
    assert S.efficiency(steps, dec, 0.05, 12) == (1.0, "")
    eff, cens = S.efficiency(steps, dec, 0.04, 12)  # halfway between 6 and 12 -> 9 steps
    assert eff == pytest.approx(0.75) and cens == ""
    assert S.efficiency(steps, dec, 0.08, 12) == (2.0, "above")
    assert S.efficiency(steps, dec, -0.01, 12) == (0.0, "below")
    with pytest.raises(ValueError, match="policy_steps"):
        S.efficiency(steps, dec, 0.05, 0)


def test_log_overhead_is_a_geometric_mean_with_a_log_interval():
    _, (oh, lo, hi) = S.log_overhead([1.0] * 4, [0.8] * 4)
    assert oh == pytest.approx(0.25) and lo == pytest.approx(0.25) and hi == pytest.approx(0.25)
    effs = [0.5, 1.0, 0.8, 0.9]
    _, (oh, lo, hi) = S.log_overhead([1.0] * 4, effs)
    logs = -np.log(effs)
    ref = S.mean_interval(logs)
    assert oh == pytest.approx(math.expm1(ref.mean))
    assert (lo, hi) == pytest.approx((math.expm1(ref.low), math.expm1(ref.high)))
    # Against a baseline of the same replicate: the ratio of efficiencies.
    _, (oh_b, _, _) = S.log_overhead([0.9, 0.9], [0.6, 0.6])
    assert oh_b == pytest.approx(0.5)
    # A replicate without progress has no finite log: the interval is NaN, not a number.
    _, (oh0, lo0, hi0) = S.log_overhead([1.0, 1.0], [0.0, 0.5])
    assert math.isnan(oh0) and math.isnan(lo0) and math.isnan(hi0)
    with pytest.raises(ValueError, match="pair up"):
        S.log_overhead([1.0], [0.5, 0.5])


def test_steps_to_reach_reads_a_decreasing_loss_curve():
    steps, losses = [0, 25, 50, 75], [7.0, 5.0, 4.5, 4.3]
    assert S.steps_to_reach(steps, losses, 4.75).step == pytest.approx(37.5)
    assert S.steps_to_reach(steps, losses, 4.3).step == pytest.approx(75.0)
    c = S.steps_to_reach(steps, losses, 4.2)  # better than the curve ever gets
    assert c.censored == "above" and c.step == 75.0
