"""The reference runs' saved states (parameters, optimizer, counters), through `train.checkpoint`.

Each state is an orbax checkpoint (`train.checkpoint.Checkpointer`, with its
per-array SHA-256 digests) in its own directory
``<out>/states/w<width>/seed<seed>/step<step>/``. It is written under a
temporary name and renamed when complete, so an interrupted save, or two worker
processes replaying the same missing state, leave one complete copy or none;
a directory that exists is complete. Restoring checks the record (another
model: `IncompatibleCheckpointError`) and every array's shape and digest.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from train.checkpoint import Checkpointer, CorruptCheckpointError, IncompatibleCheckpointError
from train.jsonsafe import jsonable
from train.run import CompiledRun

__all__ = ["load_state", "save_state", "state_path"]

KIND = "study reference state"


def state_path(root: Path, width: int, seed: int, step: int) -> Path:
    """Where the reference state of (`width`, `seed`) after `step` steps lives."""
    return root / "states" / f"w{width}" / f"seed{seed}" / f"step{step}"


def save_state(path: Path, state: Any, run: CompiledRun, *, step: int) -> None:
    """Saves `state` (the state after `step` steps of `run`'s model) at `path`, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    meta = {"kind": KIND, "step": int(step), "model": jsonable(run.plan.model_config)}
    with Checkpointer(tmp, keep=1, async_save=False) as ck:
        ck.save(step, state, meta)
    try:
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not path.is_dir():  # only another process's complete copy may take its place
            raise


def load_state(path: Path, run: CompiledRun) -> Any:
    """The state saved at `path`, checked against `run`'s model and layout and placed on its
    shardings.

    Raises:
      FileNotFoundError: nothing is saved at `path`.
      IncompatibleCheckpointError: the state belongs to another model (width, layers,
        vocabulary) or optimizer layout.
      CorruptCheckpointError: the files are unreadable or differ from their digests.
    """
    if not Path(path).is_dir():  # (a Checkpointer would create it)
        raise FileNotFoundError(f"{path}: no saved reference state")
    with Checkpointer(path, keep=1, async_save=False) as ck:
        step = ck.latest_step()
        if step is None:
            raise CorruptCheckpointError(f"{path}: holds no complete state; delete it to re-run "
                                         "its reference run")
        meta = ck.read_meta(step)
        if meta.get("kind") != KIND or meta.get("model") != jsonable(run.plan.model_config):
            raise IncompatibleCheckpointError(
                f"{path}: the saved state does not match this model's layout (another width or "
                "model config?); delete it to re-run its reference run")
        return ck.restore(step, run.abstract, meta)
