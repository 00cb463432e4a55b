"""train.preemption: the first SIGTERM/SIGINT is a stop request, the second ends the process.

The end-to-end checks (a real SIGTERM mid-run: exit 75, a checkpoint at the stop step, a
bit-identical resume; one signalled process of two stopping both at the same step) are in
test_train_resume.py and test_two_process_resume.py, beside the kill tests they extend.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.train.train_testutil import ROOT
from train import preemption
from train.preemption import StopSignals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_is_a_request_and_handlers_are_restored(sig):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    logged = []
    with StopSignals(log=logged.append) as stop:
        assert stop.installed and stop.requested is None
        os.kill(os.getpid(), sig)  # delivered to this (main) thread before the next bytecode
        assert stop.requested == signal.Signals(sig).name
        # a second signal of either kind now takes the default action: the process ends
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    assert {s: signal.getsignal(s) for s in before} == before
    assert len(logged) == 1 and "finishing the current step" in logged[0]
    assert "send it again to exit at once" in logged[0]


def test_outside_the_main_thread_nothing_is_installed():
    seen = {}

    def body():
        with StopSignals() as stop:
            seen["installed"] = stop.installed
            seen["handler"] = signal.getsignal(signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"installed": False, "handler": before}


def test_agree_on_one_process_is_the_local_code():
    for code in (preemption.STOP_NONE, preemption.STOP_SIGNAL, preemption.STOP_DATA_ERROR,
                 preemption.STOP_WRITE_FAILED):
        assert preemption.agree(code) == code
    # the more serious reason wins when processes disagree
    assert preemption.STOP_NONE < preemption.STOP_SIGNAL < preemption.STOP_DATA_ERROR \
        < preemption.STOP_WRITE_FAILED


def test_second_signal_ends_the_process_at_once():
    script = ("import os, signal, time\n"
              "from train.preemption import StopSignals\n"
              "with StopSignals(log=lambda m: None) as s:\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    print('first:', s.requested, flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(30)\n"
              "    print('not reached', flush=True)\n")
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=25, check=False)
    assert p.stdout == "first: SIGINT\n", p.stdout + p.stderr
    assert p.returncode == -signal.SIGTERM
    assert "Traceback" not in p.stderr


def test_interrupting_raises_at_once_and_only_inside():
    """Inside `interrupting` a stop signal abandons what runs (a data pipeline spinning or
    waiting), as StopRequested; `requested` is set either way."""
    with StopSignals(log=lambda m: None) as stop:
        with pytest.raises(preemption.StopRequested), stop.interrupting():
            os.kill(os.getpid(), signal.SIGTERM)
            while True:  # a spin that would never end
                pass
        assert stop.requested == "SIGTERM"
    with StopSignals(log=lambda m: None) as stop:
        os.kill(os.getpid(), signal.SIGINT)  # before the block: nothing raised inside
        with stop.interrupting():
            pass
        assert stop.requested == "SIGINT"


def test_a_stop_signal_while_the_loader_spins_saves_and_stops(tmp_path, data_cache, monkeypatch):
    """Issue 45: a run whose data pipeline spun (an empty shard) ignored SIGTERM. A signal
    while the next batch is awaited stops the run at once: the last step is checkpointed,
    status preempted (exit 75)."""
    import time

    from tests.train.data.stream_testutil import within
    from tests.train.train_testutil import load
    from train import loop
    from train.checkpoint import Checkpointer
    from train.data.loader import TrainLoader

    real = TrainLoader.batch

    def spin_at_two(self, step):
        if step == 2:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
            while True:
                time.sleep(0.01)
        return real(self, step)

    monkeypatch.setattr(TrainLoader, "batch", spin_at_two)
    cfg = load(tmp_path / "run", data_cache, "train.steps=5", "checkpoint.every=0")
    with within(120):
        s = loop.run(cfg, verbose=False)
    assert s.status == "preempted" and s.steps == 2, s.message
    with Checkpointer(tmp_path / "run" / "checkpoints", keep=3) as ck:
        assert ck.latest_step() == 2
