"""bench.training.carrier_windows: the span of block scales each route's carrier must
hold, and the spans of a real training step's operands."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from bench.training import carrier_windows as cw
from mxjax.operand_recipe import OperandRecipe


def test_operand_span_against_the_block_exponents():
    op = OperandRecipe(fmt=mxjax.MXFP4)
    x = np.zeros((2, 96), np.float32)
    x[0, :32] = 1.0           # block exponent floor(log2 1) - 2 = -2
    x[0, 32:64] = 2.0**10     # 8
    x[1, :32] = 2.0**-20      # -22; the other blocks are zero: not live
    assert int(cw.operand_span(jnp.asarray(x), op, None)) == 8 - (-22)
    assert int(cw.operand_span(jnp.zeros((2, 64)), op, None)) == -1
    x[1, 70] = np.nan
    assert int(cw.operand_span(jnp.asarray(x), op, None)) == 1000
    # The windows docs/NUMERICS.md states, from the routes' carriers.
    assert cw.WINDOWS == {"xla_fp8": (28, 14), "xla_fp4": (17, 17)}


def test_report_counts_each_side_and_the_gemms_each_route_carries():
    spans = [(0, "fprop", 10, 10), (0, "dgrad", 20, 15), (2, "fprop", 30, 1)]
    lines = cw.report_lines(spans, "mxfp4_all_h16", 2, 2)
    assert lines[0].startswith("policy mxfp4_all_h16, tiny Llama, steps 0..2 every 2: "
                               "3 quantized GEMMs")
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in lines[2:-2]}
    assert rows[("fprop", "lhs")][:4] == ["2", "10", "20", "30"]  # n, min, median, max
    assert rows[("dgrad", "rhs")][4:] == ["0.0%", "100.0%"]  # 15 > 14 (E4M3), <= 17
    assert lines[-2] == "xla_fp8: 33.3% of 3 GEMMs carried (the rest take the emulation)"
    assert lines[-1] == "xla_fp4: 33.3% of 3 GEMMs carried (the rest take the emulation)"


@pytest.mark.slow  # trains the tiny config two steps and traces its step twice
def test_a_training_step_is_observed_at_every_quantized_gemm():
    spans = cw.observe_spans("mxfp4_all_h16", steps=2, every=2)
    assert {s for s, *_ in spans} == {0, 2}
    assert {g for _, g, _, _ in spans} == {"fprop", "dgrad", "wgrad"}
    assert all(0 <= a < 1000 and 0 <= b < 1000 for *_, a, b in spans), spans
    assert len([s for s in spans if s[0] == 0]) == len([s for s in spans if s[0] == 2])
