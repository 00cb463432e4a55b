"""Measurement files of a chip, read and checked: what the calibrated cost model charges at.

One JSON file per device run under ``bench/costmodel/calibration/``, named
``<chip>-<date>.json`` (``<chip>-<date>-<tag>.json`` when one day has several runs), written
by a GPU run (bench/device/) or by hand from recorded figures. Schema 1::

    {"schema": 1, "chip": "h200",
     "provenance": {"date", "jax", "command", "commit", "device"},
     "gemms": [{"operands": "bf16" | "e4m3xe4m3" | "e5m2xe4m3" | "mxfp8" | "nvfp4" | "mxfp4",
                "m", "n", "k", "implementation": "cublaslt" | "triton" | "cudnn" | "unknown",
                "setting": str, "tflops": float}],
     "copy_bandwidth_gbs": float | null, "launch_overhead_us": float | null,
     "layers": [{"program": "layer_8b", "seq": 8192, "policy": str, "ms": float}],
     "kernels": [{"policy": str, "class": str, "name": str, "count": int,
                  "total_us": float}]}

``copy_bandwidth_gbs`` counts the bytes read plus the bytes written; a figure that was not
measured is ``null`` (never a guess). :func:`load` raises :class:`CalibrationError` naming
the file and the field at fault.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

__all__ = ["CALIBRATION_DIR", "GEMM_IMPLEMENTATIONS", "GEMM_OPERANDS", "Calibration",
           "CalibrationError", "GemmRate", "KernelTime", "LayerTime", "RunProvenance",
           "for_chip", "load", "load_all"]

CALIBRATION_DIR = Path(__file__).resolve().parent / "calibration"
SCHEMA = 1
GEMM_OPERANDS = ("bf16", "e4m3xe4m3", "e5m2xe4m3", "mxfp8", "nvfp4", "mxfp4")
GEMM_IMPLEMENTATIONS = ("cublaslt", "triton", "cudnn", "unknown")
_NAME_RE = re.compile(r"^(?P<chip>[a-z0-9_]+)-(?P<date>\d{4}-\d{2}-\d{2})(?:-[\w.]+)?\.json$")


class CalibrationError(ValueError):
    """A calibration file is missing, malformed, or not where its name says."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunProvenance:
    """The run a file records: its date, jax version, command, commit and device."""

    date: str
    jax: str
    command: str
    commit: str
    device: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmRate:
    """One GEMM timed on the chip: operand class, shape, implementation, setting, TFLOP/s."""

    operands: str
    m: int
    n: int
    k: int
    implementation: str
    setting: str
    tflops: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerTime:
    """One program's step time under one policy (milliseconds)."""

    program: str
    seq: int
    policy: str
    ms: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelTime:
    """Device time of one kernel class of a program or microbenchmark: ``count`` launches
    taking ``total_us`` microseconds together. ``kind`` is the file's ``class`` field."""

    policy: str
    kind: str
    name: str
    count: int
    total_us: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """One measurement file, checked."""

    path: Path
    chip: str
    provenance: RunProvenance
    gemms: tuple[GemmRate, ...]
    copy_bandwidth_gbs: float | None
    launch_overhead_us: float | None
    layers: tuple[LayerTime, ...]
    kernels: tuple[KernelTime, ...]

    def layer_ms(self, policy: str, program: str = "layer_8b", seq: int = 8192) -> float:
        """The measured time of ``policy``'s row (KeyError naming the rows there are)."""
        for row in self.layers:
            if (row.program, row.seq, row.policy) == (program, seq, policy):
                return row.ms
        raise KeyError(f"{self.path.name}: no layer row {program} seq {seq} {policy!r}; it "
                       f"has {[(r.program, r.seq, r.policy) for r in self.layers]}")

    def kernel(self, name: str) -> KernelTime:
        """The kernel row named ``name`` (KeyError naming the rows there are)."""
        for row in self.kernels:
            if row.name == name:
                return row
        raise KeyError(f"{self.path.name}: no kernel row {name!r}; it has "
                       f"{[r.name for r in self.kernels]}")


def _fields(where: str, entry: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise CalibrationError(f"{where}: expected an object, got {type(entry).__name__}")
    missing = [n for n in names if n not in entry]
    extra = sorted(set(entry) - set(names))
    if missing or extra:
        raise CalibrationError(f"{where}: expected the fields {list(names)}; missing "
                               f"{missing}, unknown {extra}")
    return entry


def _text(where: str, value: Any, choices: tuple[str, ...] = ()) -> str:
    if not isinstance(value, str) or not value.strip():
        raise CalibrationError(f"{where}: expected a non-empty string, got {value!r}")
    if choices and value not in choices:
        raise CalibrationError(f"{where}: expected one of {list(choices)}, got {value!r}")
    return value


def _positive(where: str, value: Any, *, integer: bool = False, nullable: bool = False):
    if value is None and nullable:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not (
            value > 0 and math.isfinite(value)):
        what = "a positive integer" if integer else "a positive number"
        raise CalibrationError(f"{where}: expected {what}{' or null' if nullable else ''}, "
                               f"got {value!r}")
    return int(value) if integer else float(value)


def _list(where: str, value: Any) -> list:
    if not isinstance(value, list):
        raise CalibrationError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _gemm(where: str, entry: Any) -> GemmRate:
    e = _fields(where, entry, ("operands", "m", "n", "k", "implementation", "setting",
                               "tflops"))
    return GemmRate(operands=_text(f"{where}.operands", e["operands"], GEMM_OPERANDS),
                    m=_positive(f"{where}.m", e["m"], integer=True),
                    n=_positive(f"{where}.n", e["n"], integer=True),
                    k=_positive(f"{where}.k", e["k"], integer=True),
                    implementation=_text(f"{where}.implementation", e["implementation"],
                                         GEMM_IMPLEMENTATIONS),
                    setting=_text(f"{where}.setting", e["setting"]),
                    tflops=_positive(f"{where}.tflops", e["tflops"]))


def _layer(where: str, entry: Any) -> LayerTime:
    e = _fields(where, entry, ("program", "seq", "policy", "ms"))
    return LayerTime(program=_text(f"{where}.program", e["program"]),
                     seq=_positive(f"{where}.seq", e["seq"], integer=True),
                     policy=_text(f"{where}.policy", e["policy"]),
                     ms=_positive(f"{where}.ms", e["ms"]))


def _kernel(where: str, entry: Any) -> KernelTime:
    e = _fields(where, entry, ("policy", "class", "name", "count", "total_us"))
    return KernelTime(policy=_text(f"{where}.policy", e["policy"]),
                      kind=_text(f"{where}.class", e["class"]),
                      name=_text(f"{where}.name", e["name"]),
                      count=_positive(f"{where}.count", e["count"], integer=True),
                      total_us=_positive(f"{where}.total_us", e["total_us"]))


def load(path: str | Path) -> Calibration:
    """Reads and checks one measurement file.

    Raises CalibrationError naming the file and the field when it cannot be read, is not
    schema 1, misses or adds a field, holds a value of the wrong kind, or its name does
    not match its chip and date.
    """
    path = Path(path)
    name = str(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CalibrationError(f"{name}: cannot read the calibration file ({e})") from None
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise CalibrationError(f"{name}: expected an object with \"schema\": {SCHEMA} "
                               "(bench/costmodel/calibration.py documents the fields)")
    e = _fields(name, doc, ("schema", "chip", "provenance", "gemms", "copy_bandwidth_gbs",
                            "launch_overhead_us", "layers", "kernels"))
    chip = _text(f"{name}: chip", e["chip"])
    p = _fields(f"{name}: provenance", e["provenance"],
                tuple(f.name for f in dataclasses.fields(RunProvenance)))
    prov = RunProvenance(**{k: _text(f"{name}: provenance.{k}", v) for k, v in p.items()})
    m = _NAME_RE.match(path.name)
    if not m or m["chip"] != chip or m["date"] != prov.date:
        raise CalibrationError(
            f"{name}: the file name must be <chip>-<date>.json (or <chip>-<date>-<tag>.json) "
            f"with the file's chip {chip!r} and provenance.date {prov.date!r}; rename it")
    return Calibration(
        path=path, chip=chip, provenance=prov,
        gemms=tuple(_gemm(f"{name}: gemms[{i}]", g)
                    for i, g in enumerate(_list(f"{name}: gemms", e["gemms"]))),
        copy_bandwidth_gbs=_positive(f"{name}: copy_bandwidth_gbs", e["copy_bandwidth_gbs"],
                                     nullable=True),
        launch_overhead_us=_positive(f"{name}: launch_overhead_us", e["launch_overhead_us"],
                                     nullable=True),
        layers=tuple(_layer(f"{name}: layers[{i}]", r)
                     for i, r in enumerate(_list(f"{name}: layers", e["layers"]))),
        kernels=tuple(_kernel(f"{name}: kernels[{i}]", r)
                      for i, r in enumerate(_list(f"{name}: kernels", e["kernels"]))))


def load_all(directory: str | Path = CALIBRATION_DIR) -> tuple[Calibration, ...]:
    """Every measurement file of a directory, checked, in name order."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CalibrationError(f"{directory}: no calibration directory")
    return tuple(load(f) for f in sorted(directory.glob("*.json")))


def for_chip(chip: str, directory: str | Path = CALIBRATION_DIR) -> tuple[Calibration, ...]:
    """The measurement files of one chip, oldest first (CalibrationError when none)."""
    runs = tuple(c for c in load_all(directory) if c.chip == chip)
    if not runs:
        raise CalibrationError(f"{directory}: no calibration file for chip {chip!r}; a GPU "
                               "run writes one (bench/device/)")
    return tuple(sorted(runs, key=lambda c: (c.provenance.date, c.path.name)))
