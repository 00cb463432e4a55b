"""Run outputs: per-step JSONL, progress display, loss plot.

Files in a run directory (see `train.loop.run` and `train.trainer`):

* ``metrics.jsonl``: one JSON object per logged step with keys ``step``,
  ``tokens`` (tokens consumed so far), ``loss`` (train loss of that step),
  ``eval_loss`` (null unless evaluated at that step), ``lr``, ``grad_norm``
  (before clipping), ``tokens_per_s``, ``skipped_steps`` (total non-finite steps
  skipped so far), ``policy``, ``epoch``, ``time_s`` (since the run started),
  plus any extra fields from hooks. Step 0 holds the evaluation before training.
* ``plot.png``: train loss (raw and smoothed) and eval loss against tokens.

The MLPerf log (``mllog.txt``) is `train.output.mlperf`'s and the TensorBoard events
are `train.output.tensorboard_log`'s. On resume, records after the restored step are
dropped so the files describe one consistent history.

The progress display is ours rather than tqdm's or rich's: off a terminal
(logs, CI, SLURM) it prints a plain line every 5% and at each evaluation,
where those libraries write carriage-return redraws into the log file, and on a
terminal its bar is a few lines of code.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from train.jsonsafe import jsonable


def _clean(v: Any) -> Any:
    """Strict JSON: NaN/Inf floats become strings 'nan'/'inf'/'-inf'."""
    return jsonable(v, nonfinite_as_str=True)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSONL file (a torn last line, from a kill, is ignored)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    lines = p.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise
    return out


class MetricsWriteError(OSError):
    """``metrics.jsonl`` cannot be created at the start of a run (the message names the file
    and what to do); later write failures are warnings (`MetricsWriter`)."""


def _warn_stderr(msg: str) -> None:
    print(f"[train] warning: {msg}", file=sys.stderr, flush=True)


class MetricsWriter:
    """Appends step records to ``metrics.jsonl`` (flushed per record) and keeps them in
    ``records`` (the run's summary is computed from these, not by reading the file back).

    The file is the run's, but it can be lost: deleted or replaced while the run writes it
    (noticed before each record by the file's identity and size), the next record recreates it with
    every record this process holds, and `warn` says so; a failed write (disk full, a failing
    file system) is a warning naming the file, the records are kept, and the file is
    rewritten whole once it can be written again; training goes on (a checkpoint on a full
    disk stops the run, keeping the last complete one).

    Args:
      path: the JSONL file.
      resume_step: None starts a fresh file; an int keeps records with
        ``step <= resume_step`` and appends after them (a missing file is a warning: its
        history before the resume step is gone, and the file restarts there).
      warn: receives each warning line (default: stderr).
    """

    def __init__(self, path: str | Path, *, resume_step: int | None,
                 warn: Callable[[str], None] | None = None):
        self.path = Path(path)
        self._warn = warn or _warn_stderr
        self.records: list[dict[str, Any]] = []
        self._f: TextIO | None = None
        self._written = 0  # records of `records` in the file
        self._failing = False  # a write failed; the file is rewritten whole when one succeeds
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                if self.path.is_file():
                    self.records = [r for r in read_jsonl(self.path)
                                    if r.get("step", 0) <= resume_step]
                else:
                    self._warn(f"the metrics file {self.path} is missing (deleted since the run's "
                               f"last segment): the records up to step {resume_step} are lost, "
                               f"and it restarts at step {resume_step + 1}. The checkpoint and "
                               "the run are intact (docs/RELIABILITY.md)")
            self._rewrite()
        except OSError as e:
            raise MetricsWriteError(
                f"cannot write the metrics file {self.path} ({e.strerror or e}); free space on "
                "its file system or fix its permissions, then run the same command again "
                "(nothing was trained yet in this process)") from None

    def _intact(self) -> bool:
        """Whether the file at `path` is still the one this writer holds open, as it left it
        (not deleted, replaced, truncated or written by another)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._opened and st.st_size == self._f.tell()

    def _rewrite(self) -> None:
        """The file from scratch, holding every record (written beside it, then renamed in)."""
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        try:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self._f = open(self.path, "a")  # noqa: SIM115 (closed by close())
        st = os.fstat(self._f.fileno())
        self._opened = (st.st_dev, st.st_ino)
        self._written = len(self.records)

    def write(self, record: Mapping[str, Any]) -> None:
        self.records.append(_clean(dict(record)))
        self._sync()

    def _sync(self) -> None:
        try:
            if self._failing:
                self._rewrite()
                self._failing = False
                self._warn(f"the metrics file {self.path} is written again ({len(self.records)} "
                           "records, none lost)")
                return
            if not self._intact():
                self._rewrite()
                self._warn(f"the metrics file {self.path} was deleted, replaced or changed "
                           f"while the run wrote it; recreated it with the {len(self.records)} "
                           "records of this process (from its first step on)")
                return
            self._f.write("".join(json.dumps(r) + "\n" for r in self.records[self._written:]))
            self._f.flush()
            self._written = len(self.records)
        except OSError as e:
            if not self._failing:
                self._warn(f"cannot write the metrics file {self.path} ({e.strerror or e}); "
                           "free space on its file system. The records are kept and the file "
                           "is rewritten whole once it can be written; training goes on (a "
                           "checkpoint that cannot be written stops the run, keeping the last "
                           "complete one)")
            self._failing = True

    @property
    def complete(self) -> bool:
        """Whether the file holds every record (no write is failing)."""
        return not self._failing and self._written == len(self.records)

    def close(self) -> None:
        """A last try at a failing file, then closes it (never raises: the run's checkpoint
        is saved after it; `complete` says whether the file holds every record)."""
        if self._failing:
            self._sync()
            if self._failing:
                self._warn(f"the metrics file {self.path} lacks the last "
                           f"{len(self.records) - self._written} of {len(self.records)} "
                           "records: it could not be written; summary.json holds the run's "
                           "result")
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None


class Tee:
    """Hands each record to several writers (anything with ``write(record)`` and ``close()``)."""

    def __init__(self, *writers: Any):
        self.writers = writers

    def write(self, record: Mapping[str, Any]) -> None:
        for w in self.writers:
            w.write(record)

    def close(self) -> None:
        for w in self.writers:
            w.close()


def _fmt_time(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """Progress display on stderr: a live bar on a terminal, periodic lines otherwise.

    The ETA counts training steps only: the mean duration of the steps after the first one
    of this process (``step_s`` of each `update`; the first includes the compilation), times
    the steps left. It is shown from the second step of a process on.
    """

    def __init__(self, total: int, *, mode: str = "auto", start: int = 0,
                 stream: TextIO | None = None, label: str = ""):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode, self.total, self.start, self.label = mode, total, start, label
        self.t0 = time.time()
        self.every = max(1, total // 20)
        self.eval_loss: float | None = None
        self._open = False
        self._timed_steps, self._timed_s = 0, 0.0  # the steps after the first, and their time

    def eta_s(self, step: int) -> float | None:
        """Seconds left after `step` at the mean duration of the steps timed so far (None
        before any)."""
        if not self._timed_steps:
            return None
        return self._timed_s / self._timed_steps * (self.total - step)

    def update(self, step: int, *, loss: float | None, tokens_per_s: float | None,
               eval_loss: float | None = None, force: bool = False,
               step_s: float | None = None) -> None:
        """Shows `step` (done); `step_s`: how long it took (the ETA's input; the first step
        of this process, which compiles, is not counted)."""
        if step_s is not None and step > self.start + 1:
            self._timed_steps, self._timed_s = self._timed_steps + 1, self._timed_s + step_s
        if self.mode == "off":
            return
        if eval_loss is not None:
            self.eval_loss = eval_loss
        elapsed = time.time() - self.t0
        eta = self.eta_s(step)
        parts = [f"{self.label}step {step}/{self.total}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if self.eval_loss is not None:
            parts.append(f"eval {self.eval_loss:.4f}")
        if tokens_per_s:
            parts.append(f"{tokens_per_s:,.0f} tok/s")
        parts.append(f"{_fmt_time(elapsed)} elapsed" + (
            "" if step >= self.total else f", ETA {_fmt_time(eta)}" if eta is not None else
            f", ETA from step {self.start + 2}"))
        text = " | ".join(parts)
        if self.mode == "bar":
            width = 24
            fill = int(width * step / max(1, self.total))
            self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {text}\x1b[K")
            self._open = True
            self.stream.flush()
        elif force or eval_loss is not None or step % self.every == 0 or step == self.total:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def plot_losses(records: list[Mapping[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Write a PNG of train loss (raw + centred moving average) and eval loss against tokens."""
    def num(v):
        return v if isinstance(v, (int, float)) and math.isfinite(v) else None

    tr = [(r["tokens"], num(r.get("loss"))) for r in records if num(r.get("loss")) is not None]
    ev = [(r["tokens"], num(r.get("eval_loss"))) for r in records
          if num(r.get("eval_loss")) is not None]
    # Drawn without pyplot (no global backend or figure registry to touch); imported here
    # because a run without a plot should not pay matplotlib's import (~0.5 s per process).
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.subplots()
    if tr:
        x, y = zip(*tr)
        ax.plot(x, y, color="tab:blue", alpha=0.25, lw=0.8, label="train loss")
        half = max(1, len(y) // 40)  # centered moving average: no lag
        if len(y) > 2 * half:
            avg = [sum(y[max(0, i - half):i + half + 1]) / len(y[max(0, i - half):i + half + 1])
                   for i in range(len(y))]
            ax.plot(x, avg, color="tab:blue", lw=1.5,
                    label=f"train loss (moving average of {2 * half + 1})")
    if ev:
        x, y = zip(*ev)
        ax.plot(x, y, "o-", color="tab:red", ms=3.5, lw=1.3, label="eval loss")
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p)
    return p
