"""The emulated MXFP4 GEMM compiled for an H200 without one: its
bytes, roofline and temp memory against bf16's.

Asserted for ``mxfp4_all_h16`` against plain bf16 compiled the same way: the bytes
of the fwd+bwd 4096^3 matmul at most 3x and of the 1B decoder layer's train step at
most 1.4x, its roofline step time at most 1.3x and its peak temp memory at most
1.25x; per quantized operand at most two passes over operand-sized data before the
GEMM (the amax reduction and the rounding pass: the GPU form, mxjax/emulation/in_place.py),
bf16 GEMM operands, and the platform branch resolved (no conditional left).
"""

from __future__ import annotations

import re

import pytest

from tests.accelerators.conftest import cost, optimized_hlo

pytestmark = pytest.mark.accelerators

OPERANDS = 6  # two per GEMM, three GEMMs


def _big_non_gemm(ks, min_bytes: int) -> int:
    return sum(1 for k in ks if k.category != "gemm" and k.bytes >= min_bytes)


def test_h200_matmul_bytes_and_passes_per_operand():
    from bench.costmodel import hlo_kernels as hk

    bf16, mx = cost("h200", "matmul", "bf16"), cost("h200", "matmul", "mxfp4_all_h16")
    assert mx.bytes <= 3.0 * bf16.bytes, (mx.bytes, bf16.bytes)
    operand = 4096 * 4096 * 2  # one bf16 operand
    ks_bf16 = hk.kernels(optimized_hlo("h200", "matmul", "bf16"))
    text = optimized_hlo("h200", "matmul", "mxfp4_all_h16")
    ks = hk.kernels(text)
    passes = _big_non_gemm(ks, operand) - _big_non_gemm(ks_bf16, operand)
    assert passes <= 2 * OPERANDS, [(k.name, k.bytes) for k in ks]
    assert mx.kernels["gemm"] == 3
    # The GEMMs read the bf16 values (no f32 operand is materialized for them).
    for k in ks:
        if k.category == "gemm":
            assert k.bytes_read <= 2 * operand + 64, (k.name, k.bytes_read)
    assert not re.search(r"\bconditional\(", text)


@pytest.mark.parametrize("metric,bound", [("bytes", 1.4), ("roofline_s", 1.3), ("temp", 1.25)])
def test_h200_layer_meets_the_targets(metric, bound):
    bf16, mx = cost("h200", "layer", "bf16"), cost("h200", "layer", "mxfp4_all_h16")
    ratio = getattr(mx, metric) / getattr(bf16, metric)
    assert ratio <= bound, (metric, ratio)
