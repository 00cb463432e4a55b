"""Checkpoints with orbax: train state + a JSON record, atomic, last K kept.

A checkpoint at step ``s`` holds the state after ``s`` optimizer steps:

* ``state``: the train-state pytree flattened to ``{dotted.path: array}``
  (params, optimizer state, step and skip counters), saved with
  ``StandardSave`` so every array keeps its sharding on restore;
* ``meta``: JSON with the step, data position (samples consumed), the run's
  config, the policy, the resolved model config, the data fingerprint,
  every array's shape/dtype and a checksum of every array.

Orbax writes each step to a temporary directory and renames it when complete,
so a run killed mid-save leaves the previous checkpoints intact. Restoring
checks the record first: a different model, policy, data or optimizer setup
raises `IncompatibleCheckpointError`; an unreadable, truncated or altered
checkpoint raises `CorruptCheckpointError`. Neither ever falls back to a fresh
start.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from train.process import fetch

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """Base class of checkpoint problems."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint that cannot be read or does not match its own record."""


class IncompatibleCheckpointError(CheckpointError):
    """A readable checkpoint written by a run with another model/policy/data/optimizer."""


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


@jax.jit
def _checksums(flat: dict[str, jax.Array]) -> dict[str, jax.Array]:
    def one(x):
        x = x.astype(jnp.float32)
        return jnp.stack([jnp.sum(x), jnp.sum(jnp.abs(x))])
    return {k: one(v) for k, v in flat.items()}


def checksums(flat: Mapping[str, jax.Array]) -> dict[str, list[float]]:
    """Per-array [sum, sum of |x|] in fp32 (detects altered or mixed-up arrays)."""
    out = fetch(_checksums(dict(flat)))
    return {k: [float(v[0]), float(v[1])] for k, v in out.items()}


def shapes(flat: Mapping[str, Any]) -> dict[str, list]:
    return {k: [list(v.shape), str(np.dtype(v.dtype))] for k, v in flat.items()}


class Checkpointer:
    """Saves/restores train states under ``directory`` (one sub-directory per step).

    Args:
      directory: the checkpoint root (created if missing).
      keep: number of most recent checkpoints to keep.
      async_save: write in a background thread after the device-to-host copy.
    """

    def __init__(self, directory: str | Path, *, keep: int, async_save: bool = True):
        self.directory = Path(directory).absolute()
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True)
        try:
            self.mngr = ocp.CheckpointManager(self.directory, options=opts,
                                              item_names=("state", "meta"))
        except Exception as e:  # orbax raises assorted errors on a mangled root
            raise CorruptCheckpointError(f"cannot open checkpoint directory {self.directory}: "
                                         f"{type(e).__name__}: {e}") from e

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

    def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> None:
        """Save `state` at `step` with the JSON record `meta` (shapes and checksums added)."""
        flat, _ = flatten(state)
        record = dict(meta)
        record.update(format_version=FORMAT_VERSION, step=int(step), arrays=shapes(flat),
                      checksums=checksums(flat))
        self.mngr.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(record)), force=True)

    def read_meta(self, step: int) -> dict[str, Any]:
        where = self.directory / str(step)
        try:
            out = self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = out["meta"]
        except Exception as e:
            raise CorruptCheckpointError(
                f"checkpoint {where} is unreadable ({type(e).__name__}: {e}). Delete it (the "
                "previous ones are kept) or use another output directory.") from e
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            raise CorruptCheckpointError(f"checkpoint {where}: missing or unknown record "
                                         f"format; delete it or use another output directory")
        return meta

    def restore(self, step: int, like: Any, meta: Mapping[str, Any]) -> Any:
        """Restore the state saved at `step` into the structure/shardings of `like`.

        `like` is a pytree of `jax.ShapeDtypeStruct` (with `.sharding`) or arrays.
        Raises IncompatibleCheckpointError on a shape/dtype/key mismatch and
        CorruptCheckpointError when arrays cannot be read or fail their checksums.
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
        got = checksums(flat)
        want_sums = meta.get("checksums", {})
        for k, (s, a) in got.items():
            ref = want_sums.get(k)
            if ref is None or not _close(s, ref[0], a) or not _close(a, ref[1], a):
                raise CorruptCheckpointError(
                    f"checkpoint {where}: array {k} does not match its recorded checksum "
                    f"(got {[s, a]}, recorded {ref}); the files were altered or damaged. Delete "
                    "it (the previous ones are kept) or use another output directory.")
        return unflatten(flat, like)

    def __enter__(self) -> Checkpointer:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait(self) -> None:
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.wait_until_finished()
        self.mngr.close()


def _close(x: float, ref: float, scale: float) -> bool:
    if not (np.isfinite(x) and np.isfinite(ref)):
        return (np.isnan(x) and np.isnan(ref)) or x == ref
    return abs(x - ref) <= 1e-5 * (abs(scale) + 1e-30) + 1e-30
