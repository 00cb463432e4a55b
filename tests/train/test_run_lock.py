"""train.run_lock: one live run per directory; a killed run's lock is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

import pytest

from tests.train.rundir_testutil import lock_holder, run_read_only
from tests.train.train_testutil import ROOT
from train.run_lock import LOCK_NAME, RunLock, RunLockError, acquire_for_run


def test_second_holder_is_refused_naming_the_first(tmp_path):
    with RunLock(tmp_path / "run") as first:
        assert first.held
        with pytest.raises(RunLockError, match=rf"in use by another run \(host "
                                               rf"{socket.gethostname()}, pid {os.getpid()},"):
            RunLock(tmp_path / "run").acquire()
    # released cleanly: free again, no stale record
    with RunLock(tmp_path / "run") as again:
        assert again.held
    assert (tmp_path / "run" / LOCK_NAME).read_text() == ""


def test_live_process_holds_killed_process_is_taken_over(tmp_path):
    run = tmp_path / "run"
    with lock_holder(run) as child:
        with pytest.raises(RunLockError, match=rf"pid {child.pid}, .*command: .*-c") as e:
            RunLock(run).acquire()
        assert "choose another --out" in str(e.value)
        record = json.loads((run / LOCK_NAME).read_text())
        assert record["pid"] == child.pid and record["host"] == socket.gethostname()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        lock = RunLock(run)
        stale = lock.acquire()  # the kernel dropped the dead process's lock
        try:
            assert stale is not None and stale.pid == child.pid
            assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
        finally:
            lock.release()


def test_acquire_for_run_single_process(tmp_path):
    lock, stale = acquire_for_run(tmp_path / "r")
    try:
        assert lock is not None and lock.held and stale is None
        with pytest.raises(RunLockError, match="in use by another run"):
            acquire_for_run(tmp_path / "r")
    finally:
        lock.release()


def test_holder_record_that_is_garbage_still_refuses(tmp_path):
    run = tmp_path / "run"
    with RunLock(run):
        (run / LOCK_NAME).write_text("not json")
        with pytest.raises(RunLockError, match="has not written its record"):
            RunLock(run).acquire()


_TRY = ("import sys\n"
        "from train.run_lock import RunLock, RunDirNotWritable\n"
        "try:\n"
        "    RunLock(sys.argv[1]).acquire()\n"
        "except RunDirNotWritable as e:\n"
        "    print('NOTWRITABLE', e)\n")


def test_read_only_directory_is_a_clear_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    r = run_read_only(tmp_path, [sys.executable, "-c", _TRY, str(run)],
                      env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("NOTWRITABLE output directory"), r.stdout + r.stderr[-2000:]
    assert str(run) in r.stdout and "choose another --out" in r.stdout
    assert not (run / LOCK_NAME).exists()
