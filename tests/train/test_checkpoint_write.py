"""A checkpoint that cannot be written: one CheckpointWriteError naming the
OS error and the newest complete checkpoint, for synchronous and asynchronous saves, and the
checkpoints written before stay intact.

The write failure is real: RLIMIT_FSIZE (with SIGXFSZ ignored) makes the kernel fail every
write past the limit with EFBIG, the same OSError from write() a full disk gives as ENOSPC
(checked by hand on a 1 MiB tmpfs, which needs root to mount: same message, "No space left
on device (errno 28)"). A full disk is also caught before orbax writes: `free_space_problem`.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
import pytest

from tests.file_faults import file_size_limit
from train.checkpoint import (
    Checkpointer,
    CheckpointWriteError,
    free_space_problem,
)

# ~1 MiB of incompressible values: far past the limit below
STATE = {"w": np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32),
         "step": np.int32(3)}


@pytest.mark.parametrize("async_save", [False, True])
def test_write_failure_surfaces_from_save_or_failure(tmp_path, async_save):
    state = jax.tree.map(jax.numpy.asarray, STATE)
    ck = Checkpointer(tmp_path / "ck", keep=3, async_save=async_save)
    ck.save(1, state, {"x": 1})
    ck.wait()
    assert ck.failure() is None
    want = (r"could not write checkpoint step 2 to .*/ck: File too large \(errno 27\)\. "
            r"Training stopped; the newest complete checkpoint is step 1 \(kept\)\. Free space")
    with file_size_limit(200_000):
        if async_save:
            ck.save(2, state, {"x": 2})  # returns: the write fails in the background
            with pytest.raises(CheckpointWriteError, match=want):
                ck.wait()
        else:
            with pytest.raises(CheckpointWriteError, match=want):
                ck.save(2, state, {"x": 2})
    # reported once and kept: later saves and the trainer's per-step poll see the same error
    assert ck.failure() is not None and "step 2" in str(ck.failure())
    with pytest.raises(CheckpointWriteError, match="step 2"):
        ck.save(3, state, {"x": 3})
    ck.close()  # does not raise it again
    with Checkpointer(tmp_path / "ck", keep=3) as again:
        assert again.steps() == [1]
        restored = again.restore(1, state, again.read_meta(1))
    assert np.array_equal(np.asarray(restored["w"]), STATE["w"])


def test_async_failure_is_found_by_polling(tmp_path):
    # what the trainer does every step: failure() never waits, and sees a finished failed save
    state = jax.tree.map(jax.numpy.asarray, STATE)
    ck = Checkpointer(tmp_path / "ck", keep=3, async_save=True)
    err = None
    with file_size_limit(200_000):
        ck.save(1, state, {"x": 1})
        deadline = time.time() + 60
        while err is None and time.time() < deadline:
            err = ck.failure()
            time.sleep(0.01)
    assert err is not None and "could not write checkpoint step 1" in str(err)
    assert "no complete checkpoint exists yet" in str(err)
    ck.close()


def test_free_space_problem(tmp_path):
    assert free_space_problem(tmp_path, 1) is None
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    msg = free_space_problem(tmp_path, free + 2**40)
    assert msg is not None and f"{tmp_path} has " in msg and "MiB free" in msg


def test_checkpoint_root_that_is_a_file(tmp_path):
    (tmp_path / "ck").write_text("x")
    with pytest.raises(CheckpointWriteError, match=r"ck is a file, not a directory"):
        Checkpointer(tmp_path / "ck", keep=2)
