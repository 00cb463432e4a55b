"""bench/costmodel/calibrated.py on the H200 run: every rate derived from the committed
measurements and the deviceless compiles of the code that ran (jax 0.11.2), and every
measured H200 row of the 8B layer within +-15% of the model (the peak roofline was off by
1.4-9.8x). Compiles are committed (bench/costmodel/calibration/compiled/): no accelerator
package needed."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest

from bench.costmodel import calibrated as C
from bench.costmodel import calibration as cal
from bench.costmodel import rates as R

# (run, committed compile, measured row of that run's file); fp8 was timed by the first run.
LAYER_ROWS = [
    ("a", "layer_8b_mxfp4_all_h16", "mxfp4_all_h16"),
    ("a", "layer_8b_mxfp4_all_h16_at_xla_fp8_xla_quantizer",
     "mxfp4_all_h16@xla_fp8 (xla quantizer)"),
    ("a", "layer_8b_mxfp4_all_h16_at_xla_fp8", "mxfp4_all_h16@xla_fp8 (pallas quantizer)"),
    ("b", "layer_8b_bf16", "bf16"),
    ("b", "layer_8b_mxfp4_all_h16", "mxfp4_all_h16"),
    ("b", "layer_8b_mxfp4_all_h16_at_xla_fp8", "mxfp4_all_h16@xla_fp8"),
    ("a:b", "layer_8b_fp8", "fp8"),  # timed in run a; the fp8 code is the same in b
    ("a:b", "layer_8b_bf16", "bf16"),  # run a's bf16 (the same program)
]
TOLERANCE = 0.15


@functools.cache
def _rates():
    return C.derive("h200")


def _model_ms(run: str, stem: str) -> float:
    ks, counts = C.load_counts(C.COMPILED_DIR / f"h200-2026-12-04-{run}" / stem)
    return (C.program_seconds(ks, counts, _rates()) + _rates().host_s) * 1e3


@pytest.mark.parametrize("run,stem,policy", LAYER_ROWS, ids=[r[2] + "/" + r[0] for r in LAYER_ROWS])
def test_the_model_lands_within_15_percent_of_each_measured_h200_row(run, stem, policy):
    timed, compiled = (run.split(":") + [run])[:2]
    measured = cal.load(cal.CALIBRATION_DIR / f"h200-2026-12-04-{timed}.json").layer_ms(policy)
    model = _model_ms(compiled, stem)
    print(f"{policy} (run {timed}): model {model:.2f} ms, measured {measured:.2f} ms, "
          f"{model / measured - 1:+.1%}")
    assert abs(model / measured - 1) <= TOLERANCE, (model, measured)


def test_the_rates_are_measured_fractions_not_peaks():
    r = _rates()
    peak = R.rates_for("h200")
    # bf16 8192^3 and the copy, each less the host's per-call overhead (two copies: two
    # equations); FP8 from mx_dot less its decode kernels.
    assert 0.6 < r.gemm_rate("bf16") / peak.rate("bf16")[0] < 0.75
    assert 0.35 < r.gemm_rate("fp8") / peak.rate("fp8")[0] < 0.6
    assert 0.85 < r.copy_bytes_per_s / peak.hbm_bytes_per_s < 0.97
    assert 100e-6 < r.host_s < 300e-6
    assert 0.3 < r.issue_per_s / r.limits.lane_ops_per_s < 0.8
    # A chip without measurements takes the H200's fractions of its own peaks.
    b200 = C.derive("b200")
    for cls in ("bf16", "fp8"):
        assert b200.gemm_rate(cls) / R.rates_for("b200").rate(cls)[0] == pytest.approx(
            r.gemm_rate(cls) / peak.rate(cls)[0])
    assert "not measured" in b200.basis


@pytest.mark.parametrize("stem,name", [
    ("quantize_pallas_row", "pallas fused_quantize row, bf16[8192,14336] H16 -> fp8"),
    ("quantize_pallas_col", "pallas fused_quantize col, bf16[8192,14336] H16 -> fp8"),
])
def test_the_pallas_quantize_kernel_is_explained_without_a_parameter(stem, name):
    """Row-wise: 255 registers per thread, 2 blocks of 128 threads per SM (12.5%
    occupancy): its SASS issues at 1/8 of the lanes. Column-wise: 32 registers and 45 KB of
    spills per thread, 42 GB of local-memory traffic per operand at the copy bandwidth."""
    ks, counts = C.load_counts(C.COMPILED_DIR / "h200-2026-12-04-a" / stem)
    (kernel,) = counts.triton.values()
    model = C.program_seconds(ks, counts, _rates()) + _rates().host_s
    measured = cal.load(cal.CALIBRATION_DIR / "h200-2026-12-04-a.json").kernel(name).total_us
    print(f"{stem}: {kernel}, occupancy {C.occupancy(kernel, _rates().limits):.3f}: model "
          f"{model * 1e6:.0f} us, measured {measured:.0f} us")
    assert abs(model * 1e6 / measured - 1) <= TOLERANCE


def test_the_pallas_quantizers_6x_on_the_layer_is_its_triton_kernels():
    """Run a's layer with xla_fp8's Pallas quantizer measured 6.0x bf16 (120.7 ms against
    20.05): its 39 Triton kernels (charged by occupancy, spills and whole waves; no
    parameter) take most of the model's time, and by their bytes alone, as the peak
    roofline charges them, the program would be under 2x bf16. A third of it is partial
    waves: 12 column-wise kernels of 256 to 1024 blocks fill one wave of the H200's 2112
    resident blocks, so each takes a full wave's time (the kernel timed alone fills 3.4)."""
    run = C.COMPILED_DIR / "h200-2026-12-04-a"
    ks, counts = C.load_counts(run / "layer_8b_mxfp4_all_h16_at_xla_fp8")
    rates = _rates()
    bf16 = C.program_seconds(*C.load_counts(C.COMPILED_DIR / "h200-2026-12-04-b" /
                                            "layer_8b_bf16"), rates)
    total = C.program_seconds(ks, counts, rates)
    n, triton = C.seconds_by_class(ks, counts, rates)["triton kernels"]
    bare = C.program_seconds(ks, C.Counts(fusion_instructions=counts.fusion_instructions,
                                          triton={}), rates)
    partial = sum(C.kernel_seconds(k, counts, rates)
                  * (1 - 1 / C.wave_factor(counts.triton[k.name], rates.limits))
                  for k in ks if k.name in counts.triton)
    single = [t for t in counts.triton.values() if C.waves(t, rates.limits) == 1]
    print(f"pallas quantizer layer: model {(total + rates.host_s) * 1e3:.1f} ms = "
          f"{total / bf16:.2f}x bf16; {n} Triton kernels {triton * 1e3:.1f} ms, "
          f"{partial * 1e3:.1f} ms of it partial waves; at their bytes {bare * 1e3:.1f} ms")
    assert 4.0 < total / bf16 < 7.0
    assert n == 39 and triton > 0.7 * total
    assert len(single) == 12 and 0.2 * total < partial < 0.4 * total
    assert bare / bf16 < 2.0


def test_a_partial_wave_takes_a_full_waves_time():
    """Per-SM limits of the H200 spec: 132 SMs, 2048 threads, 64K registers. A 32-register
    128-thread block fits 16 times per SM (2112 resident blocks), a 255-register one twice."""
    limits = _rates().limits
    small = C.TritonKernel(threads=256 * 128, block_threads=128, shared_bytes=0,
                           registers=32, spill_bytes=0, sass=100)
    assert (limits.cores, C.blocks_per_core(small, limits)) == (132, 16)
    assert C.waves(small, limits) == 1
    assert C.wave_factor(small, limits) == pytest.approx(2112 / 256)
    full = dataclasses.replace(small, threads=2112 * 128)
    assert C.waves(full, limits) == 1 and C.wave_factor(full, limits) == 1.0
    tail = dataclasses.replace(small, threads=2113 * 128)
    assert C.waves(tail, limits) == 2 and C.wave_factor(tail, limits) == pytest.approx(
        2 * 2112 / 2113)
    fat = dataclasses.replace(small, registers=255, threads=264 * 128)
    assert C.blocks_per_core(fat, limits) == 2 and C.wave_factor(fat, limits) == 1.0
    # kernel_seconds charges the grid as its whole waves: 256 blocks cost 2112's.
    k = C.hk.Kernel(name="k", opcode="custom-call", category="custom-call",
                    target="__gpu$xla.gpu.triton", bytes_read=0, bytes_written=0,
                    gemm_flops=0, alu_ops=0, shape="f32[1]")
    counts = C.Counts(fusion_instructions={}, triton={"k": small})
    counts_full = C.Counts(fusion_instructions={}, triton={"k": full})
    assert C.kernel_seconds(k, counts, _rates()) == pytest.approx(
        C.kernel_seconds(k, counts_full, _rates()))


def _cost(target, policy, seconds):
    from bench.costmodel.accelerator_cost import Cost

    return Cost(target=target, variant="", program="layer_8b", policy=policy, kernels={},
                bytes=0, temp=0, optimal_s=None, roofline_s=0.0, roofline_alu_s=0.0,
                gemm_flops=0, compile_s=0.0, attention="fused", calibrated_s=seconds)


def test_the_calibrated_verdict_reads_each_bound_against_its_baseline():
    from bench.costmodel.targets import calibrated_verdict

    rows = [_cost("h200", "bf16", 20.0), _cost("h200", "fp8", 15.0),
            _cost("h200", "mxfp4_all_h16@auto", 20.0), _cost("b200", "bf16", 10.0),
            _cost("b200", "fp8", 8.0), _cost("b200", "mxfp4_all_h16@auto", 6.0)]
    text = calibrated_verdict(rows)
    met, missed = text.split("MISSED")
    assert "h200 layer_8b fp8 vs bf16 0.75x (<= 0.8x)" in met
    assert "h200 layer_8b mxfp4_all_h16@auto vs bf16 1.00x (<= 0.95x)" in missed
    assert "b200 layer_8b fp8 vs bf16 0.80x (<= 0.7x)" in missed
    assert "b200 layer_8b mxfp4_all_h16@auto vs bf16 0.60x (<= 0.65x)" in met
    assert "b200 layer_8b mxfp4_all_h16@auto vs fp8 0.75x (<= 0.85x)" in met
    assert "NOT met" in text and "not compiled" not in text
    assert "not compiled in this run: b200" in calibrated_verdict(rows[:3])


def test_calibrated_table_has_a_block_per_charged_chip_in_aligned_columns():
    from bench.accelerator_cost import calibrated_table

    rows = [_cost("h200", "bf16", 0.02), _cost("b200", "bf16", 0.0),
            _cost("h200", "mxfp4_all_h16@auto", 0.015)]
    lines = calibrated_table(rows)
    assert lines[0] == "## calibrated model: h200, layer_8b@fused"
    assert not any("b200" in line for line in lines)  # nothing charged there: no block
    header, rule, bf16, mxfp4 = lines[1:]
    assert header.split()[:3] == ["policy", "calibrated", "ms"]
    assert set(rule.split()) <= {"-" * n for n in range(1, 40)}
    assert mxfp4.split()[:3] == ["mxfp4_all_h16@auto", "15.00", "0.75x"]
    assert bf16.index("20.00") == mxfp4.index("15.00") == header.index("calibrated ms")


# --- which file gives each rate: any schema-valid file of the chip, the newest first --------

def _device_file(chip: str, date: str, *, bf16: float, fp8: float, copy_gbs: float | None,
                 launch_us: float | None) -> dict:
    """A measurement file as bench/device/profile.py writes it (batched rates, no compiles)."""
    def gemm(operands, implementation, setting, tflops):
        return {"operands": operands, "m": C.SIZE, "n": C.SIZE, "k": C.SIZE,
                "implementation": implementation, "setting": setting, "tflops": tflops}

    return {"schema": 1, "chip": chip,
            "provenance": {"date": date, "jax": "0.12.0", "command": "make bench-gpu",
                           "commit": "f" * 40, "device": f"synthetic {chip}"},
            "gemms": [gemm("bf16", "cublaslt", "DEFAULT", bf16 * 0.9),
                      gemm("bf16", "triton", "DEFAULT", bf16),
                      gemm("e4m3xe4m3", "cublaslt", "DEFAULT", fp8 * 1.3),  # fast accumulation
                      gemm("e5m2xe4m3", "cublaslt", "HIGHEST", fp8),
                      gemm("e4m3xe4m3", "triton", "HIGHEST, asked cublaslt", fp8 * 0.8)],
            "copy_bandwidth_gbs": copy_gbs, "launch_overhead_us": launch_us, "layers": [],
            "kernels": []}


@pytest.fixture()
def calibration_dir(tmp_path):
    """A copy of the committed calibration directory (the H200 files and their compiles)."""
    import shutil

    return Path(shutil.copytree(cal.CALIBRATION_DIR, tmp_path / "calibration"))


def _drop(directory, doc, tag=""):
    from bench.device import measurements_file

    return measurements_file.write(doc, directory, tag)  # schema-checked as a run writes it


def test_a_new_chips_file_gives_that_chip_its_own_rates(calibration_dir):
    _drop(calibration_dir, _device_file("h100", "2026-12-20", bf16=600.0, fp8=1100.0,
                                        copy_gbs=3000.0, launch_us=3.5))
    r = C.derive("h100", calibration_dir)
    assert r.gemm_rate("bf16") == pytest.approx(600e12)  # the fastest bf16 row
    assert r.gemm_rate("fp8") == pytest.approx(1100e12)  # the fastest row at HIGHEST
    assert r.copy_bytes_per_s == pytest.approx(3000e9) and r.launch_s == pytest.approx(3.5e-6)
    assert r.basis.count("h100-2026-12-20.json") == 4
    # What the file did not measure (the fusions' issue rate) is the H200's fraction.
    h200 = C.derive("h200", calibration_dir)
    assert r.issue_per_s / r.limits.lane_ops_per_s == pytest.approx(
        h200.issue_per_s / h200.limits.lane_ops_per_s)
    assert "of the lanes; the h200's, not measured on the h100" in r.basis
    # The committed directory (no h100 file) still gives the H200's fractions.
    assert C.derive("h100").gemm_rate("bf16") != pytest.approx(600e12)


def test_the_newest_file_gives_each_rate_it_measured_and_runs_chooses(calibration_dir):
    before = C.derive("h200", calibration_dir)
    _drop(calibration_dir, _device_file("h200", "2026-12-30", bf16=700.0, fp8=1200.0,
                                        copy_gbs=None, launch_us=None))
    after = C.derive("h200", calibration_dir)
    assert after.gemm_rate("bf16") == pytest.approx(700e12)
    assert after.gemm_rate("fp8") == pytest.approx(1200e12)
    assert after.gemm_rate("tf32") == pytest.approx(350e12)  # bf16's measured fraction
    # The new file has no copies and no quantize row: those stay the 2026-12-04 runs'.
    assert after.copy_bytes_per_s == before.copy_bytes_per_s
    assert after.issue_per_s == before.issue_per_s and after.host_s == before.host_s
    # The B200 (no file) follows the newest H200 fractions.
    assert C.derive("b200", calibration_dir).fraction("fp8") == pytest.approx(
        after.fraction("fp8"))
    # An explicit choice of runs reads only those.
    old = C.derive("h200", calibration_dir, runs=("h200-2026-12-04-a", "h200-2026-12-04-b"))
    assert old.gemm_rate("fp8") == before.gemm_rate("fp8")
    with pytest.raises(cal.CalibrationError, match=r"runs=\['h200-2099-01-01'\] name no h200"):
        C.derive("h200", calibration_dir, runs=("h200-2099-01-01",))


def test_a_reference_chip_without_a_rate_is_refused_with_what_is_missing(calibration_dir):
    # Run b recorded no copy: the H200 is the reference chip, so nothing can stand in.
    with pytest.raises(cal.CalibrationError, match="measures the copy bandwidth"):
        C.derive("h200", calibration_dir, runs=("h200-2026-12-04-b",))


def test_the_slowest_kernels_are_the_model_charges_in_order():
    # What `accelerator_cost.py --top` prints under the calibrated model: every kernel's
    # charge, slowest first, summing to the program's time; a Triton kernel says what set
    # its time. Run a's layer with the Pallas quantizer: PERFORMANCE.md finds its column-wise
    # quantize kernels (one wave each) the costliest kernels after the GEMMs.
    ks, counts = C.load_counts(C.COMPILED_DIR / "h200-2026-12-04-a"
                               / "layer_8b_mxfp4_all_h16_at_xla_fp8")
    rates = _rates()
    rows = C.slowest_kernels(ks, counts, rates, len(ks))
    assert len(rows) == len(ks) and len(C.slowest_kernels(ks, counts, rates, 5)) == 5
    seconds = [t for t, _, _, _ in rows]
    assert seconds == sorted(seconds, reverse=True)
    assert sum(seconds) == pytest.approx(C.program_seconds(ks, counts, rates), rel=1e-12)
    by_class = C.seconds_by_class(ks, counts, rates)
    for cls, (n, total) in by_class.items():
        mine = [t for t, c, _, _ in rows if c == cls]
        assert len(mine) == n and sum(mine) == pytest.approx(total, rel=1e-12, abs=0.0)
    triton = [(t, k, why) for t, c, k, why in rows if c == "triton kernels"]
    assert triton and all(why.startswith("occupancy ") and "waves" in why
                          for _, _, why in triton)
    assert all(why == "" for _, c, _, why in rows if c != "triton kernels")
    slowest_other = next(t for t, c, _, _ in rows
                         if not c.startswith("gemm") and c != "attention")
    assert triton[0][0] == slowest_other
