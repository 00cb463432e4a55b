"""bench/device/profile.py, the device profile in one command, on this CPU: its dry run end
to end (a schema-valid measurement file in a temporary directory), the file's schema
check, the GEMM implementation read from a compiled program, the cost model's estimate per
kernel class, and the errors of bad arguments or a missing GPU."""

from __future__ import annotations

import copy
import gzip
import json
import re
import time
from pathlib import Path

import pytest

from bench.device import estimate, harness, measurements_file, profile, trace
from bench.device.sections import gemm_rates

DATA = Path(__file__).resolve().parent / "data" / "traces"


def _valid_doc() -> dict:
    return {"schema": 1, "chip": "h200",
            "provenance": {"date": "2026-12-07", "jax": "0.12.1", "command": "x",
                           "commit": "abc", "device": "NVIDIA H200"},
            "gemms": [{"operands": "e4m3xe4m3", "m": 8192, "n": 8192, "k": 8192,
                       "implementation": "cublaslt", "setting": "DEFAULT", "tflops": 900.0}],
            "copy_bandwidth_gbs": 4000.0, "launch_overhead_us": None,
            "layers": [{"program": "layer_8b", "seq": 8192, "policy": "bf16/fused",
                        "ms": 20.0}],
            "kernels": [{"policy": "bf16/fused", "class": "gemm bf16", "name": "nvjet",
                         "count": 2, "total_us": 10.0}]}


def test_schema_check_accepts_a_valid_file_and_names_each_bad_field():
    measurements_file.check(_valid_doc())
    bad = [(("gemms", 0, "operands"), "fp8", r"gemms\[0\].operands: expected one of"),
           (("gemms", 0, "implementation"), "cublas", r"gemms\[0\].implementation"),
           (("gemms", 0, "tflops"), 0.0, r"gemms\[0\].tflops: expected a positive"),
           (("layers", 0, "seq"), 8192.0, r"layers\[0\].seq: expected a positive integer"),
           (("kernels", 0, "count"), True, r"kernels\[0\].count"),
           (("provenance", "date"), "07/12/2026", "provenance.date: expected YYYY-MM-DD"),
           (("chip",), "H200", "measurements.chip"),
           (("copy_bandwidth_gbs",), float("nan"), "copy_bandwidth_gbs")]
    for path, value, match in bad:
        doc = copy.deepcopy(_valid_doc())
        target = doc
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value
        with pytest.raises(ValueError, match=match):
            measurements_file.check(doc)
    doc = _valid_doc()
    doc["gemms"][0]["extra"] = 1
    with pytest.raises(ValueError, match=r"gemms\[0\]: expected the fields"):
        measurements_file.check(doc)


def test_write_names_the_file_by_chip_and_date(tmp_path):
    path = measurements_file.write(_valid_doc(), tmp_path, tag="a")
    assert path.name == "h200-2026-12-07-a.json"
    assert json.loads(path.read_text()) == _valid_doc()
    assert not list(tmp_path.glob("*.tmp"))


def test_the_gemm_implementation_is_read_from_the_compiled_program():
    assert gemm_rates.implementation_of(
        '%c = (bf16[8,8], s8[0]) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"'
    ) == "cublaslt"
    assert gemm_rates.implementation_of(
        '%f = bf16[8,8] fusion(%a, %b), kind=kCustom, calls=%g, backend_config={"fusion_'
        'backend_config":{"kind":"__triton_gemm","triton_gemm_config":{}}}') == "triton"
    assert gemm_rates.implementation_of(
        'custom_call_target="__cudnn$blockScaledDot"') == "cudnn"
    assert gemm_rates.implementation_of("%d = f32[8,8] dot(%a, %b)") == "unknown"


def test_device_kinds_map_to_the_cost_models_chips():
    assert estimate.chip_name("NVIDIA H200") == "h200"
    assert estimate.chip_name("NVIDIA H100 80GB HBM3") == "h100"
    assert estimate.chip_name("NVIDIA B200") == "b200"
    assert estimate.chip_name("NVIDIA GB200") == "b200"
    assert estimate.chip_name("cpu") is None


def test_the_models_estimate_per_class_covers_the_programs_kernels():
    text = (DATA / "cpu_step.hlo.txt").read_text()
    est = estimate.model_estimate_us(text, "h200")
    assert set(est) == {"gemm bf16", "fusion/quantize"}
    assert all(us > 0 for us in est.values())
    assert estimate.model_estimate_us(text, None) == {}
    assert estimate.model_estimate_us(text, "cpu") == {}


def test_without_a_gpu_it_says_so_and_how_to_check(capsys):
    assert profile.main(["--budget-s", "10"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--policies", "bogus"], "--policies: 'bogus': unknown policy"),
    (["--budget-s", "0"], "--budget-s and --tests-budget-s"),
    (["--tag", "a/b"], "--tag"),
    (["--sections", "gemms,bogus"], "--sections: expected a comma-separated subset"),
])
def test_bad_arguments_name_the_option(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        profile.main(["--dry-run", *argv])
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def _dry_run(tmp_path, policies: str, sections: str = "gemms,rates,layers",
             budget_s: int = 300) -> dict:
    # The script's clock starts when its process starts (bench.device.harness.T0, at import);
    # in pytest the module was imported at collection, maybe minutes earlier on a loaded
    # machine: start the clock now, as a fresh process would.
    mp = pytest.MonkeyPatch()
    mp.setattr(harness, "T0", time.perf_counter())
    # The watchdog (os._exit) must not fire inside pytest: a hard limit far away.
    try:
        code = _profile_main(policies, sections, budget_s, tmp_path)
    finally:
        mp.undo()
    assert code == 0
    (path,) = tmp_path.glob("cpu-*-dry.json")
    doc = json.loads(path.read_text())
    measurements_file.check(doc)
    return doc


def _profile_main(policies, sections, budget_s, tmp_path) -> int:
    return profile.main(["--dry-run", "--tests", "--budget-s", str(budget_s),
                         "--hard-limit-s", str(budget_s + 3000),
                         "--policies", policies, "--sections", sections, "--out-dir",
                         str(tmp_path), "--tag", "dry"])


@pytest.mark.slow
def test_dry_run_writes_a_schema_valid_measurement_file(tmp_path, capsys):
    doc = _dry_run(tmp_path, "bf16")
    out = capsys.readouterr().out
    assert doc["chip"] == "cpu" and doc["provenance"]["command"].endswith("--tag dry")
    assert doc["gemms"] and doc["gemms"][0]["operands"] == "bf16"
    assert doc["copy_bandwidth_gbs"] > 0
    assert [(r["program"], r["policy"]) for r in doc["layers"]] == [("layer_tiny", "bf16/fused")]
    assert {k["class"] for k in doc["kernels"]} >= {"gemm bf16"}
    assert re.search(r"GPU tests +not run \(--dry-run\)", out)
    assert out.rstrip().endswith("=" * 100)  # the table is printed last


def test_the_bf16_baseline_is_added_when_not_asked_for():
    _, rows = profile._args(["--policies", "fp8"])
    assert [r.label for r in rows] == ["bf16/fused", "fp8/fused"]


def test_sections_run_in_their_order_whatever_the_option_says():
    args, _ = profile._args(["--sections", "layers,gemms"])
    assert args.sections == ("gemms", "layers")


@pytest.mark.slow
def test_dry_run_of_every_default_policy(tmp_path):
    doc = _dry_run(tmp_path, profile.POLICIES, "layers", budget_s=3000)
    assert [r["policy"] for r in doc["layers"]] == [
        "bf16/fused", "fp8/fused", "mxfp4_all_h16@auto/fused", "nvfp4@auto/fused",
        "mxfp8@auto/fused"]


def test_the_estimate_beside_each_class_is_the_calibrated_model():
    """The 8B fp8 layer as the H200 run compiled it (committed HLO and instruction counts):
    the per-class estimate sums to the calibrated model's time, not the peak roofline's."""
    from bench.costmodel import accelerator_cost, aot, calibrated

    stem = calibrated.COMPILED_DIR / "h200-2026-12-04-b" / "layer_8b_fp8"
    ks, counts = calibrated.load_counts(stem)
    with gzip.open(f"{stem}.hlo.txt.gz", "rt") as fh:
        text = fh.read()
    est = estimate.model_estimate_us(text, "h200", counts=counts)
    rates = calibrated.rates_for("h200")
    assert sum(est.values()) == pytest.approx(
        calibrated.program_seconds(ks, counts, rates) * 1e6)
    peak = accelerator_cost.rates_roofline(ks, aot.TARGETS["h200"]) * 1e6
    assert sum(est.values()) > 1.5 * peak  # the H200 ran FP8 GEMMs at 46% of FP8's peak
    classes = trace.hlo_classes(text)
    for cls in ("gemm e4m3xe4m3", "gemm e5m2xe4m3"):  # 46% of FP8's peak, not 100%
        at_peak = sum(accelerator_cost.rates_roofline([k], aot.TARGETS["h200"])
                      for k in ks if classes.get(k.name) == cls) * 1e6
        assert est[cls] > 1.8 * at_peak, (cls, est[cls], at_peak)
    # Without the dump's counts, fusions are charged by their bytes: less, never more.
    bare = estimate.model_estimate_us(text, "h200")
    assert bare["fusion/quantize"] < est["fusion/quantize"]
    assert "calibrated" in estimate.MODEL_NAME
    with pytest.raises(ValueError, match="not both"):
        estimate.model_estimate_us(text, "h200", dump="/nonexistent", counts=counts)
