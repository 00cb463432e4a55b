"""The 8B layer per policy: timed against bf16, then profiled kernel by kernel.

The program is `bench.costmodel.programs.layer_program` (one Llama 3.1-8B decoder layer's
train step, micro-batch 1, seq 8192; a tiny layer in a dry run). Every row is compiled
first (a row that cannot be built or compiled says why; the first row even past
the deadline), called twice to warm up, then
timed in interleaved rounds (one call per row per round, the rows' order rotating),
at least `MIN_ROUNDS` of them: the median and its ratio to the bf16 row.

Then each timed row is called `PROFILED_CALLS` times inside ``jax.profiler.trace``; the
trace (`bench.device.trace`) gives each kernel's device time, classed by the compiled
program's HLO (`bench.device.trace.hlo_classes`), and the calibrated cost model's estimate
per class (`bench.device.estimate.model_estimate_us`, reading the instruction counts of the
compile's XLA dump) is printed beside it.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax

from bench.device import estimate, trace
from bench.device.harness import Pace, Table, elapsed, log, short_error
from bench.device.sections.layer8b import LayerRow

__all__ = ["MIN_ROUNDS", "PROFILED_CALLS", "LayerResult", "layer_profile_section"]

MIN_ROUNDS = 5
PROFILED_CALLS = 2


@dataclasses.dataclass(kw_only=True)
class LayerResult:
    """One row's measurements (ms None where it was not timed: `why` says why)."""

    row: LayerRow
    program: str = ""
    seq: int = 0
    ms: float | None = None
    rounds: int = 0
    why: str = ""
    kernels: list = dataclasses.field(default_factory=list)  # trace.KernelTime, per call x N
    estimate_us: dict = dataclasses.field(default_factory=dict)  # class -> us per call


def _build(row: LayerRow, size: str, seq: int, dump: Path):
    """The row's compiled program (its XLA dump, PTX and thunk sequence, under ``dump``:
    the model's instruction counts) and its abstract arguments."""
    from bench.costmodel import programs, ptx_cost
    from mxjax import policies

    policy = policies.get(row.preset)
    if row.backend is not None:
        policy = policy.with_backend(row.backend)
    fn, abstract = programs.layer_program(policy, 1, seq, size=size,
                                          attention_impl=row.attention)
    return jax.jit(fn).lower(*abstract).compile(ptx_cost.dump_options(dump)), abstract


def _profile(compiled, args, log_dir: Path) -> list:
    with jax.profiler.trace(str(log_dir)):
        for _ in range(PROFILED_CALLS):
            jax.block_until_ready(compiled(*args))
    return trace.kernel_times(trace.load_trace(log_dir), trace.hlo_classes(compiled.as_text()))


def layer_profile_section(table: Table, rows_spec: list[LayerRow], *, size: str, seq: int,
                          program: str, chip: str | None, deadline: float,
                          profile_deadline) -> list[LayerResult]:
    """Times every row until `deadline`, then profiles them until `profile_deadline()`
    (called when the profiles start, so that time the timing left unused passes on; the
    first timed row is profiled whatever the time)."""
    from bench.costmodel import programs

    results = [LayerResult(row=r, program=program, seq=seq) for r in rows_spec]
    live: dict[int, tuple] = {}  # index -> (compiled, args, times)
    args_cache: dict = {}
    pace = Pace(deadline)
    dump_root = Path(tempfile.mkdtemp(prefix="mxjax-dump-"))  # removed with the profiles'
    for i, res in enumerate(results):
        if i > 0 and not pace.ok(reserve=MIN_ROUNDS * 0.5):  # the first row: always
            res.why = "skipped (time budget)"
            continue
        t0 = time.perf_counter()
        log(f"layer: compiling {res.row.label}")
        try:
            compiled, abstract = _build(res.row, size, seq, dump_root / str(i))
            key = str(jax.tree.map(lambda a: (a.shape, str(a.dtype)), abstract))
            if key not in args_cache:
                args_cache[key] = programs.concrete_args(abstract)
            args = args_cache[key]
            for _ in range(2):
                jax.block_until_ready(compiled(*args))
            live[i] = (compiled, args, [])
            log(f"layer: {res.row.label} compiled and warm in {time.perf_counter() - t0:.1f} s")
        except Exception as e:  # noqa: BLE001 - a row that cannot build says why
            res.why = short_error(e)
            log(f"layer: {res.row.label}: {res.why}")
        finally:
            pace.took(time.perf_counter() - t0)
    order = list(live)
    for n in range(MIN_ROUNDS * 4):
        if n >= MIN_ROUNDS and elapsed() > deadline:
            break
        k = n % len(order) if order else 0
        for i in order[k:] + order[:k]:
            compiled, args, times = live[i]
            t = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t)
    for i, (_, _, times) in live.items():
        results[i].ms = statistics.median(times) * 1e3
        results[i].rounds = len(times)
    profile_pace = Pace(profile_deadline())
    log_root = Path(tempfile.mkdtemp(prefix="mxjax-profile-"))
    try:
        for i, (compiled, args, _) in live.items():
            res = results[i]
            if i != order[0] and not profile_pace.ok():
                res.why = "not profiled (time budget)"
                continue
            t0 = time.perf_counter()
            try:
                res.kernels = _profile(compiled, args, log_root / str(i))
                res.estimate_us = estimate.model_estimate_us(compiled.as_text(), chip,
                                                             dump=dump_root / str(i))
            except Exception as e:  # noqa: BLE001 - the profile's failure is a note
                res.why = f"profile: {short_error(e)}"
                log(f"layer profile {res.row.label}: {res.why}")
            finally:
                profile_pace.took(time.perf_counter() - t0)
    finally:
        shutil.rmtree(log_root, ignore_errors=True)
        shutil.rmtree(dump_root, ignore_errors=True)
    _publish(table, results, chip)
    live.clear()
    args_cache.clear()
    return results


def _publish(table: Table, results: list[LayerResult], chip: str | None) -> None:
    base = next((r.ms for r in results if r.row.is_baseline and r.ms), None)
    rows = table.section(f"{results[0].program if results else 'layer'}, seq "
                         f"{results[0].seq if results else '?'}, fwd+bwd (ms, vs bf16)",
                         ("policy", "ms (median)", "rounds", "vs bf16", "note"))
    for r in results:
        rows.append((r.row.label, f"{r.ms:.3f}" if r.ms else "n/a", str(r.rounds or ""),
                     f"{r.ms / base:.2f}x" if r.ms and base else "", r.why))
    model = estimate.MODEL_NAME if chip else "no model for this chip"
    for r in results:
        if not r.kernels:
            continue
        prof = table.section(f"Kernel classes of {r.row.label} (us per call; model: {model})",
                             ("class", "measured us", "share", "model us", "model/measured",
                              "kernels"))
        totals = trace.class_totals(r.kernels)
        whole = sum(totals.values())
        for cls, us in totals.items():
            per_call = us / PROFILED_CALLS
            est = r.estimate_us.get(cls)
            n = sum(k.count for k in r.kernels if k.kernel_class == cls) // PROFILED_CALLS
            prof.append((cls, f"{per_call:10.1f}", f"{us / whole:6.1%}",
                         f"{est:10.1f}" if est is not None else "-",
                         f"{est / per_call:5.2f}" if est else "-", str(n)))
        missing = sorted(set(r.estimate_us) - set(totals))
        if missing:
            prof.append(f"model classes with no measured kernel: {', '.join(missing)}")
