"""TensorBoard event files for a run, written with tensorboardX (no TensorFlow).

`TensorBoardWriter` turns the loop's metrics records (see `train.output.metrics`)
into scalars in ``events.out.tfevents.*`` files directly in the run directory,
so ``tensorboard --logdir runs/`` lists every run by its directory and draws them side by side.
Tags, against the optimizer step:

* ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``,
  ``train/skipped_steps`` (from ``loss``, ``lr``, ... of the record),
* ``eval/loss`` (``eval_loss``; step 0 is the evaluation before training),
* per-GEMM diagnostics as recorded (``diag/<gemm>/<field>``), and any other
  numeric scalar field a hook adds under ``hooks/<field>``.

Fields that are not numbers (policy name, per-slot tables) are left out. A
resumed run passes ``resume_step``: TensorBoard then drops the events of the
steps after it that an earlier, interrupted process had written.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter

TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "tokens_per_s": "train/tokens_per_s", "skipped_steps": "train/skipped_steps",
        "eval_loss": "eval/loss"}
# Record fields that are axes or labels, not series.
_NOT_SCALARS = frozenset({"step", "tokens", "epoch", "time_s", "policy", "nonfinite"})


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """{tag: value} of a metrics record (None and non-numeric fields dropped; NaN/Inf kept)."""
    out = {}
    for key, value in record.items():
        if key in _NOT_SCALARS or value is None or isinstance(value, bool):
            continue
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            value = value.item()
        if not isinstance(value, numbers.Real):
            continue
        tag = TAGS.get(key) or (key if "/" in key else f"hooks/{key}")
        out[tag] = float(value)
    return out


class TensorBoardWriter:
    """Writes metrics records as TensorBoard scalars into ``logdir``.

    Args:
      logdir: the run directory (event files go directly into it).
      resume_step: None for a fresh run; the step a resumed run restarts from.
    """

    def __init__(self, logdir: str | Path, *, resume_step: int | None):
        self.logdir = Path(logdir)
        # tensorboardX names files by the second; the suffix keeps a quick restart (same
        # second) from overwriting the file before it (TensorBoard reads them in name order).
        self._w = SummaryWriter(str(self.logdir),
                                purge_step=None if resume_step is None else resume_step + 1,
                                flush_secs=30, filename_suffix=f".{time.time_ns()}")

    def write(self, record: Mapping[str, Any]) -> None:
        """Add every scalar of one metrics record at ``record['step']``."""
        step = int(record["step"])
        for tag, value in scalars(record).items():
            self._w.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()
