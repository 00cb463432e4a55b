"""train.output.tensorboard_log: metrics records -> TensorBoard scalars, read back with
TensorBoard's own EventAccumulator (an independent reader; tensorboard is a dev dependency)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from train.output.tensorboard_log import TensorBoardWriter, scalars


def _rec(step: int, **kw):
    rec = {"step": step, "tokens": step * 512, "loss": 5.0 - 0.1 * step, "eval_loss": None,
           "lr": 1e-3 * step, "grad_norm": 1.5 + step, "tokens_per_s": 1000.0 + step,
           "skipped_steps": 0, "policy": "mxfp4_all", "epoch": 0.01 * step, "time_s": 0.5 * step}
    rec.update(kw)
    return rec


def _read(logdir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_of_a_record():
    rec = _rec(3, eval_loss=4.5, nonfinite=True, **{
        "diag/fprop/lhs_rel_err": 0.1, "grad_collapse_rate": 0.0, "diag_slots": {"L0": {}},
        "diag_gemm": None, "note": "text", "flag": False, "arr": np.float32(2.5)})
    got = scalars(rec)
    assert got == {"train/loss": 5.0 - 0.3, "train/lr": 3e-3, "train/grad_norm": 4.5,
                   "train/tokens_per_s": 1003.0, "train/skipped_steps": 0.0, "eval/loss": 4.5,
                   "diag/fprop/lhs_rel_err": 0.1, "hooks/grad_collapse_rate": 0.0,
                   "hooks/arr": 2.5}


def test_events_read_back(tmp_path):
    w = TensorBoardWriter(tmp_path, resume_step=None)
    w.write({"step": 0, "tokens": 0, "loss": None, "eval_loss": 6.9, "lr": 1e-4})
    for s in range(1, 6):
        w.write(_rec(s, eval_loss=4.0 if s == 5 else None, **{"diag/wgrad/cosine": 0.9 + s / 100}))
    w.write(_rec(6, loss=float("nan"), skipped_steps=1))
    w.close()
    got = _read(tmp_path)
    assert set(got) == {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
                        "train/skipped_steps", "eval/loss", "diag/wgrad/cosine"}
    assert got["eval/loss"] == [(0, pytest.approx(6.9)), (5, 4.0)]
    loss = got["train/loss"]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]
    # TensorBoard stores float32 scalars
    assert [v for _, v in loss[:5]] == [float(np.float32(5.0 - 0.1 * s)) for s in range(1, 6)]
    assert math.isnan(loss[5][1])
    assert got["train/skipped_steps"][-1] == (6, 1.0)
    assert [s for s, _ in got["train/lr"]] == [0, 1, 2, 3, 4, 5, 6]
    assert got["diag/wgrad/cosine"][0] == (1, pytest.approx(0.91))


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    w = TensorBoardWriter(tmp_path, resume_step=None)
    for s in range(1, 11):
        w.write(_rec(s))
    w.close()
    w = TensorBoardWriter(tmp_path, resume_step=5)  # the restart redoes steps 6..
    for s in range(6, 9):
        w.write(_rec(s, loss=100.0 + s))
    w.close()
    loss = _read(tmp_path)["train/loss"]
    assert [s for s, _ in loss] == list(range(1, 9))
    assert [v for _, v in loss[5:]] == [106.0, 107.0, 108.0]
