"""What a newcomer hit on the command line: --quiet is
quiet; the compile is announced and timed; the ETA counts steps only; summary.json after a
resume holds the whole run and each segment; `train.data prepare` on a cache it cannot write
is exit 6; --check refuses an --out that is a file; ``--set train.steps=1e3`` is 1000."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest

from tests.file_faults import file_size_limit
from tests.train.rundir_testutil import run_read_only
from tests.train.train_testutil import ROOT, fast_sets
from train import config as cfgmod
from train.__main__ import main
from train.config import ConfigError
from train.data.__main__ import main as data_main
from train.output.metrics import Progress, read_jsonl

# The schedule of test_train_loop's base run: the same train step, served by the compile cache.
SCHEDULE = "optim.decay_steps=12"


def _args(out, cache, *extra):
    return [a for s in fast_sets(out, cache, SCHEDULE, *extra) for a in ("--set", s)]


def _err_lines(err: str) -> list[str]:
    # a "[train] note:" says the JAX compilation cache was set by an earlier test; "[data]"
    # lines report the data preparation's progress
    return [ln for ln in err.splitlines()
            if ln.strip() and not ln.startswith(("[train] note:", "[data] "))]


# --------------------------------------------------------------------------- items 4, 5, 10
@pytest.mark.slow
def test_quiet_prints_no_progress(tmp_path, data_cache, capsys):
    code = main(["--quiet", *_args(tmp_path / "run", data_cache, "train.steps=2",
                                   "train.progress=lines")])
    assert code == 0
    cap = capsys.readouterr()
    assert _err_lines(cap.err) == [], cap.err
    assert cap.out.startswith("status: completed")  # the result is still printed


@pytest.mark.slow
def test_compile_is_announced_and_the_summary_spans_the_resume(tmp_path, data_cache, capsys):
    """Two steps, then the same run to step 4 (a second segment, resumed from step 2)."""
    out = tmp_path / "run"
    args = _args(out, data_cache, "train.progress=lines", "checkpoint.every=2")
    assert main([*args, "--set", "train.steps=2"]) == 0
    lines = _err_lines(capsys.readouterr().err)
    i = lines.index("[train] compiling the train step (policy passthrough) ...")
    assert re.fullmatch(r"\[train\] train step compiled in \d+\.\d s; first step done in "
                        r"\d+\.\d s", lines[i + 1]), lines
    assert lines[i - 1].startswith("step 0/2 | eval ")  # the evaluation before training
    assert re.fullmatch(r"\[train\] first evaluation done in \d+\.\d s", lines[i - 2])
    assert lines[i - 3].startswith("[train] compiling the eval step (policy passthrough) and ")
    assert lines[i - 1].endswith("elapsed, ETA from step 2")  # no ETA before a step was timed
    assert ("[train] GEMM routes: fprop passthrough, dgrad passthrough, wgrad passthrough on "
            "cpu (backend auto)") in lines
    step1 = next(ln for ln in lines if ln.startswith("step 1/2"))
    assert step1.endswith("elapsed, ETA from step 2"), step1  # none from the compiling step
    step2 = next(ln for ln in lines if ln.startswith("step 2/2"))
    assert step2.endswith("elapsed"), step2
    first = json.loads((out / "summary.json").read_text())
    assert [(g["first_step"], g["last_step"]) for g in first["segments"]] == [(0, 2)]
    assert first["tokens_per_s"] == pytest.approx(first["segments"][0]["tokens_per_s"], rel=1e-3)
    assert first["tokens_per_s"] > 0
    assert first["routes"] == {"chip": "cpu", "backend": "auto", **dict.fromkeys(
        ("fprop", "dgrad", "wgrad"), "passthrough")}

    assert main([*args, "--set", "train.steps=4"]) == 0
    cap = capsys.readouterr()
    s = json.loads((out / "summary.json").read_text())
    assert s["resumed_from"] == 2
    seg = s["segments"]
    # the first segment as its checkpoint recorded it (at the save: its summary, written
    # after the files were closed, counts a little more)
    assert 0 < first["segments"][0]["wall_time_s"] - seg[0]["wall_time_s"] < 2.0
    assert {k: v for k, v in seg[0].items() if k != "wall_time_s"} == {
        k: v for k, v in first["segments"][0].items() if k != "wall_time_s"}
    assert [(g["first_step"], g["last_step"]) for g in seg] == [(0, 2), (2, 4)]
    # the run's wall time: both segments (before the fix, the second one's only)
    assert s["wall_time_s"] == pytest.approx(seg[0]["wall_time_s"] + seg[1]["wall_time_s"],
                                             abs=2e-3)
    assert s["wall_time_s"] > seg[1]["wall_time_s"]
    steady = sum(g["steady_steps"] for g in seg)
    assert steady == 2  # steps 2 and 4 (each segment's first step compiles)
    assert s["tokens_per_s"] == pytest.approx(
        512 * steady / sum(g["steady_s"] for g in seg), rel=1e-3)
    assert f"wall time {s['wall_time_s']:.1f}s" in cap.out
    assert "this segment (steps 2-4, 2 in all): wall time " in cap.out
    recs = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    assert recs[-1]["time_s"] <= s["wall_time_s"]  # cumulative too (setup excluded)


def test_eta_counts_steps_after_the_first():
    stream = io.StringIO()
    p = Progress(10, mode="lines", stream=stream)
    p.every = 1
    p.update(0, loss=None, tokens_per_s=None, eval_loss=3.0)
    p.update(1, loss=2.0, tokens_per_s=1.0, step_s=600.0)  # the compile
    p.update(2, loss=2.0, tokens_per_s=1.0, step_s=2.0)
    p.update(3, loss=2.0, tokens_per_s=1.0, step_s=4.0)
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("ETA from step 2")
    assert lines[1].endswith("ETA from step 2")
    assert lines[2].endswith("ETA 0m16s")  # 2 s x 8 steps left
    assert lines[3].endswith("ETA 0m21s")  # 3 s x 7
    assert p.eta_s(3) == pytest.approx(21.0)


# --------------------------------------------------------------------------- item 11
def _prepare_args(tmp_path, cache_dir):
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(f"document {i} has a few words " * 3 for i in range(60)))
    return ["prepare", "--source", str(src), "--vocab-size", "300", "--cache-dir",
            str(cache_dir)]


def test_prepare_on_a_full_cache_is_exit_6(tmp_path, capsys):
    dc = tmp_path / "dc"
    dc.mkdir()
    args = _prepare_args(tmp_path, dc)
    with file_size_limit(1000):  # a write past 1000 bytes fails as on a full disk
        code = data_main(args)
    assert code == 6
    err = capsys.readouterr().err
    assert len(_err_lines(err)) == 1 and "Traceback" not in err, err
    err = _err_lines(err)[0]
    assert err.startswith(f"I/O error: [Errno 27] cannot write the prepared data into {dc} "
                          "(File too large: ")


def test_prepare_with_a_file_as_cache_is_exit_6(tmp_path, capsys):
    (tmp_path / "dc").write_text("a file")
    assert data_main(_prepare_args(tmp_path, tmp_path / "dc")) == 6
    err = capsys.readouterr().err
    assert len(_err_lines(err)) == 1 and "Traceback" not in err, err
    assert f"cannot write the prepared data into {tmp_path}/dc" in err


def test_prepare_on_a_read_only_cache_is_exit_6(tmp_path):
    dc = tmp_path / "dc"
    dc.mkdir()
    r = run_read_only(dc, [sys.executable, "-m", "train.data", *_prepare_args(tmp_path, dc)],
                      env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 6, r.stderr
    assert len(_err_lines(r.stderr)) == 1 and "Traceback" not in r.stderr, r.stderr
    err = _err_lines(r.stderr)[0]
    assert err.startswith("I/O error: [Errno 30] cannot write the prepared data into "
                          f"{dc} (Read-only file system"), err


# --------------------------------------------------------------------------- item 13
def test_check_refuses_an_out_that_is_a_file(tmp_path, data_cache, capsys):
    f = tmp_path / "a-file"
    f.write_text("not a directory")
    for out in (f, f / "run"):
        assert main(["--check", "--quiet", *_args(tmp_path / "x", data_cache), "--out",
                     str(out)]) == 2
        cap = capsys.readouterr()
        lines = _err_lines(cap.err)
        assert json.loads(cap.out)["problems"] == lines  # after the memory estimate
        assert len(lines) == 1 and lines[0].startswith(f"config error: out_dir (--out) {out} ")
        assert "a file, not a directory; choose another output directory" in lines[0]
    assert f.read_text() == "not a directory"


@pytest.mark.parametrize("text,value", [("1e3", 1000), ("1.0e3", 1000), ("1000.0", 1000),
                                        ("1000", 1000), ("2E1", 20)])
def test_integer_settings_accept_whole_floats(text, value):
    cfg = cfgmod.load(None, [f"train.steps={text}"])
    assert cfg.train.steps == value and type(cfg.train.steps) is int


@pytest.mark.parametrize("text", ["2.5e0", "12.5", "1e400", "ten", "true", ".inf"])
def test_integer_settings_refuse_the_rest(text):
    with pytest.raises(ConfigError, match=r"^train\.steps: expected an integer, got "):
        cfgmod.load(None, [f"train.steps={text}"])
