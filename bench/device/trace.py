"""Per-kernel device times from the trace ``jax.profiler.trace`` writes, without tensorboard.

``jax.profiler.trace(log_dir)`` (jax 0.11 and 0.12 alike) writes, under
``log_dir/plugins/profile/<run>/``, ``<host>.xplane.pb`` (the XSpace protobuf) and
``<host>.trace.json.gz``: the same events as Chrome trace-event JSON (the trace viewer's
form; ``create_perfetto_trace=True`` adds ``perfetto_trace.json.gz``, the same JSON
without its ``metadata``). This module reads the JSON, which needs only ``gzip`` and
``json``:

* ``traceEvents``: ``ph: "M"`` events name each process (``process_name``) and thread
  (``thread_name``); ``ph: "X"`` events are spans with ``ts`` and ``dur`` in
  microseconds, ``name`` and ``args``.
* On a GPU each device is a process ``/device:GPU:<n>``. Its threads are the CUDA
  streams (``Stream #<id>(...)``: one event per kernel or memcpy, named by the kernel,
  ``args`` with ``hlo_module`` and ``hlo_op``, the HLO instruction that launched it)
  and lines the profiler derives from them (``XLA Modules``, ``XLA Ops``, ``Steps``,
  ``Launch Stats``, ...), which repeat the same time and are not counted here.
* On the CPU there is no device process: XLA:CPU runs each HLO instruction (a thunk) on
  a host thread of ``/host:CPU``, one event with ``args.hlo_op`` per run.

`kernel_times` sums the device time of each kernel (one name, one HLO op) and puts it in a
class (`KERNEL_CLASSES`): by its HLO instruction when the compiled program's text is given
(`hlo_classes`: a GEMM by its operand types), else by the kernel's name.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["DERIVED_LINES", "KERNEL_CLASSES", "KernelTime", "TraceError", "class_totals",
           "find_trace_file", "hlo_classes", "kernel_times", "load_trace"]

# Classes, in the order tables print them. A GEMM's class names its operand types:
# 'gemm bf16', 'gemm e4m3xe4m3', 'gemm e5m2xe4m3', 'gemm f4e2m1fn...' (`gemm_class`).
KERNEL_CLASSES = ("gemm", "attention", "fusion/quantize", "copy", "other")
# Lines of a device process that the profiler derives from the stream lines.
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Async XLA Ops", "Steps", "Launch Stats",
                 "Framework Name Scope", "Framework Ops", "TensorFlow Name Scope",
                 "TensorFlow Ops", "Source code", "Host Offload Ops", "_counters_")
_DEVICE_PROCESS = re.compile(r"^/device:(GPU|TPU):\d+")
_TRACE_GLOB = "*.trace.json.gz"
_SHORT_DTYPE = {"f8e4m3fn": "e4m3", "f8e5m2": "e5m2", "f4e2m1fn": "e2m1"}


class TraceError(ValueError):
    """A trace that is missing or cannot be read; the message names the file and what to do."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelTime:
    """One kernel's device time over the trace: ``count`` runs, ``total_us`` in all."""

    name: str  # the kernel's name (GPU) or the HLO instruction's (CPU)
    hlo_op: str  # the HLO instruction that launched it ('' if the trace does not say)
    kernel_class: str  # 'gemm <operands>' or one of KERNEL_CLASSES[1:]
    count: int
    total_us: float


def find_trace_file(path: str | Path) -> Path:
    """The trace JSON at `path`: the file itself, or in a ``jax.profiler.trace`` log_dir
    the newest run's ``*.trace.json.gz``."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.exists():
        raise TraceError(f"{path}: no such trace file or directory; pass the log_dir given to "
                         "jax.profiler.trace or its <host>.trace.json.gz")
    runs = [p for p in (path / "plugins" / "profile").glob("*") if p.is_dir()]
    found = sorted((f for run in runs for f in run.glob(_TRACE_GLOB)),
                   key=lambda f: f.stat().st_mtime)
    if not found:
        found = sorted(path.glob(_TRACE_GLOB), key=lambda f: f.stat().st_mtime)
    if not found:
        raise TraceError(f"{path}: no {_TRACE_GLOB} under it (nor under plugins/profile/*/); "
                         "was the profile captured (jax.profiler.trace(log_dir)) and did the "
                         "traced code run on the device before the trace stopped?")
    return found[-1]


def load_trace(path: str | Path) -> dict:
    """The trace's JSON object (``.json.gz`` or ``.json``) from a file or log_dir."""
    file = find_trace_file(path)
    try:
        raw = file.read_bytes()
        text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        trace = json.loads(text)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{file}: not a readable trace ({type(e).__name__}: {e}); expected "
                         "the Chrome trace JSON that jax.profiler.trace writes "
                         "(<host>.trace.json.gz); capture the profile again") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(f"{file}: no 'traceEvents' list; expected the Chrome trace JSON that "
                         "jax.profiler.trace writes (<host>.trace.json.gz)")
    return trace


def gemm_class(lhs: str, rhs: str) -> str:
    """'gemm e4m3xe4m3' from two HLO element types ('gemm bf16' when both are bf16)."""
    a, b = (_SHORT_DTYPE.get(t, t) for t in (lhs, rhs))
    return f"gemm {a}" if a == b and a in ("bf16", "f16", "f32") else f"gemm {a}x{b}"


def hlo_classes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> kernel class, from a compiled program's optimized HLO
    (``compiled.as_text()``): GEMMs by the operand types the multiply reads."""
    from bench.costmodel import hlo_kernels as hk

    gemms: dict[str, str] = {}
    for name, _how, types, _op in hk.gemm_operand_types(hlo_text):
        gemms.setdefault(name, gemm_class(*(tuple(types) + ("?", "?"))[:2]))
    out = {}
    for k in hk.kernels(hlo_text):
        if k.target.startswith("__cudnn$fmha"):
            out[k.name] = "attention"
        elif k.name in gemms:
            out[k.name] = gemms[k.name]
        elif k.category in ("fusion", "custom-call"):
            out[k.name] = "fusion/quantize"
        elif k.category == "copy":
            out[k.name] = "copy"
        else:
            out[k.name] = "other"
    return out


def _class_by_name(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("fmha", "flash", "attention", "softmax_fwd", "sdpa")):
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "xmma", "cutlass", "matmul", "dot")):
        return "gemm ?"
    if n.startswith(("memcpy", "memset")) or "copy" in n:
        return "copy"
    if "fusion" in n or n.startswith("triton") or "reduce" in n or "convert" in n:
        return "fusion/quantize"
    return "other"


def _lanes(events: list) -> tuple[set, set]:
    """(device kernel lanes, host lanes) as (pid, tid) pairs."""
    process = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device, host = set(), set()
    for (pid, tid), name in threads.items():
        if _DEVICE_PROCESS.match(process.get(pid, "")):
            if name not in DERIVED_LINES:
                device.add((pid, tid))
        elif process.get(pid, "").startswith("/host:"):
            host.add((pid, tid))
    return device, host


def kernel_times(trace: Mapping, classes: Mapping[str, str] | None = None, *,
                 hlo_module: str | None = None) -> list[KernelTime]:
    """Device time per kernel of a loaded trace, longest first.

    Args:
      trace: `load_trace`'s object.
      classes: HLO instruction name -> class (`hlo_classes`); a kernel whose HLO op is
        not in it is classed by its name.
      hlo_module: count only kernels of this HLO module (``args.hlo_module``, e.g.
        'jit_step'); None: every module.
    Raises:
      TraceError: the trace has no kernel events (no device lane with events, and no
        XLA:CPU op on a host lane), or none of `hlo_module`.
    """
    events = trace["traceEvents"]
    device, host = _lanes(events)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if any((e.get("pid"), e.get("tid")) in device for e in spans):
        kernels = [e for e in spans if (e.get("pid"), e.get("tid")) in device]
    else:  # XLA:CPU: the ops on host threads
        kernels = [e for e in spans if (e.get("pid"), e.get("tid")) in host
                   and e.get("args", {}).get("hlo_op")
                   and not str(e.get("name", "")).startswith("end: ")]
    if hlo_module is not None:
        kernels = [e for e in kernels if e.get("args", {}).get("hlo_module") == hlo_module]
    if not kernels:
        where = f" of HLO module {hlo_module!r}" if hlo_module else ""
        raise TraceError(f"the trace has no kernel events{where}: no /device:GPU:<n> stream "
                         "with events and no XLA:CPU op (args.hlo_op) on a /host: thread. "
                         "Run the profiled function (and block_until_ready) inside "
                         "jax.profiler.trace, after a warm-up call that compiles it")
    classes = dict(classes or {})
    # XLA names a fusion's kernel after the instruction, '.' made '_' ('fusion.3' ->
    # 'fusion_3'): a kernel inside a CUDA graph may carry no hlo_op, only that name.
    by_kernel_name = {op.replace(".", "_"): cls for op, cls in classes.items()}
    totals: dict[tuple[str, str], list] = {}
    for e in kernels:
        op = str(e.get("args", {}).get("hlo_op", "")).lstrip("%")
        key = (str(e.get("name", "")), op)
        acc = totals.setdefault(key, [0, 0.0])
        acc[0] += 1
        acc[1] += float(e["dur"])
    out = [KernelTime(name=name, hlo_op=op,
                      kernel_class=(classes.get(op) or classes.get(name)
                                    or by_kernel_name.get(name) or _class_by_name(name)),
                      count=n, total_us=us)
           for (name, op), (n, us) in totals.items()]
    return sorted(out, key=lambda k: (-k.total_us, k.name))


def class_totals(kernels: list[KernelTime]) -> dict[str, float]:
    """Microseconds per class, GEMM classes first (by name), then KERNEL_CLASSES' order."""
    out: dict[str, float] = {}
    for k in kernels:
        out[k.kernel_class] = out.get(k.kernel_class, 0.0) + k.total_us

    def order(c: str):
        base = "gemm" if c.startswith("gemm") else c
        return (KERNEL_CLASSES.index(base) if base in KERNEL_CLASSES else len(KERNEL_CLASSES), c)

    return {c: out[c] for c in sorted(out, key=order)}
