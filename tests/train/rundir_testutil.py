"""Test helpers for run-directory ownership: a lock-holding child, a read-only directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.train.train_testutil import ROOT

_HOLD = ("import sys, time\n"
         "from train.run_lock import RunLock\n"
         "RunLock(sys.argv[1]).acquire()\n"
         "print('held', flush=True)\n"
         "time.sleep(600)\n")


@contextlib.contextmanager
def lock_holder(directory: Path) -> Iterator[subprocess.Popen]:
    """A child process that holds the run lock of `directory` until killed (always reaped)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(directory)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "held", p.stderr.read()
        yield p
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        p.stdout.close()
        p.stderr.close()


def run_read_only(directory: Path, argv: Sequence[str], *, env: dict | None = None,
                  timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `argv` (cwd: repo root) with `directory` read-only for it.

    A non-root user gets the directory tree chmod'ed read-only (restored after);
    root (which ignores permission bits) gets a read-only bind mount in a private
    mount namespace (``unshare --mount``, or a user namespace as a fallback).
    """
    e = dict(os.environ)
    e.update(env or {})
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [directory, *directory.rglob("*")]}
        try:
            for p, m in modes.items():
                p.chmod(m & ~0o222)
            return subprocess.run(list(argv), cwd=ROOT, env=e, capture_output=True, text=True,
                                  timeout=timeout, check=False)
        finally:
            for p, m in modes.items():
                p.chmod(m)
    d = str(directory)
    mount = f'mount --bind "{d}" "{d}" && mount -o remount,ro,bind "{d}" "{d}" && exec "$@"'
    for unshare in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        if shutil.which(unshare[0]) is None:
            break
        probe = subprocess.run([*unshare, "sh", "-c", mount, "sh", "true"], capture_output=True,
                               check=False)
        if probe.returncode == 0:
            return subprocess.run([*unshare, "sh", "-c", mount, "sh", *argv], cwd=ROOT, env=e,
                                  capture_output=True, text=True, timeout=timeout, check=False)
    pytest.skip("running as root without a way to make a read-only directory (unshare)")
