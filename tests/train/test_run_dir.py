"""A run directory end to end: one live run at a time, read-only directories, eval settings
fixed for a run's history, and a non-finite stop that keeps (and names) the last good
checkpoint."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.train.rundir_testutil import run_read_only
from tests.train.train_testutil import ROOT, fast_sets, load, xla_flags
from train import loop
from train.__main__ import main
from train.checkpoint import Checkpointer, IncompatibleCheckpointError
from train.output.metrics import read_jsonl


def _cli_args(out, cache, *extra) -> list[str]:
    return ["--quiet", *[a for s in fast_sets(out, cache, *extra) for a in ("--set", s)]]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def done(tmp_path_factory, cache):
    """A finished 4-step run with checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("done") / "run"
    cfg = load(out, cache, "train.steps=4", "checkpoint.every=2")
    s = loop.run(cfg, verbose=False)
    assert s.status == "completed"
    return out


@pytest.mark.slow
def test_second_live_run_on_one_out_is_refused(tmp_path, cache, done):
    """Run A trains (slowly: many steps); run B with the same --out exits 5 naming A.

    (make test-slow: ~24 CPU-s, A trains at full speed while B starts.) The default run
    keeps the lock's refusal of a live holder, named, with a real second process
    (tests/train/test_run_lock.py::test_live_process_holds_killed_process_is_taken_over,
    test_second_holder_is_refused_naming_the_first) and the CLI's exit 5 for an output
    directory error (test_run_faults.py::test_checkpoints_path_that_is_a_file_is_exit_5)."""
    out = tmp_path / "run"
    args = _cli_args(out, cache, "train.steps=100000", "checkpoint.every=0",
                     "train.eval_at_start=false")
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags())
    a = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and a.poll() is None:  # until A owns the dir or trains
            lock = out / ".run.lock"
            if (lock.exists() and lock.read_text()) or (
                    (out / "metrics.jsonl").exists() and read_jsonl(out / "metrics.jsonl")):
                break
            time.sleep(0.05)
        assert a.poll() is None, a.stderr.read()[-3000:]
        try:  # B must refuse at start; without a lock it would train on (and time out)
            b = subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=120, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail("a second run on a busy --out did not refuse to start")
        assert a.poll() is None  # A was alive all along
    finally:
        os.killpg(a.pid, signal.SIGKILL)
        a.wait(timeout=60)
        a.stderr.close()
    assert b.returncode == 5, b.stderr[-3000:]
    assert f"in use by another run (host {os.uname().nodename}, pid {a.pid}," in b.stderr
    assert "output directory error:" in b.stderr
    # A's records only: B wrote none
    recs = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1))


@pytest.mark.slow
def test_completed_run_in_read_only_dir_reports_and_exits_0(done, cache):
    before = {p: p.stat().st_mtime_ns for p in done.rglob("*")}
    r = run_read_only(done, [sys.executable, "-m", "train",
                             *_cli_args(done, cache, "train.steps=4", "checkpoint.every=2")],
                      env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "run already complete; nothing to do" in r.stdout, r.stdout
    assert "final eval loss: " in r.stdout and " after 4 steps" in r.stdout
    assert {p: p.stat().st_mtime_ns for p in done.rglob("*")} == before


@pytest.mark.slow
def test_incomplete_run_in_read_only_dir_is_a_clear_error(done, cache, tmp_path):
    run = tmp_path / "partial"
    shutil.copytree(done, run)
    shutil.rmtree(run / "checkpoints" / "4")
    (run / "summary.json").unlink()
    r = run_read_only(run, [sys.executable, "-m", "train",
                            *_cli_args(run, cache, "train.steps=4", "checkpoint.every=2")],
                      env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 5, r.stderr[-3000:]
    assert f"output directory error: output directory {run} is not writable" in r.stderr
    assert "Traceback" not in r.stderr


def test_changed_eval_settings_are_refused(done, cache):
    cfg = load(done, cache, "train.steps=4", "checkpoint.every=2", "train.eval_sequences=24")
    with pytest.raises(IncompatibleCheckpointError,
                       match=r"eval: eval_sequences: 16 -> 24\n.*two validation sets"):
        loop.run(cfg, verbose=False)


def test_nonfinite_stop_keeps_and_names_the_last_good_checkpoint(tmp_path, cache, capsys):
    """lr=1e30: step 1 is finite and blows the weights up; steps 2.. are non-finite. With
    keep=1 and a checkpoint every step, the streak's checkpoints must not evict step 1, and
    the CLI must not present the step-0 eval as the final one."""
    out = tmp_path / "nan"
    code = main(_cli_args(out, cache, "optim.lr=1e30", "optim.warmup_steps=0",
                          "train.steps=10", "train.max_nonfinite=3", "checkpoint.every=1",
                          "checkpoint.keep=1", "train.plot=false"))
    printed = capsys.readouterr().out
    assert code == 3, printed
    recs = read_jsonl(out / "metrics.jsonl")
    assert [r.get("nonfinite", False) for r in recs] == [False, False, True, True, True]
    with Checkpointer(out / "checkpoints", keep=1) as ck:
        assert ck.steps() == [1, 3]  # the newest, and the last good one
    assert f"Last good checkpoint: step 1 in {out}/checkpoints" in printed
    assert "last eval loss: " in printed and " at step 0, none after it; stopped after 4 steps" \
        in printed
    assert "final eval loss" not in printed
