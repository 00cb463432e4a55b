"""bench/costmodel/calibration.py: the measurement files a device run writes, read and
checked; a bad file is refused with its name and the field at fault."""

from __future__ import annotations

import copy
import json

import pytest

from bench.costmodel import calibration as cal

GOOD = {
    "schema": 1, "chip": "h100",
    "provenance": {"date": "2026-12-07", "jax": "0.11.2", "command": "python3 bench/device/x.py",
                   "commit": "0" * 40, "device": "NVIDIA H100 80GB HBM3"},
    "gemms": [{"operands": "e4m3xe4m3", "m": 8192, "n": 4096, "k": 4096,
               "implementation": "cublaslt", "setting": "fast accumulation", "tflops": 901.5}],
    "copy_bandwidth_gbs": 3000.0, "launch_overhead_us": None,
    "layers": [{"program": "layer_8b", "seq": 8192, "policy": "bf16", "ms": 25.0}],
    "kernels": [{"policy": "fp8", "class": "gemm fp8", "name": "cublasLt", "count": 18,
                 "total_us": 9000.0}],
}


def _write(tmp_path, doc, name="h100-2026-12-07.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_a_good_file_reads_back_field_for_field(tmp_path):
    run = cal.load(_write(tmp_path, GOOD))
    assert run.chip == "h100" and run.provenance.commit == "0" * 40
    (g,) = run.gemms
    assert (g.operands, g.m, g.n, g.k, g.implementation, g.tflops) == (
        "e4m3xe4m3", 8192, 4096, 4096, "cublaslt", 901.5)
    assert run.copy_bandwidth_gbs == 3000.0 and run.launch_overhead_us is None
    assert run.layer_ms("bf16") == 25.0
    assert run.kernel("cublasLt").kind == "gemm fp8" and run.kernel("cublasLt").count == 18
    with pytest.raises(KeyError, match="no layer row"):
        run.layer_ms("fp8")


def test_the_committed_h200_files_load_with_their_provenance():
    runs = cal.for_chip("h200")
    assert [r.path.name for r in runs] == ["h200-2026-12-04-a.json", "h200-2026-12-04-b.json"]
    first, second = runs
    assert first.provenance.commit.startswith("be6671a")
    assert second.provenance.commit.startswith("7544543")
    assert first.layer_ms("mxfp4_all_h16@xla_fp8 (pallas quantizer)") == 120.7
    assert second.layer_ms("mxfp4_all_h16@xla_fp8") == 27.41
    # What the run did not measure is null, not a guess.
    assert first.launch_overhead_us is None and second.copy_bandwidth_gbs is None


def _bad(mutate):
    doc = copy.deepcopy(GOOD)
    mutate(doc)
    return doc


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(schema=2), r'"schema": 1'),
    (lambda d: d.pop("layers"), r"missing \['layers'\]"),
    (lambda d: d.update(extra=1), r"unknown \['extra'\]"),
    (lambda d: d["gemms"][0].update(operands="fp8"), r"gemms\[0\]\.operands: expected one of"),
    (lambda d: d["gemms"][0].update(implementation="cublas"),
     r"gemms\[0\]\.implementation: expected one of"),
    (lambda d: d["gemms"][0].update(m=0), r"gemms\[0\]\.m: expected a positive integer"),
    (lambda d: d["gemms"][0].update(tflops="fast"), r"gemms\[0\]\.tflops: expected a positive"),
    (lambda d: d["gemms"][0].update(tflops=None), r"gemms\[0\]\.tflops: expected a positive"),
    (lambda d: d.update(copy_bandwidth_gbs=-1.0), r"copy_bandwidth_gbs: .* or null"),
    (lambda d: d["layers"][0].update(ms=True), r"layers\[0\]\.ms: expected a positive number"),
    (lambda d: d["kernels"][0].update(count=1.5), r"kernels\[0\]\.count: expected a positive"),
    (lambda d: d["provenance"].update(commit=""), r"provenance\.commit: expected a non-empty"),
    (lambda d: d["provenance"].pop("device"), r"provenance: expected the fields"),
    (lambda d: d.update(chip="b200"), r"file name must be <chip>-<date>\.json"),
    (lambda d: d["provenance"].update(date="2026-12-08"), r"'2026-12-08'; rename it"),
])
def test_a_bad_file_is_refused_naming_the_file_and_the_field(tmp_path, mutate, match):
    path = _write(tmp_path, _bad(mutate))
    with pytest.raises(cal.CalibrationError, match=match) as err:
        cal.load(path)
    assert str(path) in str(err.value)


def test_unreadable_and_missing_files_are_refused(tmp_path):
    path = tmp_path / "h100-2026-12-07.json"
    path.write_text("{not json")
    with pytest.raises(cal.CalibrationError, match="not valid JSON"):
        cal.load(path)
    with pytest.raises(cal.CalibrationError, match="cannot read"):
        cal.load(tmp_path / "h100-2026-12-08.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(cal.CalibrationError, match="no calibration file for chip 'b200'"):
        cal.for_chip("b200", empty)
    with pytest.raises(cal.CalibrationError, match="no calibration directory"):
        cal.load_all(tmp_path / "nowhere")


def test_a_tagged_name_is_one_more_run_of_the_day(tmp_path):
    assert cal.load(_write(tmp_path, GOOD, "h100-2026-12-07-second.json")).chip == "h100"
