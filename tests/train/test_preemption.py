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
