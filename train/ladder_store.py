"""A ladder's runs on disk: their records, eval curves and finished-stage markers.

Each run lives in ``<out>/runs/<policy>/seed<k>/`` (see
`train.ladder_config.run_dir`); ``ladder_done.json`` there records the stages
(steps, target) that finished, so an interrupted ladder resumes and a finished
one is not redone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from train.ladder_report import as_float
from train.output.metrics import read_jsonl

DONE_FILE = "ladder_done.json"


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "metrics.jsonl")


def eval_curve(records: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """[(tokens, eval loss)] of a run, sorted by tokens (one point per token count)."""
    pts: dict[int, float] = {}
    for r in records:
        if r.get("eval_loss") is not None:
            pts[int(r["tokens"])] = as_float(r["eval_loss"])
    return sorted(pts.items())


def eval_at(records: Sequence[Mapping[str, Any]], step: int) -> float | None:
    for r in records:
        if int(r["step"]) == step and r.get("eval_loss") is not None:
            return as_float(r["eval_loss"])
    return None


def _stage_key(steps: int, target: float | None) -> str:
    return f"steps={steps} target={target!r}"


def stage_done(run_dir: Path, steps: int, target: float | None) -> dict[str, Any] | None:
    """The record of a finished stage (steps, target) of a run, or None."""
    p = run_dir / DONE_FILE
    if not p.is_file():
        return None
    return json.loads(p.read_text()).get("stages", {}).get(_stage_key(steps, target))


def last_stage(run_dir: Path) -> dict[str, Any]:
    """The record of the last finished stage of a run ({} if none)."""
    p = run_dir / DONE_FILE
    return json.loads(p.read_text()).get("last", {}) if p.is_file() else {}


def mark_done(run_dir: Path, rec: dict[str, Any]) -> None:
    """Records a finished stage (atomically replaces the marker file)."""
    p = run_dir / DONE_FILE
    d = json.loads(p.read_text()) if p.is_file() else {"stages": {}}
    d["stages"][_stage_key(rec["steps"], rec["target"])] = rec
    d["last"] = rec
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(d, indent=1))
    tmp.replace(p)
