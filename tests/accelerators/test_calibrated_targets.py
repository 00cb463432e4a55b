"""Issue 47's 8B-layer targets on the calibrated model (bench/costmodel/calibrated.py), from
deviceless compiles of today's code, and issue 48's block formats on it. None is met today
(docs/PERFORMANCE.md shows where the time goes); these tests check what the rows say: each
GPU row carries the calibrated time and its per-class table, the peak roofline stays an
upper bound on speed, every figure recorded in mxjax/measurements.json is what the model
gives, and the verdict reports every target (a met one is asserted by moving it to MET)."""

from __future__ import annotations

import dataclasses

import pytest

from bench.costmodel.targets import CALIBRATED_BOUNDS, calibrated_ratios, calibrated_verdict
from mxjax import measurements
from tests.accelerators.conftest import cost

pytestmark = pytest.mark.accelerators

FUSED = "fused"
MXFP4 = "mxfp4_all_h16@auto"
# The route 'auto' compiles to on each chip (test_backends_per_chip.py checks that 'auto'
# and the route compile to the same program): compiled by name, shared with the other tests.
AUTO_ROUTE = {"h200": "xla_fp8", "b200": "xla_fp4"}
MET: list[tuple[str, str, str, str]] = []  # keys of CALIBRATED_BOUNDS met today: none
# Recorded figures may drift this much before the data file must be rewritten.
RECORDED = 0.03


def _row(target, policy):
    if policy == MXFP4:
        route = cost(target, "layer_8b", f"mxfp4_all_h16@{AUTO_ROUTE[target]}",
                     attention=FUSED)
        return dataclasses.replace(route, policy=MXFP4)
    return cost(target, "layer_8b", policy, attention=FUSED)


def _rows(target):
    return [_row(target, p) for p in ("bf16", "fp8", MXFP4)]


@pytest.mark.parametrize("target", ["h200", "b200"])
def test_gpu_rows_carry_the_calibrated_time_above_the_peak_roofline(target):
    for row in _rows(target):
        by_class = {c: (n, t) for c, n, t in row.calibrated_by_class}
        print(f"{target} {row.policy}: calibrated {row.calibrated_s * 1e3:.2f} ms, peak "
              f"roofline {row.rates_s * 1e3:.2f} ms; {by_class}")
        assert row.calibrated_s > row.rates_s > 0
        assert sum(t for _, t in by_class.values()) == pytest.approx(row.calibrated_s)
        assert sum(n for n, _ in by_class.values()) == row.n_kernels


@pytest.mark.parametrize("target,policies", [
    ("h200", ("bf16", "fp8", MXFP4)),
    ("b200", ("bf16", "fp8", MXFP4, "nvfp4@auto", "mxfp8@auto")),
])
def test_the_recorded_calibrated_figures_are_the_models(target, policies):
    """mxjax/measurements.json's layer_8b.<chip>.calibrated (what README, PERFORMANCE.md and
    AUTO_CHOICES quote) is what the calibrated model gives today's code."""
    fig = measurements.figure(f"layer_8b.{target}.calibrated")
    for policy in policies:
        ms = _row(target, policy).calibrated_s * 1e3
        print(f"{target} {policy}: calibrated {ms:.2f} ms, recorded {fig.value(policy)}")
        assert ms == pytest.approx(fig.value(policy), rel=RECORDED), (policy, ms)


def test_the_verdict_reports_each_target_and_asserts_the_met_ones():
    costs = _rows("h200") + _rows("b200")
    text = calibrated_verdict(costs)
    print(text)
    ratios = calibrated_ratios(costs)
    assert {key for key, _, _ in ratios} == set(CALIBRATED_BOUNDS)
    for key, bound, ratio in ratios:
        assert ratio is not None, key  # every row compiled here
        assert f"{key[0]} layer_8b {key[2]} vs {key[3]} {ratio:.2f}x (<= {bound}x)" in text
        if key in MET:
            assert ratio <= bound, (key, ratio)
        else:  # a target met since: move it to MET
            assert ratio > bound, (key, ratio, "met now: add it to MET")
    assert ("NOT met" in text) == (len(MET) < len(CALIBRATED_BOUNDS))
