"""Deviceless B200 compiles: NVFP4 and MXFP8 on Blackwell's block-scaled MMA under 'auto'.

* ``nvfp4@auto`` and ``mxfp8@auto`` resolve to 'xla_nvfp4' and 'xla_mxfp8' on B200: the
  4096^3 matmul's train step (forward and both backward GEMMs) is three
  ``__cudnn$blockScaledDot`` calls on f4e2m1fn (NVFP4) or f8e4m3fn (MXFP8) operands, and
  no GEMM of it reads bf16.
* The Llama 3.1-8B layer (seq 8192, fused attention): every one of its 21 quantized GEMMs
  is the block-scaled dot, the attention's fused cuDNN calls are the only other GEMMs;
  its kernel list is printed.
* Its estimates on the rates roofline, beside jax.nn's peers compiled in the same session:
  each route is faster than the emulation (what 'auto' rests on); issue 48's targets are
  printed, and asserted where met (`MET`; mxjax/measurements.json,
  'layer_8b.b200.nvfp4_rates_roofline' and 'layer_8b.b200.mxfp8_rates_roofline').
"""

from __future__ import annotations

import collections
import functools

import pytest

from tests.accelerators.conftest import cost, require

pytestmark = pytest.mark.accelerators

CUDNN = "__cudnn$blockScaledDot"
ATTENTION = {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
FUSED = "fused"
OPERANDS = {"nvfp4": ("f4e2m1fn", "f4e2m1fn"), "mxfp8": ("f8e4m3fn", "f8e4m3fn")}


@functools.cache
def _text(program: str, policy: str) -> str:
    from bench.costmodel import aot
    from bench.costmodel.programs import program as build

    kw = {"attention_impl": FUSED} if program != "matmul" else {}
    fn, args = build(program, policy, **kw)
    return aot.compile_for(fn, args, require("b200")).as_text()


def _gemms(program: str, policy: str) -> collections.Counter:
    from bench.costmodel import hlo_kernels as hk

    return collections.Counter((how, types) for _, how, types, _ in
                               hk.gemm_operand_types(_text(program, policy))
                               if how not in ATTENTION)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_auto_puts_the_matmuls_three_gemms_on_the_block_scaled_mma_on_b200(fmt):
    gemms = _gemms("matmul", f"{fmt}@auto")
    assert gemms == {(CUDNN, OPERANDS[fmt]): 3}, gemms
    assert not [g for g in gemms if "bf16" in g[1]], gemms


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_every_quantized_gemm_of_the_8b_layer_is_the_block_scaled_mma_on_b200(fmt):
    from bench.costmodel import hlo_kernels as hk

    gemms = _gemms("layer_8b", f"{fmt}@auto")
    assert gemms == {(CUDNN, OPERANDS[fmt]): 21}, gemms  # the custom calls are not merged
    kernels = hk.kernels(_text("layer_8b", f"{fmt}@auto"))
    by_category = collections.Counter(k.category for k in kernels)
    print(f"b200 8B layer {fmt}@auto: {len(kernels)} kernels {dict(by_category)}")
    for k in kernels:
        print(f"  {k.category:11s} {k.target or k.opcode:32s} "
              f"{(k.bytes_read + k.bytes_written) / 1e6:9.1f} MB")


# issue 48's targets (rates roofline, B200, 8B layer at seq 8192, fused attention).
TARGETS = {"nvfp4": {"bf16": 0.6, "fp8": 0.8, "peer:jax_nvfp4": 1.0},
           "mxfp8": {"bf16": 0.8, "peer:jax_mxfp8": 1.0}}
# What the estimate meets (recorded in mxjax/measurements.json with the figures): on this
# roofline nvfp4@auto 0.74x bf16 and 1.05x fp8 (its dY's stochastic rounding, drawn in the
# kernel, is arithmetic this roofline does not charge; '+alu' and the calibrated model do)
# but faster than jax.nn's nvfp4; mxfp8@auto 0.71x bf16 and faster than jax.nn's mxfp8.
MET: dict[str, set[str]] = {"nvfp4": {"peer:jax_nvfp4"}, "mxfp8": {"bf16", "peer:jax_mxfp8"}}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_block_formats_on_the_8b_layer_against_their_targets(fmt):
    row = functools.partial(cost, "b200", "layer_8b", attention=FUSED)
    mine = row(f"{fmt}@auto").rates_s
    emulated = row(f"{fmt}@xla").rates_s
    assert mine < emulated, (mine, emulated)
    ratios = {base: mine / row(base).rates_s for base in TARGETS[fmt]}
    print(f"b200 8B layer {fmt}@auto: {mine * 1e3:.2f} ms; emulation "
          f"{emulated * 1e3:.2f} ms; " + ", ".join(
              f"{r:.3f}x {base} (target <= {TARGETS[fmt][base]}x)"
              for base, r in ratios.items()))
    for base in MET[fmt]:
        limit = TARGETS[fmt][base]
        assert (ratios[base] < limit if limit == 1.0 else ratios[base] <= limit), (
            base, ratios[base])
