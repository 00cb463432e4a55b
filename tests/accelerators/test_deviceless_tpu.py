"""The emulated MXFP4 GEMM compiled for a TPU v5e without one: its
bytes, optimal seconds and temp memory against bf16's.

The TPU form quantizes each MXFP4 operand in one Pallas Mosaic kernel
(mxjax/emulation/in_place_tpu.py): for the fwd+bwd 4096^3 matmul under ``mxfp4_all_h16``,
six kernels and three GEMMs, no ``reverse`` anywhere (the butterflies pair halves of bit axes), no
conditional left (the platform branch resolved), and XLA's optimal_seconds (plus the
kernels' static-profile cycles) at most 1.5x bf16's; for the decoder layer's train
step, bytes at most 1.5x, optimal_seconds at most 1.3x and peak temp memory at most
1.25x bf16's, with each f32 weight read by its two kernels (fprop and dgrad axes) and
no bf16 copy of it written (``operand_dtype``, docs/NUMERICS.md).
"""

from __future__ import annotations

import re

import pytest

from tests.accelerators.conftest import cost, optimized_hlo

pytestmark = pytest.mark.accelerators


def test_v5e_matmul_one_kernel_per_operand_and_time():
    text = optimized_hlo("v5e", "matmul", "mxfp4_all_h16")
    assert text.count('custom_call_target="tpu_custom_call"') == 6
    assert not re.search(r"\breverse\(", text)
    assert not re.search(r"\bconditional\(", text)
    bf16, mx = cost("v5e", "matmul", "bf16"), cost("v5e", "matmul", "mxfp4_all_h16")
    assert mx.kernels["gemm"] == 3
    assert mx.optimal_s <= 1.5 * bf16.optimal_s, (mx.optimal_s, bf16.optimal_s)
    assert mx.optimal_s > bf16.optimal_s  # the kernels' cycles are counted


@pytest.mark.parametrize("metric,bound", [("bytes", 1.5), ("optimal_s", 1.3), ("temp", 1.25)])
def test_v5e_layer_bytes_and_memory(metric, bound):
    bf16, mx = cost("v5e", "layer", "bf16"), cost("v5e", "layer", "mxfp4_all_h16")
    ratio = getattr(mx, metric) / getattr(bf16, metric)
    assert ratio <= bound, (metric, ratio)


def test_v5e_layer_quantizes_each_operand_once_per_axis():
    """Kernels of the same configuration on the same operand are one kernel (XLA's CSE;
    the kernel is lowered once per configuration, so its debug locations agree): the
    q/k/v projections' shared input is quantized once along each of its axes."""
    from bench.costmodel import hlo_kernels as hk

    module = hk.parse_module(optimized_hlo("v5e", "layer", "mxfp4_all_h16"))
    calls = [(i.operands, re.search(r'"body":"([^"]+)"', i.attributes).group(1))
             for comp in module.computations.values() for i in comp
             if i.custom_call_target == "tpu_custom_call"]
    assert len(calls) >= 30
    assert len(set(calls)) == len(calls)


def test_v5e_layer_kernels_read_the_f32_weights():
    """The seven projections' f32 kernels go into their quantize kernels as they are
    stored (two per weight: blocks along its rows for fprop, its columns for dgrad); no
    convert to bf16 is left in the program."""
    from bench.costmodel import hlo_kernels as hk

    ks = hk.kernels(optimized_hlo("v5e", "layer", "mxfp4_all_h16"))
    kernels = [k for k in ks if k.target == "tpu_custom_call"]
    f32_in = [k for k in kernels if k.call_operands[0].startswith("f32[")]
    assert len(f32_in) == 14, [k.call_operands[0] for k in kernels]
    assert not [k for k in ks if k.opcode == "convert"]


def test_v5e_wrapped_flax_mlp_kernels_read_the_f32_weights():
    """A Flax MLP we did not write (``Dense(dtype=bf16, param_dtype=f32)``) under
    ``mxjax.nn.wrap``: Flax's casts of its two kernels are left to the quantize kernels too
    (wrap passes ``operand_dtype``), so each f32 kernel goes into its quantize kernels as
    stored (down's for fprop and dgrad, up's for fprop only: the input's gradient is not
    asked for), and no convert is left. Five GEMMs (two fprop, two wgrad, down's dgrad):
    ten quantize kernels."""
    from bench.costmodel import hlo_kernels as hk

    ks = hk.kernels(optimized_hlo("v5e", "wrapped_mlp", "mxfp4_all_h16"))
    kernels = [k for k in ks if k.target == "tpu_custom_call"]
    f32_in = sorted(k.call_operands[0].split("{")[0] for k in kernels
                    if k.call_operands[0].startswith("f32["))
    assert len(kernels) == 10
    assert f32_in == ["f32[1,2048,8192]", "f32[1,8192,2048]", "f32[8192,2048]"], \
        [k.call_operands[0] for k in kernels]
    assert not [k for k in ks if k.opcode == "convert"]
