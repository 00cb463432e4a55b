"""File-system faults for tests: a disk that fills up."""

from __future__ import annotations

import contextlib
import resource
import signal


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes past ``nbytes`` fail with EFBIG, which is what a full disk's ENOSPC looks like
    to a writer (an OSError from write()); SIGXFSZ is ignored so that the write returns the
    error instead of killing the process. Applies to this process until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
