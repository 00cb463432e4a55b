"""The device scripts' harness: the run's clock and log, timing, sizes, the printed
table, and the time budget shared by the sections (bench/device/gpu.py)."""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

T0 = time.perf_counter()  # imported before jax: the budget counts jax's import
ROOT = Path(__file__).resolve().parents[2]  # the repository root

import jax

STATE: dict = {"doing": "starting", "child": None}  # for the watchdog: last log line, pytest


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    STATE["doing"] = msg
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def timeit(fn, *args, iters: int = 10, warmup: int = 2) -> float:
    """Median seconds per call of a jitted fn (compile in the warm-up)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    copy_elems: int  # f32 elements copied
    gemm_ceiling: int  # bf16 GEMM ceiling size (cube)
    quant: int  # quantize input is quant x quant bf16
    gemm_div: int  # GEMM shapes divided by this
    gemm_shapes: int  # how many of GEMM_SHAPES
    train: tuple[int, int, int]  # batch, seq, layers
    layer: tuple[str, int] | None  # layer8b: (LlamaConfig preset, seq); None: layer_8b's own
    layer_rounds: int = 7  # layer8b: timed rounds (>= MIN_ROUNDS)
    tiny_model: bool = False


FULL = Sizes(copy_elems=1 << 28, gemm_ceiling=8192, quant=8192, gemm_div=1, gemm_shapes=5,
             train=(4, 2048, 16), layer=None)
QUICK = Sizes(copy_elems=1 << 26, gemm_ceiling=4096, quant=4096, gemm_div=2, gemm_shapes=2,
              train=(2, 1024, 4), layer=("llama3_8b", 2048))
# --cpu-smoke: every code path on CPU (Pallas interpreted), numbers meaningless.
SMOKE = Sizes(copy_elems=1 << 16, gemm_ceiling=256, quant=256, gemm_div=64, gemm_shapes=2,
              train=(1, 64, 1), layer=("tiny", 64), layer_rounds=5, tiny_model=True)

SKIPPED = "skipped (time budget)"


class Table:
    def __init__(self):
        self.sections: list[tuple[str, list[tuple[str, ...]]]] = []

    def section(self, title: str, header: tuple[str, ...]):
        """The section's row list (append tuples; a str is a note line below the rows)."""
        rows: list = [header]
        self.sections.append((title, rows))
        return rows

    def render(self) -> str:
        out = ["=" * 100]
        for title, rows in list(self.sections):
            out.append(f"\n## {title}")
            notes = [r for r in rows if isinstance(r, str)]
            rows = [r for r in rows if not isinstance(r, str)]
            ncol = max(len(r) for r in rows)
            rows = [tuple(r) + ("",) * (ncol - len(r)) for r in rows]
            widths = [max(len(str(r[i])) for r in rows) for i in range(ncol)]
            for j, r in enumerate(rows):
                out.append("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
                if j == 0:
                    out.append("  " + "  ".join("-" * w for w in widths))
            out += [f"  {n}" for n in notes]
        out.append("=" * 100)
        return "\n".join(out)

    def print(self):
        print("\n" + self.render(), flush=True)

    def write(self, path: Path | None) -> None:
        """Rewrites `path` with the table so far (None: nothing)."""
        if path is not None:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(self.render() + "\n")
            tmp.replace(path)


def short_error(e: BaseException, limit: int = 110) -> str:
    """'n/a: Type: message' within `limit` characters (the message's first line; its middle
    elided when long, so that the end, e.g. "got 'xla_fp8'", stays)."""
    msg = " ".join(str(e).strip().splitlines()[0].split()) if str(e).strip() else ""
    text = f"n/a: {type(e).__name__}: {msg}"
    if len(text) > limit:
        head = limit * 3 // 5
        text = text[:head] + " ... " + text[-(limit - head - 5):]
    return text


def start_watchdog(limit_s: float, table: Table, *, keeping: str,
                   keep: Callable[[], None]) -> threading.Timer:
    """At `limit_s` seconds of the run: kill the pytest child's process group, call `keep`
    (what saves the run so far; `keeping` says what it does, for the log), print the table
    and exit with code 3, even in the middle of a compile. Cancel the timer to disarm it."""

    def fire():
        print(f"\n[{elapsed():6.1f}s] watchdog: --hard-limit-s {limit_s:.0f} reached while: "
              f"{STATE['doing']}; {keeping} and exiting (3)", flush=True)
        child = STATE.get("child")
        if child is not None and child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        try:
            keep()
        finally:
            table.print()
            os._exit(3)

    timer = threading.Timer(max(0.0, limit_s - elapsed()), fire)
    timer.daemon = True
    timer.start()
    return timer


SECTIONS = ("tests", "ceilings", "layer8b", "quantize", "gemm", "train", "calibration")
DEFAULT_SECTIONS = ("tests", "ceilings", "layer8b", "gemm", "train", "calibration")
# Each chosen measuring section's share of the budget left when it starts: its weight over
# the weights of the sections still to run (about the seconds each needs on the H200). The
# tests have no share: their timeout is half the budget, and what they leave is shared.
SECTION_WEIGHT = {"ceilings": 10, "layer8b": 170, "quantize": 25, "gemm": 70, "train": 60,
                  "calibration": 45}


class Budget:
    """Deadlines (seconds since start) for the sections still to run, out of ``total_s``."""

    def __init__(self, total_s: float, sections):
        self.total_s = total_s
        self.pending = list(sections)

    def start(self, name: str) -> float:
        weights = sum(SECTION_WEIGHT[s] for s in self.pending)
        share = SECTION_WEIGHT[name] / weights
        self.pending.remove(name)
        return elapsed() + max(0.0, self.total_s - elapsed()) * share


class Pace:
    """A section's deadline and its longest step so far: a step starts only when that
    much time (plus ``reserve``) is left before the deadline."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.longest = 0.0

    def ok(self, reserve: float = 0.0) -> bool:
        return elapsed() + self.longest + reserve <= self.deadline

    def took(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)
