"""One live run per output directory: an advisory lock plus a holder record.

`RunLock(out_dir).acquire()` takes an exclusive ``fcntl.flock`` on
``<out_dir>/.run.lock`` and writes a JSON holder record into it (host, pid,
start time, command line). The kernel drops the lock when the holding process
ends in any way (exit, exception, ``kill -9``), so:

* a second run on the same directory while the first is alive gets
  `RunLockError` naming the holder (host, pid, command);
* a directory left by a killed run is taken over: the lock is free, the old
  record is still in the file, and `acquire` returns it (the caller reports
  the take-over). A clean `release` empties the record.

The file is never deleted (deleting it would let a third process lock a new
file while a second still holds the old inode).

Shared file systems: on Linux, ``flock`` on NFS is implemented with NFS
byte-range locks, so runs on different hosts exclude each other; if the holding
*host* crashes, the server frees the lock once that client's lease expires
(about 90 s on NFSv4). Multi-process runs (``--distributed``): only process 0
takes the lock, and the outcome is broadcast so every process fails or
proceeds together (`acquire_for_run`); the directory is assumed shared by all
hosts, as the joint checkpoints require.

An output directory that cannot be written raises `RunDirNotWritable`
(a `RunLockError`) before anything is created in it, and one that holds files of a
run's names that no run wrote (no lock file beside them) raises `RunDirNotOwned`: the lock
file is the mark of a run's own directory.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_NAME = ".run.lock"

# files and folders a run writes into its output directory (all must be writable if present)
RUN_FILES = ("config.yaml", "metrics.jsonl", "mllog.txt", "summary.json", "plot.png",
             "checkpoints")
RUN_DIRS = ("checkpoints",)


class RunLockError(RuntimeError):
    """The output directory is held by another live run, or cannot be locked."""


class RunDirNotWritable(RunLockError):
    """The output directory (or a file the run must write in it) is not writable."""


class RunDirNotOwned(RunLockError):
    """The output directory holds files a run writes (config.yaml, metrics.jsonl, ...) that
    no run wrote: it has no run lock file, which a run creates before anything else."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Holder:
    """Who holds (or last held) a run directory."""

    host: str
    pid: int
    started: float  # time.time() when the lock was taken
    argv: tuple[str, ...] = ()

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        cmd = " ".join(self.argv)
        return (f"host {self.host}, pid {self.pid}, since {when}"
                + (f", command: {cmd[:200]}" if cmd else ""))

    @staticmethod
    def parse(text: str) -> Holder | None:
        try:
            d = json.loads(text)
            return Holder(host=str(d["host"]), pid=int(d["pid"]), started=float(d["started"]),
                          argv=tuple(str(a) for a in d.get("argv", ())))
        except (ValueError, TypeError, KeyError):
            return None


def check_owned(directory: str | Path) -> None:
    """Raise `RunDirNotOwned` when `directory` holds files of a run's names (`RUN_FILES`,
    TensorBoard event files) but no run lock (``.run.lock``): a run creates its lock before
    it writes anything, so those files are someone else's (a user's config.yaml, a metrics
    file copied there) and the run would overwrite them."""
    d = Path(directory)
    if not d.is_dir() or (d / LOCK_NAME).exists():
        return
    found = [n for n in RUN_FILES if (d / n).exists()]
    found += sorted(p.name for p in d.glob("events.out.tfevents.*"))
    if found:
        raise RunDirNotOwned(
            f"output directory {d} holds {', '.join(found[:6])}{', ...' if len(found) > 6 else ''}"
            ", which no run wrote there (a run's directory has a .run.lock, created before "
            "anything else); the run would overwrite them. Choose another --out, or move "
            "those files away. (A run directory copied without its hidden files lacks it: "
            f"copy {LOCK_NAME} too, or create it empty, to resume there)")


def check_writable(directory: str | Path) -> None:
    """Raise `RunDirNotWritable` unless `directory` (created if missing) and the run files
    already in it can be written by this process."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirNotWritable(f"output directory {d} cannot be created ({e.strerror}); "
                                "choose a writable --out") from None
    _check_run_files(d)


def check_usable(directory: str | Path) -> None:
    """What `RunLock.acquire` would refuse in `directory`, found without creating, writing or
    locking anything (``python -m train --check``): `RunDirNotWritable` when it cannot be
    created or written, `RunDirNotOwned` when it holds files that no run wrote, each with
    the message the run prints. A live run holding the directory is not looked for (that
    takes its lock); an ancestor that is a file is `train.plan.check_out_dir`'s."""
    d = Path(directory)
    if not d.is_dir():
        parent = next((p for p in d.parents if p.is_dir()), None)
        if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
            why = ("Read-only file system" if os.statvfs(parent).f_flag & os.ST_RDONLY
                   else "Permission denied")
            raise RunDirNotWritable(f"output directory {d} cannot be created ({why}); "
                                    "choose a writable --out")
        return
    _check_run_files(d)
    check_owned(d)


def _check_run_files(d: Path) -> None:
    """`check_writable`'s checks of an existing directory `d` and the run files in it."""
    for n in RUN_FILES:  # a directory where a file goes, or the other way round
        want_dir = n in RUN_DIRS
        if (d / n).exists() and (d / n).is_dir() != want_dir:
            raise RunDirNotWritable(
                f"{d / n} is a {'file' if want_dir else 'directory'}, where the run writes its "
                f"{'checkpoints (a directory)' if want_dir else 'file ' + n}; move it away or "
                "choose another --out")
    bad = [d] if not os.access(d, os.W_OK | os.X_OK) else []
    bad += [d / n for n in RUN_FILES if (d / n).exists() and not os.access(d / n, os.W_OK)]
    if bad:
        raise RunDirNotWritable(f"output directory {d} is not writable by this user "
                                f"({', '.join(str(p) for p in bad[:3])}); the run would fail "
                                "at its first write. Fix the permissions or choose another --out")


class RunLock:
    """Exclusive ownership of a run directory (see module docstring).

    Args:
      directory: the run's output directory (created if missing).
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> Holder | None:
        """Take the lock. Returns the record of a dead previous holder that is being taken
        over (None if the directory was free). Raises `RunLockError` if a live run holds it,
        `RunDirNotWritable` if the directory cannot be written."""
        if self._fd is not None:
            raise RunLockError(f"{self.path} is already held by this RunLock")
        check_writable(self.directory)
        check_owned(self.directory)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise RunDirNotWritable(f"cannot create the run lock {self.path} ({e.strerror}); "
                                    "choose a writable --out") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunLockError(
                        f"cannot lock {self.path} ({e.strerror}): the file system does not "
                        "support locks, so two runs could write this directory at once. Use an "
                        "output directory on a local or lock-capable file system") from None
                holder = self._read_holder(fd, wait=True)
                who = holder.describe() if holder else "a process that has not written its record"
                raise RunLockError(
                    f"output directory {self.directory} is in use by another run ({who}). "
                    "Wait for it to finish, stop it, or choose another --out. (A killed run "
                    "releases it at once; a crashed host after its file-system lease, about "
                    "90 s on NFS.)") from None
            stale = self._read_holder(fd, wait=False)
            me = Holder(host=socket.gethostname(), pid=os.getpid(), started=time.time(),
                        argv=tuple(sys.argv))
            self._write(fd, json.dumps(dataclasses.asdict(me)).encode())
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return stale

    def release(self) -> None:
        """Empty the holder record and drop the lock (no-op if not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            self._write(fd, b"")
        finally:
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> RunLock:  # noqa: PYI034
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @staticmethod
    def _write(fd: int, data: bytes) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    @staticmethod
    def _read_holder(fd: int, *, wait: bool) -> Holder | None:
        # a new holder writes its record just after locking: give it a moment
        for _ in range(20 if wait else 1):
            text = os.pread(fd, 1 << 16, 0).decode("utf-8", "replace")
            holder = Holder.parse(text) if text.strip() else None
            if holder is not None or not wait:
                return holder
            time.sleep(0.05)
        return None


def acquire_for_run(directory: str | Path) -> tuple[RunLock | None, Holder | None]:
    """Lock a run directory for this (possibly multi-process) run.

    One process: `RunLock.acquire`. Several processes (after
    ``jax.distributed.initialize``): process 0 takes the lock and broadcasts
    the outcome, so every process raises the same kind of error or none does.
    Returns (the lock, held by process 0 only; None elsewhere, stale holder record).
    """
    import jax

    if jax.process_count() == 1:
        lock = RunLock(directory)
        return lock, lock.acquire()
    import numpy as np
    from jax.experimental import multihost_utils

    lock, stale, err = None, None, None
    code = 0
    if jax.process_index() == 0:
        lock = RunLock(directory)
        try:
            stale = lock.acquire()
        except RunDirNotWritable as e:
            err, code = e, 2
        except RunLockError as e:
            err, code = e, 1
    code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
    if err is not None:
        raise err
    if code:
        kind = RunDirNotWritable if code == 2 else RunLockError
        raise kind(f"process 0 could not take the run directory {directory} (see its error)")
    return lock, stale
