"""bench/costmodel/ptx_cost.py's readers on a hand-written dump: launches from the thunk
sequence, Triton calls from the HLO, and their matching (kernel name less XLA's ``__N``
suffix, grid) to SASS counts; calls that match nothing are reported, not charged. The SASS
itself comes from ptxas (tests/accelerators/test_mxfp4_on_low_precision_units.py runs it
on a real dump)."""

from __future__ import annotations

import pytest

from bench.costmodel import ptx_cost

THUNKS = """\
001: kCustomKernel [source       | next=002 (1)] mxfp4_operand grid: [4, 2, 1] threads: [256, 1, 1]  shared_memory: 256 bytes
002: kCustomKernel [prev=001 (1) | next=003 (1)] loop_convert_fusion grid: [64, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
019: kConditional  [prev=002 (1) | next=020 (1)]
  true_branch:
    004: kCustomKernel [source       | next=005 (1)] mxfp4_operand__1 grid: [2, 4, 1] threads: [256, 1, 1]  shared_memory: 256 bytes
"""  # noqa: E501

TARGET = 'custom_call_target="__gpu$xla.gpu.triton"'
HLO = f"""\
  %pallas_call.12 = (u8[512,128]{{1,0}}) custom-call(%bitcast.95), {TARGET}, backend_config={{debug = false, grid_x = 4 : i32, grid_y = 2 : i32, grid_z = 1 : i32, name = "mxfp4_operand"}}
  %pallas_call.0 = (u8[256,256]{{1,0}}) custom-call(%bitcast.94), {TARGET}, backend_config={{debug = false, grid_x = 2 : i32, grid_y = 4 : i32, grid_z = 1 : i32, name = "mxfp4_operand"}}
  %pallas_call.7 = (u8[64,64]{{1,0}}) custom-call(%bitcast.9), {TARGET}, backend_config={{debug = false, grid_x = 1 : i32, grid_y = 1 : i32, grid_z = 1 : i32, name = "mxfp4_operand"}}
  %other = (u8[8]{{0}}) custom-call(%p), {TARGET}, backend_config={{debug = false}}
  %fusion.3 = f32[8]{{0}} fusion(%p), kind=kLoop, calls=%fused_computation
"""  # noqa: E501


@pytest.fixture
def dump(tmp_path):
    (tmp_path / "module_0001.jit_step.thunk_sequence.txt").write_text(THUNKS)
    return tmp_path


def test_launches_read_grids_and_threads_nested_ones_too(dump):
    assert ptx_cost.launches(dump) == {
        "mxfp4_operand": ((4, 2, 1), 2048),
        "loop_convert_fusion": ((64, 1, 1), 8192),
        "mxfp4_operand__1": ((2, 4, 1), 2048),
    }


def test_triton_calls_are_matched_by_name_and_grid(dump, monkeypatch):
    asked = []

    def sass(d, prefixes=None):
        asked.append(prefixes)
        return {"mxfp4_operand": 1000, "mxfp4_operand__1": 3000, "loop_convert_fusion": 40}

    monkeypatch.setattr(ptx_cost, "sass_kernels", sass)
    seconds, unmatched = ptx_cost.triton_call_seconds(HLO, dump, alu_ops_per_s=1e12)
    assert asked == [("mxfp4_operand",)]  # only modules holding the calls' kernels
    assert seconds == pytest.approx({"pallas_call.12": 2048 * 1000 / 1e12,
                                     "pallas_call.0": 2048 * 3000 / 1e12})
    # A grid no launch has, and a call without a kernel name: reported, not charged.
    assert unmatched == ["pallas_call.7", "other"]


def test_a_program_without_triton_calls_reads_nothing(tmp_path):
    assert ptx_cost.triton_call_seconds("%fusion = f32[8]{0} fusion(%p)", tmp_path, 1e12) == (
        {}, [])


def test_dump_options_name_the_folder_and_the_ptx_emitter(tmp_path):
    assert ptx_cost.dump_options(tmp_path) == {"xla_dump_to": str(tmp_path),
                                               "xla_dump_emitter_re": "ptx"}


def test_sass_lines_past_64_kb_are_counted(tmp_path, monkeypatch):
    """cuobjdump writes 5 hex digits of address past 0xffff: those instructions count too."""
    sass = ("        Function : k\n"
            "        /*fff0*/                   IMAD R1, R2, R3, R4 ;\n"
            "        /*10000*/                   EXIT ;\n"
            "        /*10010*/                   BRA 0x10010 ;\n")

    def run(cmd, **kw):
        class Done:
            stdout = sass
        return Done()

    monkeypatch.setattr(ptx_cost.subprocess, "run", run)
    monkeypatch.setattr(ptx_cost, "_nvidia_tool", lambda name: tmp_path / name)
    assert ptx_cost._sass_counts(tmp_path / "k.cubin") == {"k": 3}


def test_ptxas_info_gives_registers_and_spills_per_kernel():
    info = """ptxas info    : Compiling entry function 'a' for 'sm_90a'
ptxas info    : Function properties for a
    800 bytes stack frame, 936 bytes spill stores, 1140 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 800 bytes cumulative stack size
ptxas info    : Function properties for b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers
"""
    assert ptx_cost.parse_ptxas_info(info) == {"a": (255, 936, 1140), "b": (32, 0, 0)}
