"""The measurement file a device run writes for the calibrated cost model (schema 1).

``bench/costmodel/calibration/<chip>-<date>.json`` (the cost model's loader,
``bench/costmodel/calibration.py``, reads it)::

    {"schema": 1, "chip": "h200",
     "provenance": {"date", "jax", "command", "commit", "device"},
     "gemms": [{"operands", "m", "n", "k", "implementation", "setting", "tflops"}],
     "copy_bandwidth_gbs": float | null, "launch_overhead_us": float | null,
     "layers": [{"program", "seq", "policy", "ms"}],
     "kernels": [{"policy", "class", "name", "count", "total_us"}]}

`check` states the schema (the fields, their kinds and choices) so that a run cannot
write a file the loader refuses; `write` checks, then writes atomically.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import subprocess
from pathlib import Path

__all__ = ["GEMM_IMPLEMENTATIONS", "GEMM_OPERANDS", "SCHEMA", "SchemaError", "check", "file_name",
           "provenance", "write"]

SCHEMA = 1
GEMM_OPERANDS = ("bf16", "e4m3xe4m3", "e5m2xe4m3", "mxfp8", "nvfp4", "mxfp4")
GEMM_IMPLEMENTATIONS = ("cublaslt", "triton", "cudnn", "unknown")
_FIELDS = {
    "": ("schema", "chip", "provenance", "gemms", "copy_bandwidth_gbs", "launch_overhead_us",
         "layers", "kernels"),
    "provenance": ("date", "jax", "command", "commit", "device"),
    "gemms": ("operands", "m", "n", "k", "implementation", "setting", "tflops"),
    "layers": ("program", "seq", "policy", "ms"),
    "kernels": ("policy", "class", "name", "count", "total_us"),
}
class SchemaError(ValueError):
    """A measurement file that is not schema 1; the message names the field."""


_CHIP = re.compile(r"^[a-z0-9_]+$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def _fields(where: str, entry, names) -> None:
    if not isinstance(entry, dict) or sorted(entry) != sorted(names):
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise SchemaError(f"{where}: expected the fields {list(names)}, got {got}")


def _text(where: str, value, choices=()) -> None:
    if not isinstance(value, str) or not value.strip() or (choices and value not in choices):
        want = f"one of {list(choices)}" if choices else "a non-empty string"
        raise SchemaError(f"{where}: expected {want}, got {value!r}")


def _positive(where: str, value, *, integer=False, nullable=False) -> None:
    if value is None and nullable:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not (
            value > 0 and math.isfinite(value)):
        raise SchemaError(f"{where}: expected a positive {'integer' if integer else 'number'}"
                         f"{' or null' if nullable else ''}, got {value!r}")


def check(doc: dict) -> None:
    """Raises SchemaError (a ValueError) naming the field where `doc` is not schema 1."""
    _fields("measurements", doc, _FIELDS[""])
    if doc["schema"] != SCHEMA:
        raise SchemaError(f"measurements.schema: expected {SCHEMA}, got {doc['schema']!r}")
    if not isinstance(doc["chip"], str) or not _CHIP.match(doc["chip"]):
        raise SchemaError(f"measurements.chip: expected lower-case letters, digits and _, "
                         f"got {doc['chip']!r}")
    _fields("provenance", doc["provenance"], _FIELDS["provenance"])
    for k, v in doc["provenance"].items():
        _text(f"provenance.{k}", v)
    if not _DATE.match(doc["provenance"]["date"]):
        raise SchemaError(f"provenance.date: expected YYYY-MM-DD, got "
                         f"{doc['provenance']['date']!r}")
    _positive("copy_bandwidth_gbs", doc["copy_bandwidth_gbs"], nullable=True)
    _positive("launch_overhead_us", doc["launch_overhead_us"], nullable=True)
    for part in ("gemms", "layers", "kernels"):
        if not isinstance(doc[part], list):
            raise SchemaError(f"{part}: expected a list, got {doc[part]!r:.40}")
        for i, e in enumerate(doc[part]):
            where = f"{part}[{i}]"
            _fields(where, e, _FIELDS[part])
            if part == "gemms":
                _text(f"{where}.operands", e["operands"], GEMM_OPERANDS)
                _text(f"{where}.implementation", e["implementation"], GEMM_IMPLEMENTATIONS)
                _text(f"{where}.setting", e["setting"])
                for d in ("m", "n", "k"):
                    _positive(f"{where}.{d}", e[d], integer=True)
                _positive(f"{where}.tflops", e["tflops"])
            elif part == "layers":
                _text(f"{where}.program", e["program"])
                _text(f"{where}.policy", e["policy"])
                _positive(f"{where}.seq", e["seq"], integer=True)
                _positive(f"{where}.ms", e["ms"])
            else:
                for f in ("policy", "class", "name"):
                    _text(f"{where}.{f}", e[f])
                _positive(f"{where}.count", e["count"], integer=True)
                _positive(f"{where}.total_us", e["total_us"])


def _commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=root,
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               check=False, cwd=root, capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"
    if out.returncode != 0:
        return "unknown (not a git checkout)"
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def provenance(*, command: str, device: str, jax_version: str, root: Path) -> dict:
    """The run's provenance: today's UTC date, jax, the command line, the commit, the
    device."""
    return {"date": datetime.datetime.now(datetime.UTC).date().isoformat(),
            "jax": jax_version, "command": command, "commit": _commit(root), "device": device}


def file_name(chip: str, date: str, tag: str = "") -> str:
    return f"{chip}-{date}{'-' + tag if tag else ''}.json"


def write(doc: dict, directory: Path, tag: str = "") -> Path:
    """Checks `doc` and writes it as ``<chip>-<date>[-<tag>].json`` in `directory`
    (atomically: a stopped run leaves the previous file whole)."""
    check(doc)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / file_name(doc["chip"], doc["provenance"]["date"], tag)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path
