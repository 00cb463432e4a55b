"""Checkpoints with orbax: train state + a JSON record, atomic, last K kept.

A checkpoint at step ``s`` holds the state after ``s`` optimizer steps:

* ``state``: the train-state pytree flattened to ``{dotted.path: array}``
  (params, optimizer state, step and skip counters), saved with
  ``StandardSave`` so every array keeps its sharding on restore;
* ``meta``: JSON with the step, data position (samples consumed), the run's
  config, the policy, the resolved model config, the data fingerprint,
  every array's shape/dtype and a SHA-256 digest of every array's bytes.

Digests are computed on the host from the arrays being saved (dtype, shape and
the C-order bytes; on multi-process runs each array is gathered to every
process in turn) and checked after every restore: any changed value, however
small (one weight +0.01, two values swapped), is a `CorruptCheckpointError`
naming the array and the step.

Retention: the ``keep`` most recent checkpoints, plus the most recent *good*
one (saved with ``good=True``, i.e. not inside a non-finite streak), which
later checkpoints never evict.

Orbax writes each step to a temporary directory and renames it when complete,
so a run killed mid-save leaves the previous checkpoints intact. Restoring
checks the record first: a different model, policy, data or optimizer setup
raises `IncompatibleCheckpointError`; an unreadable, truncated or altered
checkpoint raises `CorruptCheckpointError`. Neither ever falls back to a fresh
start.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

FORMAT_VERSION = 2  # 1: sum/abs-sum checksums (refused: too weak to trust)
DIGEST = "sha256(dtype, shape, C-order bytes)"


class CheckpointError(RuntimeError):
    """Base class of checkpoint problems."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint that cannot be read or does not match its own record."""


class IncompatibleCheckpointError(CheckpointError):
    """A readable checkpoint written by a run with another model/policy/data/optimizer."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, read-only or failing file system).

    The checkpoints written before are intact; the message names the newest.
    """


class _OrbaxTracebackFilter(logging.Filter):
    """Keeps orbax's error lines but drops their tracebacks (one failed background write
    logs the same traceback from four threads, ~300 lines); `CheckpointWriteError`
    reports the failure once, with what to do."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
            record.exc_info = record.exc_text = None
        return True


def _key(path) -> str:
    s = jax.tree_util.keystr(path)
    return re.sub(r"[^A-Za-z0-9_]+", ".", s).strip(".")


def flatten(tree: Any) -> tuple[dict[str, Any], Any]:
    """({dotted key: leaf}, treedef) with stable, filesystem-safe keys."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {}
    for path, leaf in leaves:
        k = _key(path)
        if k in flat:
            raise ValueError(f"two state leaves map to the same checkpoint key {k!r}")
        flat[k] = leaf
    return flat, treedef


def unflatten(flat: Mapping[str, Any], like: Any) -> Any:
    """Rebuild a tree shaped like `like` from `flatten`'s dict."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[_key(p)] for p, _ in leaves])


def _host_arrays(flat: Mapping[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(key, full host copy) for each array, one at a time, in key order.

    An array spread over several processes is gathered to every process
    (a collective: all processes iterate in the same order)."""
    for k in sorted(flat):
        v = flat[k]
        if isinstance(v, jax.Array) and not v.is_fully_addressable:
            v = multihost_utils.process_allgather(v, tiled=True)
        yield k, np.asarray(v)


def _digest(a: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(f"{a.dtype.str}{a.dtype.name}{list(a.shape)}".encode())
    h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)  # hashlib drops the GIL
    return h.hexdigest()


def digests(flat: Mapping[str, Any], *, threads: int | None = None) -> dict[str, str]:
    """{key: SHA-256 hex digest of the array's dtype, shape and bytes} (see module doc).

    Arrays are copied to the host one by one and hashed in `threads` worker
    threads (default: up to 8), keeping at most 2 x threads copies alive.
    """
    n = threads or min(8, os.cpu_count() or 1)
    out: dict[str, str] = {}
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        pending: dict[concurrent.futures.Future, str] = {}
        for k, a in _host_arrays(flat):
            pending[pool.submit(_digest, a)] = k
            if len(pending) >= 2 * n:
                done, _ = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
                for f in done:
                    out[pending.pop(f)] = f.result()
        for f, k in pending.items():
            out[k] = f.result()
    return dict(sorted(out.items()))


def shapes(flat: Mapping[str, Any]) -> dict[str, list]:
    return {k: [list(v.shape), str(np.dtype(v.dtype))] for k, v in flat.items()}


def free_space_problem(directory: Path, need_bytes: int) -> str | None:
    """Why `need_bytes` more cannot be written under `directory` (None when they fit).

    Checked before a save so that a full disk ends in one message instead of a
    failed write, whose orbax/tensorstore threads print dozens of tracebacks;
    `need_bytes` (the state's raw size) bounds what an uncompressed write takes.
    """
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None  # cannot tell: the write itself will report
    if free >= need_bytes:
        return None
    return (f"it needs about {need_bytes / 2**20:,.1f} MiB and {directory} has "
            f"{free / 2**20:,.1f} MiB free")


def _os_reason(cause: BaseException) -> str:
    """The operating-system error behind a failed write ("No space left on device (errno
    28)"), from an OSError or the ``os_error_code`` tensorstore puts in orbax's message."""
    for e in (cause, cause.__cause__, cause.__context__):
        if isinstance(e, OSError) and e.errno:
            return f"{os.strerror(e.errno)} (errno {e.errno})"
    m = re.search(r"os_error_code='?(\d+)", str(cause))
    if m:
        return f"{os.strerror(int(m.group(1)))} (errno {m.group(1)})"
    return "the write failed"


class Checkpointer:
    """Saves/restores train states under ``directory`` (one sub-directory per step).

    Args:
      directory: the checkpoint root (created if missing).
      keep: number of most recent checkpoints to keep; the most recent good one
        (see `save`) is kept as well.
      async_save: write in a background thread after the device-to-host copy.
      read_only: only read (``python -m train export-hf``): nothing is created, and
        the temporary directory of a save in progress (a live run's) is left alone.
    """

    def __init__(self, directory: str | Path, *, keep: int, async_save: bool = True,
                 read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointWriteError(f"{self.directory} is a file, not a directory: no "
                                       "checkpoint could be saved. Move it away or use another "
                                       "output directory (--out).")
        self._async = async_save
        self._pending: int | None = None  # an async save not known to have finished
        self._failed: CheckpointWriteError | None = None
        pp = ocp.checkpoint_managers
        good_step = lambda m: m["good_step"]  # a bad checkpoint records -1
        keep_policy = pp.AnyPreservationPolicy([
            pp.LatestN(n=keep),
            pp.BestN(get_metric_fn=good_step, n=1, keep_checkpoints_without_metrics=False)])
        opts = ocp.CheckpointManagerOptions(
            preservation_policy=keep_policy, best_fn=good_step,  # best_fn: persist the metric
            create=not read_only, enable_async_checkpointing=async_save and not read_only,
            cleanup_tmp_directories=not read_only)
        try:
            self.mngr = ocp.CheckpointManager(self.directory, options=opts,
                                              item_names=("state", "meta"))
        except Exception as e:  # orbax raises assorted errors on a mangled root
            raise CorruptCheckpointError(f"cannot open checkpoint directory {self.directory}: "
                                         f"{type(e).__name__}: {e}") from e
        self._log_filter = _OrbaxTracebackFilter()
        logging.getLogger("absl").addFilter(self._log_filter)

    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first.

        A step-named directory that orbax does not list as complete (e.g. its
        commit marker was deleted) is an error, not something to skip silently.
        """
        steps = sorted(self.mngr.all_steps())
        named = sorted(int(p.name) for p in self.directory.iterdir()
                       if p.is_dir() and p.name.isdigit()) if self.directory.is_dir() else []
        odd = sorted(set(named) - set(steps))
        if odd:
            raise CorruptCheckpointError(
                f"{self.directory}/{odd[-1]} looks like a checkpoint but is incomplete or "
                "damaged. Delete it (the others are kept) or use another output directory.")
        return steps

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def last_good_step(self) -> int | None:
        """The newest checkpoint saved with ``good=True`` (None if there is none)."""
        for step in reversed(self.steps()):
            if self.read_meta(step).get("good"):
                return step
        return None

    def save(self, step: int, state: Any, meta: Mapping[str, Any], *, good: bool = True) -> None:
        """Save `state` at `step` with the JSON record `meta` (shapes and digests added).

        ``good=False`` marks a checkpoint written inside a non-finite streak: it
        counts toward ``keep`` but never evicts the most recent good one.
        Raises CheckpointWriteError when this save, or the previous asynchronous one
        (whose failure orbax reports here), could not be written.
        """
        if self.read_only:
            raise CheckpointWriteError(f"{self.directory} was opened read-only; nothing saved")
        if self._failed is not None:
            raise self._failed
        flat, _ = flatten(state)
        full = free_space_problem(self.directory, sum(int(v.nbytes) for v in flat.values()))
        if full is not None:
            self._failed = CheckpointWriteError(
                f"not enough space to write checkpoint step {step}: {full}. Training stopped; "
                f"{self._kept()}. Free space on that file system and run the same command "
                "again to resume.")
            raise self._failed
        record = dict(meta)
        record.update(format_version=FORMAT_VERSION, step=int(step), good=bool(good),
                      arrays=shapes(flat), digest=DIGEST, digests=digests(flat))
        try:
            self.mngr.save(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(record)), force=True,
                metrics={"good_step": int(step) if good else -1})
        except Exception as e:
            # orbax raises a pending async save's error on the next save
            raise self._write_failed(self._pending if self._pending is not None else step,
                                     e) from e
        self._pending = int(step) if self._async else None

    def read_meta(self, step: int) -> dict[str, Any]:
        where = self.directory / str(step)
        try:
            out = self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = out["meta"]
        except Exception as e:
            raise CorruptCheckpointError(
                f"checkpoint {where} is unreadable ({type(e).__name__}: {e}). Delete it (the "
                "previous ones are kept) or use another output directory.") from e
        if isinstance(meta, dict) and meta.get("format_version") == 1:
            raise IncompatibleCheckpointError(
                f"checkpoint {where} was written by an earlier version of train (record format 1,"
                " whose sum checksums cannot detect changed values). Finish that run with the "
                "version that started it, or start over in another output directory.")
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            raise CorruptCheckpointError(f"checkpoint {where}: missing or unknown record "
                                         f"format; delete it or use another output directory")
        return meta

    def restore(self, step: int, like: Any, meta: Mapping[str, Any]) -> Any:
        """Restore the state saved at `step` into the structure/shardings of `like`.

        `like` is a pytree of `jax.ShapeDtypeStruct` (with `.sharding`) or arrays.
        Raises IncompatibleCheckpointError on a shape/dtype/key mismatch and
        CorruptCheckpointError when arrays cannot be read or differ from their digests.
        """
        where = self.directory / str(step)
        flat_like, _ = flatten(like)
        want = shapes(flat_like)
        have = meta.get("arrays", {})
        if set(want) != set(have):
            missing = sorted(set(want) - set(have))[:5]
            extra = sorted(set(have) - set(want))[:5]
            raise IncompatibleCheckpointError(
                f"checkpoint {where} holds other state arrays than this run builds "
                f"(missing {missing}, unexpected {extra}): it was written by another model or "
                "optimizer. Use another output directory or delete the checkpoints.")
        diff = [k for k in want if want[k] != have[k]]
        if diff:
            k = diff[0]
            raise IncompatibleCheckpointError(
                f"checkpoint {where}: array {k} is {have[k]} but this run needs {want[k]} "
                f"({len(diff)} arrays differ): another model shape. Use another output "
                "directory or delete the checkpoints.")
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=getattr(v, "sharding", None))
                    for k, v in flat_like.items()}
        try:
            out = self.mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))
            flat = dict(out["state"])
        except Exception as e:
            raise CorruptCheckpointError(
                f"checkpoint {where} cannot be restored ({type(e).__name__}: {e}). Delete it "
                "(the previous ones are kept) or use another output directory.") from e
        want_digests = meta.get("digests", {})
        for k, got in digests(flat).items():
            if got != want_digests.get(k):
                raise CorruptCheckpointError(
                    f"checkpoint {where} (step {step}): array {k} does not match its recorded "
                    f"digest (SHA-256 of its bytes: got {got[:16]}..., recorded "
                    f"{str(want_digests.get(k))[:16]}...); the files were altered or damaged. "
                    "Delete it (the previous ones are kept) or use another output directory.")
        return unflatten(flat, like)

    def __enter__(self) -> Checkpointer:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write_failed(self, step: int | None, cause: BaseException) -> CheckpointWriteError:
        self._pending = None
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        kept = self._kept()
        self._failed = CheckpointWriteError(
            f"could not write checkpoint {'' if step is None else f'step {step} '}to "
            f"{self.directory}: {_os_reason(cause)}. Training stopped; {kept}. Free space on "
            "that file system (or fix it) and run the same command again to resume. "
            f"[{type(cause).__name__}: {first[:300]}]")
        return self._failed

    def _kept(self) -> str:
        try:
            newest = self.latest_step()
        except CheckpointError:
            newest = None
        return (f"the newest complete checkpoint is step {newest} (kept)" if newest is not None
                else "no complete checkpoint exists yet")

    def failure(self) -> CheckpointWriteError | None:
        """The write error of a save that failed, without waiting: an asynchronous save
        still in progress counts as not failed (yet)."""
        if self._failed is None and self._pending is not None \
                and not self.mngr.is_saving_in_progress():
            try:  # finished: joining its thread returns at once, raising what it raised
                self.mngr.wait_until_finished()
            except Exception as e:  # noqa: BLE001 (orbax raises assorted types; reported here)
                return self._write_failed(self._pending, e)
            self._pending = None
        return self._failed

    def _finish_pending(self) -> None:
        """Wait for orbax's pending save; CheckpointWriteError if it failed (unless a failure
        was already recorded, which the callers report themselves)."""
        try:
            self.mngr.wait_until_finished()
        except Exception as e:
            if self._failed is None:
                raise self._write_failed(self._pending, e) from e
        self._pending = None

    def wait(self) -> None:
        """Wait for an asynchronous save; CheckpointWriteError if it failed."""
        self._finish_pending()
        if self._failed is not None:
            raise self._failed

    def close(self) -> None:
        """Finish pending saves and release orbax's threads; raises CheckpointWriteError for a
        pending save that failed (not again for one already reported)."""
        try:
            self._finish_pending()
        finally:
            self.mngr.close()
            logging.getLogger("absl").removeFilter(self._log_filter)

