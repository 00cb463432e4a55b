"""bench/device/trace.py on recorded traces (tests/data/traces/README.md says how each was
made): per-kernel device totals and classes from a real CPU profile and from a GPU-shaped
one, the derived lines not counted twice, and a clear error for a bad or missing trace."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench.device import trace as T

DATA = Path(__file__).resolve().parent / "data" / "traces"
CPU_TRACE = DATA / "cpu_step.trace.json.gz"
GPU_TRACE = DATA / "gpu_step.trace.json.gz"


def _events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_fixtures_are_small():
    for path in DATA.iterdir():
        assert path.stat().st_size < 200_000, path


def test_cpu_profile_totals_and_classes_from_the_programs_hlo():
    classes = T.hlo_classes((DATA / "cpu_step.hlo.txt").read_text())
    kernels = T.kernel_times(T.load_trace(CPU_TRACE), classes)
    # Three calls were traced; XLA:CPU ran two thunks per call: the dot, then the rest.
    assert {(k.name, k.kernel_class, k.count) for k in kernels} == {
        ("ynn_fusion", "gemm bf16", 3), ("transpose_copy_fusion", "fusion/quantize", 3)}
    for k in kernels:  # the totals are the sums of the op events' durations
        durs = [e["dur"] for e in _events(CPU_TRACE)
                if e.get("ph") == "X" and e.get("args", {}).get("hlo_op") == k.hlo_op]
        assert k.total_us == pytest.approx(sum(durs)) and len(durs) == 3
    assert kernels[0].total_us >= kernels[1].total_us  # longest first


def test_gpu_profile_counts_stream_kernels_once_and_classes_them():
    # The GEMMs' operand types come from the program's HLO (here given directly).
    classes = {"custom-call.3": "gemm bf16", "custom-call.7": "gemm e4m3xe4m3"}
    kernels = T.kernel_times(T.load_trace(GPU_TRACE), classes, hlo_module="jit_step")
    got = {k.hlo_op: (k.kernel_class, k.count, k.total_us) for k in kernels}
    assert got == {
        "custom-call.3": ("gemm bf16", 2, 824.0),
        "custom-call.7": ("gemm e4m3xe4m3", 2, 410.0),
        "custom-call.9": ("attention", 2, 602.0),
        "loop_convert_fusion.2": ("fusion/quantize", 2, 40.0),
        "input_reduce_fusion": ("fusion/quantize", 2, 24.0),
        "copy-start.1": ("copy", 2, 16.0),
    }
    # Not counted: the XLA Ops/XLA Modules lines (the same time again) and host events.
    stream_us = sum(e["dur"] for e in _events(GPU_TRACE)
                    if e.get("ph") == "X" and e["pid"] == 1001 and e["tid"] in (20, 21)
                    and e["args"].get("hlo_module") == "jit_step")
    assert sum(k.total_us for k in kernels) == pytest.approx(stream_us)
    assert T.class_totals(kernels) == {"gemm bf16": 824.0, "gemm e4m3xe4m3": 410.0,
                                       "attention": 602.0, "fusion/quantize": 64.0,
                                       "copy": 16.0}


def test_gpu_kernels_without_the_hlo_are_classed_by_name():
    kernels = T.kernel_times(T.load_trace(GPU_TRACE))
    by_name = {k.name: k.kernel_class for k in kernels}
    assert by_name["nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT"] == "gemm ?"
    assert by_name["cudnn_generated_fort_native_sdpa_sm90_flash_fprop"] == "attention"
    assert by_name["MemcpyH2D"] == "copy"  # another module's: counted without hlo_module


def test_a_kernel_without_its_hlo_op_is_found_by_the_fusions_name():
    # Inside a CUDA graph a kernel may carry only its name: XLA's fusion name, '.' -> '_'.
    events = [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name",
               "args": {"name": "Stream #7(Compute)"}},
              {"ph": "X", "pid": 2, "tid": 7, "ts": 0.0, "dur": 5.0, "name": "gemm_fusion_dot_4"},
              {"ph": "X", "pid": 2, "tid": 7, "ts": 9.0, "dur": 2.0, "name": "input_fusion_1",
               "args": {"hlo_op": "%input_fusion.1"}}]
    classes = {"gemm_fusion_dot.4": "gemm e4m3xe4m3", "input_fusion.1": "fusion/quantize"}
    got = {k.name: (k.hlo_op, k.kernel_class) for k in
           T.kernel_times({"traceEvents": events}, classes)}
    assert got == {"gemm_fusion_dot_4": ("", "gemm e4m3xe4m3"),
                   "input_fusion_1": ("input_fusion.1", "fusion/quantize")}


def test_a_log_dir_finds_the_newest_runs_trace(tmp_path):
    for run, payload in (("2026_01_01_00_00_00", b"old"), ("2026_01_02_00_00_00", None)):
        d = tmp_path / "plugins" / "profile" / run
        d.mkdir(parents=True)
        (d / "host.trace.json.gz").write_bytes(payload or GPU_TRACE.read_bytes())
    assert T.find_trace_file(tmp_path).parent.name == "2026_01_02_00_00_00"


@pytest.mark.parametrize("content, match", [
    (None, "no such trace file"),
    (b"", "no \\*.trace.json.gz under it"),
    (b"\x1f\x8b\x08not gzip at all", "not a readable trace"),
    (b"{\"displayTimeUnit\": \"ns\"}", "no 'traceEvents' list"),
    (json.dumps({"traceEvents": [{"ph": "M", "pid": 1, "name": "process_name",
                                  "args": {"name": "/host:CPU"}}]}).encode(),
     "no kernel events"),
])
def test_bad_or_missing_trace_is_a_clear_error(tmp_path, content, match):
    path = tmp_path / "missing"
    if content == b"":
        path.mkdir()
    elif content is not None:
        path = tmp_path / "t.trace.json.gz"
        path.write_bytes(content)
    with pytest.raises(T.TraceError, match=match) as e:
        T.kernel_times(T.load_trace(path))
    assert str(path) in str(e.value) or "no kernel events" in str(e.value)


def test_a_module_the_trace_does_not_hold_is_named():
    with pytest.raises(T.TraceError, match="of HLO module 'jit_other'"):
        T.kernel_times(T.load_trace(GPU_TRACE), hlo_module="jit_other")
