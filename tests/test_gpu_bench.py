"""bench/device/gpu.py's parts that run before or around the device work: the --layer-policies and
--sections parsers, the budget shares, error cells, and the layer8b section on CPU (a tiny
layer) with one row that cannot be built."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.device import gpu, harness
from bench.device.sections import layer8b


def test_default_layer_rows():
    rows = layer8b.parse_layer_rows(layer8b.LAYER_ROWS)
    assert [(r.policy, r.backend, r.attention) for r in rows] == [
        ("bf16", None, "fused"), ("bf16", None, "explicit"), ("fp8", None, "fused"),
        ("mxfp4_all_h16", None, "fused"), ("mxfp4_all_h16", "xla_fp8", "fused"),
        ("mxfp4_all_h16", "xla_fp4", "fused"), ("nvfp4", None, "fused")]
    assert [r.is_baseline for r in rows] == [True] + [False] * 6
    # xla_fp4 (Blackwell only) and nvfp4: if time remains
    assert [r.optional for r in rows] == [False] * 5 + [True, True]
    assert rows[0].preset == "passthrough"  # 'bf16' is the deprecated alias


@pytest.mark.parametrize("text, match", [
    ("bogus", "unknown policy 'bogus'"),
    ("bf16/flash", "attention must be one of"),
    ("fp8@", "empty backend"),
    (" , ", "no rows"),
])
def test_layer_rows_errors_name_the_option(text, match):
    with pytest.raises(ValueError, match=match) as e:
        layer8b.parse_layer_rows(text)
    assert str(e.value).startswith("--layer-policies")


def test_repeated_layer_row_is_timed_once():
    rows = layer8b.parse_layer_rows("fp8,fp8/fused,fp8/explicit")
    assert [r.attention for r in rows] == ["fused", "explicit"]


def test_sections_run_in_fixed_order_and_unknown_names_fail():
    assert gpu._parse_sections("gemm,layer8b,tests") == ("tests", "layer8b", "gemm")
    with pytest.raises(ValueError, match=r"--sections: unknown \['bogus'\]"):
        gpu._parse_sections("gemm,bogus")


def test_budget_shares_pass_unused_time_on():
    budget = harness.Budget(harness.elapsed() + 100.0, ["ceilings", "layer8b", "gemm"])
    now = harness.elapsed()
    first = budget.start("ceilings") - now
    assert first == pytest.approx(100.0 * 10 / 250, abs=0.5)
    # ceilings ended at once: layer8b gets its weight's share of all that is left
    second = budget.start("layer8b") - harness.elapsed()
    assert second == pytest.approx(100.0 * 170 / 240, abs=0.5)
    assert budget.start("gemm") == pytest.approx(budget.total_s, abs=0.5)  # the last: the rest


def test_short_error_keeps_the_end_of_a_long_message():
    e = ValueError("backend must be one of " + ", ".join(f"'b{i}'" for i in range(40)) +
                   ", got 'xla_fp8'")
    text = harness.short_error(e, limit=80)
    assert len(text) == 80
    assert text.startswith("n/a: ValueError: backend must be one of")
    assert text.endswith("got 'xla_fp8'")


@pytest.mark.slow
def test_layer8b_section_on_cpu_times_rows_and_reports_an_unknown_backend():
    table = harness.Table()
    rows_spec = layer8b.parse_layer_rows("bf16/fused,mxfp4_all_h16@no_such_backend")
    sizes = harness.SMOKE
    layer8b.layer8b_section(table, sizes, time.perf_counter() - harness.T0 + 600.0, rows_spec)
    (_, rows), = table.sections
    header, base, bad = rows[:3]
    cells = dict(zip(header, base))
    assert cells["n"] == str(layer8b.MIN_ROUNDS) and cells["vs bf16/fused"] == " 1.00x"
    assert float(cells["ms (median)"]) > 0 and float(cells["compile s"]) > 0
    cells = dict(zip(header, bad))
    assert cells["ms (median)"] == "n/a"
    assert cells["note"].startswith("n/a: ValueError") and "no_such_backend" in cells["note"]
    assert isinstance(rows[3], str) and rows[3].startswith("program: tiny layer")
    assert "skipped" not in harness.Table.render(table)


def test_layer8b_ratio_falls_back_to_another_bf16_row_and_says_so():
    table = harness.Table()
    rows_spec = layer8b.parse_layer_rows("bf16/explicit,bf16@no_such_backend/fused")
    deadline = time.perf_counter() - harness.T0 + 600.0
    layer8b.layer8b_section(table, harness.SMOKE, deadline, rows_spec)
    (_, rows), = table.sections
    cells = dict(zip(rows[0], rows[1]))
    assert cells["vs bf16/fused"] == " 1.00x"
    assert cells["note"] == "ratio to bf16/explicit (no bf16/fused)"


def test_layer8b_optional_row_is_compiled_after_the_first_rounds():
    table = harness.Table()
    rows_spec = layer8b.parse_layer_rows("bf16?,bf16/explicit")
    deadline = time.perf_counter() - harness.T0 + 600.0
    layer8b.layer8b_section(table, harness.SMOKE, deadline, rows_spec)
    (_, rows), = table.sections
    got = {r[2]: dict(zip(rows[0], r)) for r in rows[1:3]}
    rounds = harness.SMOKE.layer_rounds
    assert got["fused"]["n"] == str(rounds)  # only the rounds after its compile
    assert got["explicit"]["n"] == str(2 * rounds)  # before it and after it
    assert got["fused"]["vs bf16/fused"] == " 1.00x"


def test_the_gpu_test_files_exist():
    """The tests section runs files by path: a moved test file must be followed here."""
    from pathlib import Path

    from bench.device.sections import gpu_tests

    root = Path(__file__).resolve().parents[1]
    missing = [f for f in gpu_tests.GPU_TEST_FILES if not (root / f).is_file()]
    missing += [d for d in gpu_tests.QUICK_TESTS_DESELECT
                if not (root / d.split("::")[0]).is_file()]
    assert not missing, missing


def test_watchdog_kills_the_child_group_keeps_the_run_and_exits_3(tmp_path):
    """The watchdog both device scripts share (it calls os._exit, so it runs in a child)."""
    import subprocess
    import sys

    kept = tmp_path / "kept"
    script = f"""
import subprocess, time
from bench.device import harness
child = subprocess.Popen(["sleep", "60"], start_new_session=True)
harness.STATE["child"] = child
harness.log("waiting")
table = harness.Table()
harness.start_watchdog(harness.elapsed() + 0.2, table, keeping="keeping",
                       keep=lambda: open({str(kept)!r}, "w").write(str(child.pid)))
time.sleep(30)
"""
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert "watchdog: --hard-limit-s" in done.stdout and "while: waiting; keeping" in done.stdout
    stat = Path(f"/proc/{int(kept.read_text())}/stat")
    # Killed: gone, or a zombie where nothing reaps orphans.
    assert not stat.exists() or stat.read_text().split(")")[1].split()[0] == "Z"
