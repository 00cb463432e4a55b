"""Preemption-safe runs: SIGTERM/SIGINT stop a run at a step boundary, after a checkpoint.

Schedulers, spot VMs and ``kubectl delete`` send SIGTERM (then SIGKILL after a
grace period); a user presses Ctrl-C (SIGINT). While `StopSignals` is entered
the first such signal only records a stop request: the trainer finishes the
step it is in, saves a checkpoint (also with ``checkpoint.every=0``), writes its
metrics and summary (status ``'preempted'``) and the CLI exits with
`PREEMPTED_EXIT`. Re-running the same command resumes bit-identically from that
checkpoint. A second signal ends the process at once, by the signal's default
action (a shell reports 130 for SIGINT, 143 for SIGTERM), even inside a long
compile or device call, leaving the files as a kill does: the previous
checkpoints intact (orbax renames a checkpoint into place only when complete).

Several processes (``--distributed``) must stop at the same step, or the
collectives of the next step (and the joint checkpoint) would hang: `agree`
takes the largest stop code over all processes (a 4-byte all-gather) at every
step boundary, so a signal delivered to one host stops them all together. The
same code carries the other reasons to stop between steps: a damaged batch on
one process (saved and stopped like a preemption) and a failed checkpoint write.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

import numpy as np

__all__ = ["PREEMPTED_EXIT", "STOP_DATA_ERROR", "STOP_NONE", "STOP_SIGNAL", "STOP_WRITE_FAILED",
           "StopRequested", "StopSignals", "agree", "interrupts_held"]

# sysexits.h EX_TEMPFAIL ("try again later"): the run stopped cleanly on a signal
# after saving a checkpoint; the same command resumes it.
PREEMPTED_EXIT = 75

# Stop codes combined across processes by `agree` (the largest wins).
STOP_NONE = 0
STOP_SIGNAL = 1  # a SIGTERM/SIGINT arrived: save and stop
STOP_DATA_ERROR = 2  # the next batch is damaged (token ids outside the vocabulary): save, stop
STOP_WRITE_FAILED = 3  # a checkpoint write failed on some process: stop, nothing to save


class StopRequested(Exception):
    """Raised by a stop signal inside `StopSignals.interrupting`: what was running is
    abandoned (the data pipeline waiting for, or spinning over, its next batch)."""


class StopSignals:
    """While entered, SIGTERM and SIGINT request a stop instead of ending the process.

    ``requested`` is the first signal's name (None before one arrives). The first
    signal also resets both signals to their default action, so a second one ends
    the process at once, whatever the main thread is doing (Python runs its own
    handlers only between bytecodes). Handlers can only be set in the main thread:
    elsewhere (a notebook's worker thread, a test runner's thread) nothing is
    installed, ``installed`` is False and signals keep their usual effect. The
    previous handlers are restored on exit.
    """

    def __init__(self, *, log: Callable[[str], None] | None = None,
                 signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)):
        self._log = log or (lambda msg: print(f"[train] {msg}", file=sys.stderr, flush=True))
        self._signals = tuple(signals)
        self._previous: dict[int, object] = {}
        self.requested: str | None = None
        self.installed = False
        self._interrupting = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        for s in self._signals:
            signal.signal(s, signal.SIG_DFL)
        self.requested = name
        if self._interrupting:
            self._interrupting = False
            self._log(f"{name} received while waiting for data: saving a checkpoint of the "
                      "last step and stopping (send it again to exit at once)")
            raise StopRequested(name)
        self._log(f"{name} received: finishing the current step, then saving a checkpoint and "
                  "stopping (send it again to exit at once)")

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """While inside, a stop signal raises `StopRequested` at once (in the main thread)
        instead of waiting for the block to end: for a wait that may never end, such as
        the data pipeline's next batch. Nothing is raised for a signal that came before."""
        self._interrupting = self.installed and self.requested is None
        try:
            yield
        finally:
            self._interrupting = False

    def __enter__(self) -> StopSignals:  # noqa: PYI034
        if threading.current_thread() is threading.main_thread():
            for s in self._signals:
                self._previous[s] = signal.signal(s, self._handle)
            self.installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
        self.installed = False


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """A Ctrl-C (SIGINT) inside the block raises KeyboardInterrupt when the block ends, a
    second one at once: for a call into a library whose queues and locks a KeyboardInterrupt
    raised mid-call could leave half-used (`train.data.stream`'s grain calls). Only where
    Python's own SIGINT handler is in place, in the main thread (elsewhere, or under
    `StopSignals`, the block runs as it is)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        if held:
            raise KeyboardInterrupt
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt



def agree(code: int) -> int:
    """The largest stop code over all processes (a collective: every process calls it at
    the same point); on one process, `code` itself at no cost."""
    import jax  # here: the signal handling above needs no JAX

    if jax.process_count() == 1:
        return int(code)
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int32(code))))
