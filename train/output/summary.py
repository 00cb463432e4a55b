"""A run's result (`RunSummary`), built from its metrics file and kept in summary.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from train.config import Config
from train.diagnostics import numerics
from train.output.metrics import plot_losses, read_jsonl


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSummary:
    """Result of `train.loop.run`.

    status: 'completed' (all steps), 'target_reached' (eval <= target),
    'nonfinite' (stopped by the guard), 'preempted' (stopped by SIGTERM/SIGINT after
    a checkpoint), 'data_error' (a damaged batch; the last good step is saved); the
    last two resume with the same command. eval_history: [(step, tokens, eval_loss)].
    target_tokens: tokens consumed at the first eval <= target (None if never).
    instability_step/instability_kind: the instability detector's first event over
    the logged gradient norms (``train.diagnostics.dynamics.InstabilityDetector``;
    None if none). diagnostics: means of the numerics fields over the last quarter
    of the records (``diagnostics.enabled``; None without them).

    A run resumed from a checkpoint is made of segments, one per process that trained it:
    ``wall_time_s`` and ``tokens_per_s`` are the run's, over every segment up to ``steps``
    (wall time summed; tokens/s over the steps after each segment's first, which compiles),
    like metrics.jsonl's cumulative ``time_s``; ``segments`` lists each one (`segment_record`:
    first_step, last_step, wall_time_s, tokens_per_s, steady_steps, steady_s). A segment
    killed after its last checkpoint is counted up to that checkpoint.

    ``routes``: what each GEMM of the run's policy ran on, on the chip it compiled for
    (`train.backend.route_record`: chip, the config's backend, and fprop/dgrad/wgrad each a
    route of `mxjax.backends.ROUTES` or 'passthrough').
    """

    status: str
    message: str
    steps: int
    tokens: int
    final_eval_loss: float | None
    best_eval_loss: float | None
    eval_history: list[tuple[int, int, float]]
    target_eval_loss: float | None
    target_step: int | None
    target_tokens: int | None
    skipped_steps: int
    wall_time_s: float
    tokens_per_s: float | None
    policy: str
    out_dir: str
    metrics_path: str
    plot_path: str | None
    checkpoint_dir: str | None
    resumed_from: int | None
    instability_step: int | None = None
    instability_kind: str | None = None
    diagnostics: dict[str, float] | None = None
    segments: list[dict[str, Any]] | None = None
    routes: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_summary(path: Path) -> RunSummary | None:
    """The summary in `path`, or None if it is missing or unreadable."""
    try:
        d = json.loads(path.read_text())
        d["eval_history"] = [tuple(e) for e in d["eval_history"]]
        return RunSummary(**d)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def finished(out_dir: Path, steps: int) -> bool:
    """Whether ``out_dir/summary.json`` records a run with nothing left to do at ``steps``
    steps (its target reached, or completed with at least that many): such a run in a
    directory it cannot write only reports its result."""
    prev = read_summary(Path(out_dir) / "summary.json")
    return prev is not None and (prev.status == "target_reached" or (
        prev.status == "completed" and prev.steps >= steps))


def segment_record(*, first_step: int, last_step: int, wall_s: float, steady_steps: int,
                   steady_s: float, tokens_per_step: int) -> dict[str, Any]:
    """One segment of a run (one process's share): its steps, wall time (setup and compile
    included) and tokens/s over its steps after the first (None with fewer than two)."""
    return {"first_step": first_step, "last_step": last_step, "wall_time_s": round(wall_s, 3),
            "tokens_per_s": (round(tokens_per_step * steady_steps / steady_s, 1)
                             if steady_steps and steady_s > 0 else None),
            "steady_steps": steady_steps, "steady_s": round(steady_s, 6)}


def earlier_segments(meta: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """The segments a checkpoint of `step` records (its ``meta``); one segment from its
    ``time_s`` for a checkpoint written before segments were recorded."""
    segs = meta.get("segments")
    if isinstance(segs, list) and segs:
        return [dict(x) for x in segs]
    return [segment_record(first_step=0, last_step=step, wall_s=float(meta.get("time_s", 0.0)),
                           steady_steps=0, steady_s=0.0, tokens_per_step=1)]


def summarize(config: Config, *, policy_name: str, status: str, message: str, step: int,
              tokens_per_step: int, skipped: int, segments: list[dict[str, Any]],
              resumed: int | None, primary: bool,
              records: list[dict[str, Any]] | None = None,
              routes: dict[str, Any] | None = None) -> RunSummary:
    """The summary of the run in ``config.out_path`` from its ``records`` (the metrics
    writer's, `train.output.metrics.MetricsWriter.records`: what the run measured, whatever
    became of the file), or, without them, from its metrics.jsonl.

    On the primary process also draws plot.png (when ``train.plot``) and writes
    summary.json.
    """
    c, t, out = config, config.train, config.out_path
    recs = read_jsonl(out / "metrics.jsonl") if records is None else records
    evals = [(int(r["step"]), int(r["tokens"]), float(r["eval_loss"])) for r in recs
             if isinstance(r.get("eval_loss"), (int, float))]
    target_step = target_tokens = None
    if t.target_eval_loss is not None:
        for s, tok, e in evals:
            if e <= t.target_eval_loss:
                target_step, target_tokens = s, tok
                break
    unstable = numerics.instability(recs)
    wall = sum(float(x["wall_time_s"]) for x in segments)
    steady_n = sum(int(x.get("steady_steps") or 0) for x in segments)
    steady_s = sum(float(x.get("steady_s") or 0.0) for x in segments)
    tokens_per_s = tokens_per_step * steady_n / steady_s if steady_n and steady_s > 0 else None
    plot_path = None
    if t.plot and primary and recs:
        title = f"{c.name} | policy {policy_name}"
        if evals:
            title += f" | eval {evals[-1][2]:.4f} at step {evals[-1][0]}"
        plot_path = str(plot_losses(recs, out / "plot.png", title=title))
    s = RunSummary(
        status=status, message=message, steps=step, tokens=step * tokens_per_step,
        final_eval_loss=evals[-1][2] if evals else None,
        best_eval_loss=min(e for _, _, e in evals) if evals else None,
        eval_history=evals, target_eval_loss=t.target_eval_loss, target_step=target_step,
        target_tokens=target_tokens, skipped_steps=skipped, wall_time_s=round(wall, 3),
        tokens_per_s=round(tokens_per_s, 1) if tokens_per_s else None, policy=policy_name,
        out_dir=str(out), metrics_path=str(out / "metrics.jsonl"), plot_path=plot_path,
        checkpoint_dir=str(out / "checkpoints") if c.checkpoint.enabled else None,
        resumed_from=resumed, instability_step=unstable.event_step,
        instability_kind=unstable.event_kind, diagnostics=numerics.diag_summary(recs) or None,
        segments=segments, routes=routes)
    if primary:
        (out / "summary.json").write_text(json.dumps(s.to_dict(), indent=1))
    return s
