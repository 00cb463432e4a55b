# ruff: noqa: E501  (optimized HLO text lines)
"""bench/accelerator_cost.py's rates roofline on hand-written optimized HLO (no accelerator
packages): every GEMM charged at the rate of its operand types, attention by its flops."""

from __future__ import annotations

import pytest

from bench.costmodel import accelerator_cost as ac
from bench.costmodel import aot
from bench.costmodel import hlo_kernels as hk
from bench.costmodel import rates as R
from bench.costmodel.targets import fp8_layer_verdict

_FMHA_CONFIG = (
    '{"cudnn_fmha_backend_config": {"fmha_scale": 0.08, "intermediate_tensor_shape": '
    '{"element_type": "BF16", "dimensions": ["1", "32", "1024", "1024"]}, '
    '"is_flash_attention": true, "mask_type": "MASK"}}')
HLO = """HloModule m, is_scheduled=true

%fused_f8 (p0: f8e4m3fn[256,512], p1: f8e5m2[512,128]) -> bf16[256,128] {
  %p0 = f8e4m3fn[256,512]{1,0} parameter(0)
  %p1 = f8e5m2[512,128]{1,0} parameter(1)
  ROOT %dot.1 = bf16[256,128]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (q: bf16[1,1024,32,128], k: bf16[1,1024,8,128], a: f8e4m3fn[256,512], b: f8e5m2[512,128], l: f8e4m3fn[1,256,512], r: f8e4m3fn[1,128,512], ls: f8e8m0fnu[1,256,16], rs: f8e8m0fnu[1,128,16], c: u8[256,256], cs: u8[256,16], d: u8[256,128], ds: u8[16,128]) -> bf16[256,128] {
  %q = bf16[1,1024,32,128]{3,2,1,0} parameter(0)
  %k = bf16[1,1024,8,128]{3,2,1,0} parameter(1)
  %a = f8e4m3fn[256,512]{1,0} parameter(2)
  %b = f8e5m2[512,128]{1,0} parameter(3)
  %l = f8e4m3fn[1,256,512]{2,1,0} parameter(4)
  %r = f8e4m3fn[1,128,512]{2,1,0} parameter(5)
  %ls = f8e8m0fnu[1,256,16]{2,1,0} parameter(6)
  %rs = f8e8m0fnu[1,128,16]{2,1,0} parameter(7)
  %c = u8[256,256]{1,0} parameter(8)
  %cs = u8[256,16]{1,0} parameter(9)
  %d = u8[256,128]{1,0} parameter(10)
  %ds = u8[16,128]{1,0} parameter(11)
  %att = (bf16[1,32,1024,128]{3,1,2,0}, f32[1,32,1024]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmax", backend_config=FMHA_CAUSAL
  %attb = (bf16[1,32,1024,128]{3,1,2,0}, u8[0]{0}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config=FMHA_FULL
  %bsd = (bf16[1,256,128]{2,1,0}, u8[0]{0}) custom-call(%l, %r, %ls, %rs), custom_call_target="__cudnn$blockScaledDot"
  %pk = f32[256,128]{1,0} custom-call(%c, %cs, %d, %ds), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/jvp()/mxfp4_matmul_fp8/pallas_call"}
  %qz = u8[256,256]{1,0} custom-call(%c), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/fused_quantize/pallas_call"}
  ROOT %g = bf16[256,128]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_f8
}
""".replace("FMHA_CAUSAL", _FMHA_CONFIG.replace("MASK", "CAUSAL")).replace(
    "FMHA_FULL", _FMHA_CONFIG.replace("MASK", "NO_MASK"))


def _by_name():
    return {k.name: k for k in hk.kernels(HLO)}


def test_every_gemm_is_charged_by_its_operand_types():
    ks = _by_name()
    attention = 2 * 1 * 32 * 1024 * 1024 * 128  # 2 Sq Sk D per batch and head, one GEMM
    assert ks["att"].gemms == (("bf16", 2 * attention // 2),)  # 2 GEMMs, causal: half
    assert ks["attb"].gemms == (("bf16", 5 * attention),)  # 5 GEMMs, no mask
    assert ks["bsd"].gemms == (("fp8", 2 * 256 * 128 * 512),)
    assert ks["pk"].gemms == (("fp8", 2 * 256 * 128 * 512),)  # K = 2 x 256 packed bytes
    assert ks["qz"].gemms == () and ks["qz"].gemm_flops == 0  # a quantize kernel: bytes only
    assert ks["g"].gemms == (("fp8", 2 * 256 * 128 * 512),) and ks["g"].category == "gemm"
    # The attention's outputs are all results (the statistics too), not cuBLAS workspace.
    assert ks["att"].bytes_written == 32 * 1024 * 128 * 2 + 32 * 1024 * 4


def test_rate_classes_take_the_wider_operand():
    assert R.rate_class("f8e4m3fn", "f8e5m2") == "fp8"
    assert R.rate_class("f4e2m1fn", "f4e2m1fn") == "fp4"
    assert R.rate_class("f4e2m1fn", "f8e4m3fn") == "fp8"
    assert R.rate_class("f8e4m3fn", "bf16") == "bf16"
    assert R.rate_class("bf16", "f32") == "tf32"
    # A type without units runs on the next wider one: FP4 on an H200 at its FP8 rate,
    # FP8 on a v5e at its bf16 rate.
    assert R.rates_for("h200").rate("fp4") == (1979e12, "fp8")
    assert R.rates_for("v5e").rate("fp8") == (197e12, "bf16")
    assert R.rates_for("b200").rate("fp4") == (9e15, "fp4")
    with pytest.raises(KeyError, match="no published rates"):
        R.rates_for("a100")
    for chip in R.CHIP_RATES.values():
        assert chip.source and chip.hbm_bytes_per_s > 0


def test_rates_and_tpu_peaks_come_from_the_data_file():
    """The cost model charges the published figures of mxjax/measurements.json, and its
    sources carry no peak rate of their own."""
    import re
    from pathlib import Path

    from mxjax import measurements

    for chip in measurements.all_chip_rates():
        assert R.rates_for(chip.name).matrix_flops == chip.matrix_flops
        assert R.rates_for(chip.name).hbm_bytes_per_s == chip.hbm_bytes_per_s
    assert R.LAUNCH_S == measurements.figure("assumption.kernel_launch_s").value("launch")
    for name in ("v5e", "v6e"):
        published = measurements.chip_rates(name)
        assert aot.TARGETS[name].bf16_flops_per_s == dict(published.matrix_flops)["bf16"]
        assert aot.TARGETS[name].hbm_bytes_per_s == published.hbm_bytes_per_s
    # Rates written as literals (a unit conversion, 1e9 or 1e12, is not one).
    rate = re.compile(r"\b(?!1e)\d+(?:\.\d+)?e(?:9|1[0-6])\b")
    costmodel = Path(R.__file__).parent
    literals = {f.name: rate.findall(f.read_text()) for f in costmodel.glob("*.py")
                if f.name != "targets.py"}  # targets.py: bounds (temp bytes), not rates
    assert not {k: v for k, v in literals.items() if v}


@pytest.mark.parametrize("target", ["h200", "b200"])
def test_rates_roofline_sums_max_of_flops_and_bytes_plus_launch(target):
    ks = hk.kernels(HLO)
    chip = R.rates_for(target)
    expected = 0.0
    for k in ks:
        flops_s = sum(f / chip.rate(c)[0] for c, f in k.gemms)
        expected += max(flops_s, k.bytes / chip.hbm_bytes_per_s) + R.LAUNCH_S
    got = ac.rates_roofline(ks, aot.TARGETS[target])
    assert got == pytest.approx(expected, rel=1e-12)
    # The attention dominates, at the bf16 rate.
    att = next(k for k in ks if k.name == "attb")
    assert got > att.gemm_flops / chip.rate("bf16")[0]
    assert dict(ac.flops_by_class(ks))["fp8"] == 3 * 2 * 256 * 128 * 512


def _row(target, policy, rates_s, attention="fused", temp=10**9):
    return ac.Cost(target=target, variant="", program="layer_8b", policy=policy, kernels={},
                   bytes=0, temp=temp, optimal_s=None, roofline_s=0.0, roofline_alu_s=0.0,
                   gemm_flops=0, compile_s=0.0, rates_s=rates_s, attention=attention)


def test_fp8_layer_verdict_reads_the_rows_of_one_run():
    rows = [_row("h200", "bf16", 10.0), _row("h200", "fp8", 7.0),
            _row("h200", "bf16", 20.0, attention="explicit", temp=20 * 10**9),
            _row("b200", "bf16", 10.0), _row("b200", "fp8", 7.5)]
    text = fp8_layer_verdict(rows)
    assert "NOT met" in text
    assert "h200 layer_8b@fused fp8 0.70x (<= 0.75x)" in text.split("MISSED")[0]
    assert "b200 layer_8b@fused fp8 0.75x (<= 0.7x)" in text.split("MISSED")[1]
    assert "fused vs explicit attention 0.50x" in text.split("MISSED")[0]
    assert "not compiled" not in text
    text = fp8_layer_verdict(rows[:2])
    assert "partial" in text and "b200 layer_8b@fused fp8" in text.split("not compiled")[1]
