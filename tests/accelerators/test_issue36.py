"""Issue 36 on deviceless compiles: MXFP4 GEMMs on the FP8 and FP4 matrix units.

* ``xla_fp8``: every quantized GEMM of the Llama 3.2-1B decoder layer (fused attention)
  under ``mxfp4_all_h16`` is an FP8 GEMM of the exact carriers (E5M2 x E4M3) on H200 and
  B200; ``xla_fp4``: every one is cuDNN's block-scaled FP4 MMA on B200
  (``__cudnn$blockScaledDot`` on f4e2m1fn x f4e2m1fn). The attention's GEMMs are the
  fused cuDNN calls, the only others.
* On the 8B layer (seq 8192, the rates roofline) ``xla_fp8`` is estimated faster than the
  emulation on both chips ('auto''s choice there), and meets the issue's H200 target
  (<= 0.95x bf16: asserted). ``xla_fp4`` is printed (XLA materializes its NVFP4 operands'
  f32 butterflies and transposes). The B200 targets (<= 0.6x bf16 and <= 0.83x fp8) are
  not met (docs/PERFORMANCE.md says where the time goes): printed, not asserted.
"""

from __future__ import annotations

import collections

import pytest

from tests.accelerators.conftest import cost, require

pytestmark = pytest.mark.accelerators

FUSED = "fused"
ATTENTION = {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}


def _layer_gemms(target: str, policy: str):
    from bench import aot
    from bench import hlo_kernels as hk
    from bench.programs import program

    fn, args = program("layer", policy, attention_impl=FUSED)
    text = aot.compile_for(fn, args, require(target)).as_text()
    return collections.Counter((how, types) for _, how, types, _ in hk.gemm_operand_types(text)
                               if how not in ATTENTION)


@pytest.mark.parametrize("target", ["h200", "b200"])
def test_xla_fp8_puts_every_quantized_gemm_of_the_layer_on_fp8_units(target):
    gemms = _layer_gemms(target, "mxfp4_all_h16@xla_fp8")
    assert {types for _, types in gemms} == {("f8e5m2", "f8e4m3fn")}, gemms
    # 7 projections x 3 GEMMs, less XLA's merges of q|k|v and gate|up in the forward.
    assert sum(gemms.values()) >= 17, gemms


def test_xla_fp4_puts_every_quantized_gemm_of_the_layer_on_fp4_mma_on_b200():
    gemms = _layer_gemms("b200", "mxfp4_all_h16@xla_fp4")
    assert set(gemms) == {("__cudnn$blockScaledDot", ("f4e2m1fn", "f4e2m1fn"))}, gemms
    assert sum(gemms.values()) == 21, gemms  # the custom calls are not merged


@pytest.mark.parametrize("target,routes", [("h200", ("xla_fp8",)),
                                           ("b200", ("xla_fp8", "xla_fp4"))])
def test_mxfp4_routes_on_the_8b_layer_against_the_issue_targets(target, routes):
    bf16 = cost(target, "layer_8b", "bf16", attention=FUSED).rates_s
    emulated = cost(target, "layer_8b", "mxfp4_all_h16", attention=FUSED).rates_s
    fp8 = cost(target, "layer_8b", "fp8", attention=FUSED).rates_s
    for route in routes:
        t = cost(target, "layer_8b", f"mxfp4_all_h16@{route}", attention=FUSED).rates_s
        print(f"{target} 8B layer: {route} {t * 1e3:.2f} ms = {t / bf16:.2f}x bf16, "
              f"{t / fp8:.2f}x fp8; emulation {emulated / bf16:.2f}x bf16 "
              f"(issue 36 targets: H200 <= 0.95x bf16, B200 <= 0.6x bf16 and <= 0.83x fp8)")
        if route == "xla_fp8":
            assert t < emulated, (route, t, emulated)
    if target == "h200":  # 'auto''s route there; B200's targets are not met (printed above)
        t = cost(target, "layer_8b", "mxfp4_all_h16@xla_fp8", attention=FUSED).rates_s
        assert t <= 0.95 * bf16, (t, bf16)
