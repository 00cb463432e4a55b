"""Deviceless B200 compiles: the one-pass NVFP4 and MXFP8 operand kernels in the train step.

The 4096^3 matmul's train step (forward and both backward GEMMs) under ``nvfp4@auto`` and
``mxfp8@auto``: every GEMM is ``__cudnn$blockScaledDot`` on the format's operands, none a
bf16 GEMM, and the operands the kernels take come from them:

* MXFP8: each operand (X, W, dY) is one kernel call writing both directions (the two
  GEMMs that read it make the same call, which XLA merges), rounding by PTX's
  ``cvt.rn.satfinite.e4m3x2.f32``;
* NVFP4: W by one pair kernel (fprop and dgrad quantize it alike), X by two single ones
  (fprop without rotation, wgrad with the fixed-sign H16), dY by two more (stochastically
  rounded in both of its GEMMs, each with its GEMM's key words as an input: the draws are
  made inside), each dividing by PTX's ``div.rn.f32``.
"""

from __future__ import annotations

import collections
import functools
import re

import pytest

from tests.accelerators.conftest import require

pytestmark = pytest.mark.accelerators

CUDNN = "__cudnn$blockScaledDot"
OPERANDS = {"nvfp4": ("f4e2m1fn", "f4e2m1fn"), "mxfp8": ("f8e4m3fn", "f8e4m3fn")}


@functools.cache
def _text(policy: str) -> str:
    from bench.costmodel import aot
    from bench.costmodel.programs import program as build

    fn, args = build("matmul", policy)
    return aot.compile_for(fn, args, require("b200")).as_text()


def _gemms(policy: str) -> collections.Counter:
    from bench.costmodel import hlo_kernels as hk

    return collections.Counter((how, types) for _, how, types, _ in
                               hk.gemm_operand_types(_text(policy)))


def _kernel_calls(text: str, name: str):
    """(outputs, line) of each Pallas call whose Triton module is the kernel `name`."""
    calls = []
    for line in text.splitlines():
        m = re.search(r"%pallas_call[.0-9]* = \(([^)]*)\) custom-call\(", line)
        if m and name in line:
            calls.append((m.group(1), line))
    return calls


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_the_matmuls_gemms_are_block_scaled_on_b200(fmt):
    gemms = _gemms(f"{fmt}@auto")
    assert gemms == {(CUDNN, OPERANDS[fmt]): 3}, gemms
    assert not [g for g in gemms if "bf16" in g[1]], gemms


def test_mxfp8_auto_reads_each_operand_once_by_the_kernel_with_ptx_cvt():
    calls = _kernel_calls(_text("mxfp8@auto"), "mxfp8_operand")
    assert len(calls) == 3, [outs for outs, _ in calls]  # X, W, dY
    # Both directions: row-wise codes and scales, column-wise codes and scales.
    assert all(len(outs.split("]{")) == 5 for outs, _ in calls), calls
    assert {outs.count("u8[4096,4096]") for outs, _ in calls} == {2}, calls
    assert all("cvt.rn.satfinite.e4m3x2.f32" in line for _, line in calls)


def test_nvfp4_operands_by_the_kernel_with_a_correctly_rounded_division():
    calls = _kernel_calls(_text("nvfp4@auto"), "nvfp4_operand")
    directions = sorted(len(outs.split("]{")) // 2 for outs, _ in calls)
    assert directions == [1, 1, 1, 1, 2], [outs for outs, _ in calls]
    assert all("div.rn.f32" in line for _, line in calls)
    # dY's two calls take key words and the origin (u32[4]); W's and X's none.
    assert sum("u32[4]" in line for _, line in calls) == 2, [o for o, _ in calls]
