"""The measurements and published figures mxjax's choices rest on, read from one data file.

``mxjax/measurements.json`` (shipped inside the package) holds every figure the library
and its benchmarks rely on, each with its provenance: what 'auto' picks per chip and
why (:data:`mxjax.backends.AUTO_CHOICES` names its evidence by key), the benchmarks'
measured and estimated timings, and the published peak rates per chip that the
benchmarks' cost model charges kernels at. Code never carries these numbers: it reads
them here, by key.

Reading::

    from mxjax import measurements

    fig = measurements.figure("layer_8b.h200.measured")   # a Figure
    fig.value("xla_fp8"), fig.unit, fig.provenance.date    # one value, its unit, its date
    h200 = measurements.chip_rates("h200")                 # a ChipRates
    h200.matrix_flops, h200.hbm_bytes_per_s, h200.provenance.source

Records are frozen dataclasses; :func:`load` reads (and checks) a file, the module
functions read the packaged one once. A malformed file raises
:class:`MeasurementsError` naming the file and the entry.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "FIGURE_KINDS",
    "ChipRates",
    "Figure",
    "Measurements",
    "MeasurementsError",
    "Provenance",
    "all_chip_rates",
    "chip_rates",
    "figure",
    "load",
]

# 'measured': timed on the chip; 'estimated': a deviceless compile's cost model;
# 'published': a vendor's figure; 'assumed': a modelling assumption; 'rationale': a
# reason without figures.
FIGURE_KINDS = ("measured", "estimated", "published", "assumed", "rationale")
_DATA_FILE = "measurements.json"


class MeasurementsError(ValueError):
    """The measurements file is malformed, or a key is not in it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Provenance:
    """Where a figure comes from.

    Attributes:
      chip: the chip it was measured or estimated for ('h200', 'b200', ...; '' for none).
      date: ISO date of the run or of the publication read.
      jax: the jax version it ran under ('' for published figures).
      command: the command that printed it ('' for published figures and rationales).
      commit: the repository commit that recorded it.
      source: for published figures, the document they come from ('' otherwise).
    """

    chip: str
    date: str
    jax: str
    command: str
    commit: str
    source: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Figure:
    """One measurement, estimate or rationale: labelled values in one unit.

    Attributes:
      key: its name in the file, e.g. 'layer_8b.h200.measured'.
      kind: one of :data:`FIGURE_KINDS`.
      description: what was measured.
      unit: the values' unit ('ms', 's', ...; '' when there are none).
      values: (label, value) pairs, e.g. (('bf16', ...), ('xla_fp8', ...)).
      note: what the figures mean for a choice ('' when nothing).
      provenance: where they come from.
    """

    key: str
    kind: str
    description: str
    unit: str
    values: tuple[tuple[str, float], ...]
    note: str
    provenance: Provenance

    def value(self, label: str) -> float:
        """The value labelled `label` (KeyError naming the labels there are)."""
        for name, v in self.values:
            if name == label:
                return v
        raise KeyError(f"{self.key}: no value {label!r}; it has {[n for n, _ in self.values]}")

    def summary(self) -> str:
        """One line: the values with their unit, and the provenance."""
        vals = ", ".join(f"{n} {v:g}" for n, v in self.values)
        p = self.provenance
        where = ", ".join(x for x in (p.chip, p.date, p.jax and f"jax {p.jax}") if x)
        return f"{self.key} ({self.kind}; {where}): {vals}{' ' + self.unit if vals else ''}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChipRates:
    """One chip's published dense peaks (no 2:4 sparsity).

    Attributes:
      name: the chip's short name ('h100', 'h200', 'b200', 'mi355x', 'v5e', 'v6e').
      description: e.g. 'NVIDIA H200 SXM 141GB'.
      matrix_flops: (rate class, FLOP/s) pairs, the classes being the operand types of a
        GEMM: 'fp4', 'fp8', 'int8', 'bf16', 'tf32', 'f32'; a class the chip lacks is
        absent.
      hbm_bytes_per_s: peak memory bandwidth.
      provenance: ``provenance.source`` names the vendor documents.
    """

    name: str
    description: str
    matrix_flops: tuple[tuple[str, float], ...]
    hbm_bytes_per_s: float
    provenance: Provenance

    @property
    def source(self) -> str:
        """The published source of the figures."""
        return self.provenance.source


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measurements:
    """The whole file: figures and chip rates, looked up by key."""

    figures: tuple[Figure, ...]
    chip_rates: tuple[ChipRates, ...]

    def figure(self, key: str) -> Figure:
        """The figure named `key` (MeasurementsError naming the keys there are)."""
        for fig in self.figures:
            if fig.key == key:
                return fig
        raise MeasurementsError(f"measurements: no figure {key!r}; known: "
                                f"{sorted(f.key for f in self.figures)}")

    def rates(self, name: str) -> ChipRates:
        """The published rates of chip `name` (MeasurementsError naming the chips)."""
        for rates in self.chip_rates:
            if rates.name == name:
                return rates
        raise MeasurementsError(f"measurements: no published rates for chip {name!r}; "
                                f"known: {sorted(r.name for r in self.chip_rates)}")


def _fields(where: str, entry: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise MeasurementsError(f"{where}: expected an object, got {type(entry).__name__}")
    missing = [n for n in names if n not in entry]
    extra = sorted(set(entry) - set(names))
    if missing or extra:
        raise MeasurementsError(f"{where}: expected the fields {list(names)}; missing "
                                f"{missing}, unknown {extra}")
    return entry


def _text(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise MeasurementsError(f"{where}: expected a string, got {value!r}")
    return value


def _pairs(where: str, value: Any) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, dict):
        raise MeasurementsError(f"{where}: expected an object of label: number")
    out = []
    for label, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise MeasurementsError(f"{where}.{label}: expected a number, got {v!r}")
        out.append((label, float(v)))
    return tuple(out)


def _provenance(where: str, entry: Any) -> Provenance:
    names = tuple(f.name for f in dataclasses.fields(Provenance))
    e = _fields(where, entry, names)
    return Provenance(**{n: _text(f"{where}.{n}", e[n]) for n in names})


def _figure(where: str, entry: Any) -> Figure:
    e = _fields(where, entry, ("key", "kind", "description", "unit", "values", "note",
                               "provenance"))
    where = f"{where} ({e['key']!r})"
    if e["kind"] not in FIGURE_KINDS:
        raise MeasurementsError(f"{where}.kind: expected one of {FIGURE_KINDS}, got "
                                f"{e['kind']!r}")
    return Figure(key=_text(f"{where}.key", e["key"]), kind=e["kind"],
                  description=_text(f"{where}.description", e["description"]),
                  unit=_text(f"{where}.unit", e["unit"]),
                  values=_pairs(f"{where}.values", e["values"]),
                  note=_text(f"{where}.note", e["note"]),
                  provenance=_provenance(f"{where}.provenance", e["provenance"]))


def _chip_rates(where: str, entry: Any) -> ChipRates:
    e = _fields(where, entry, ("name", "description", "matrix_flops", "hbm_bytes_per_s",
                               "provenance"))
    where = f"{where} ({e['name']!r})"
    hbm = e["hbm_bytes_per_s"]
    if isinstance(hbm, bool) or not isinstance(hbm, (int, float)) or hbm <= 0:
        raise MeasurementsError(f"{where}.hbm_bytes_per_s: expected a positive number, got "
                                f"{hbm!r}")
    prov = _provenance(f"{where}.provenance", e["provenance"])
    if not prov.source:
        raise MeasurementsError(f"{where}.provenance.source: published rates need their "
                                "source")
    return ChipRates(name=_text(f"{where}.name", e["name"]),
                     description=_text(f"{where}.description", e["description"]),
                     matrix_flops=_pairs(f"{where}.matrix_flops", e["matrix_flops"]),
                     hbm_bytes_per_s=float(hbm), provenance=prov)


def _unique(path: str, kind: str, names: list[str]) -> None:
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise MeasurementsError(f"{path}: {kind} named more than once: {dup}")


def load(path: str | Path | None = None) -> Measurements:
    """Reads and checks a measurements file (default: the one shipped in the package).

    Raises MeasurementsError naming the file and the entry when it is malformed.
    """
    if path is None:
        text = resources.files("mxjax").joinpath(_DATA_FILE).read_text(encoding="utf-8")
        name = f"mxjax/{_DATA_FILE}"
    else:
        name = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise MeasurementsError(f"{name}: cannot read the measurements file ({e})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise MeasurementsError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != 1:
        raise MeasurementsError(f"{name}: expected an object with \"schema\": 1")
    figures = tuple(_figure(f"{name}: figures[{i}]", e)
                    for i, e in enumerate(doc.get("figures", [])))
    rates = tuple(_chip_rates(f"{name}: chip_rates[{i}]", e)
                  for i, e in enumerate(doc.get("chip_rates", [])))
    _unique(name, "figures", [f.key for f in figures])
    _unique(name, "chip_rates", [r.name for r in rates])
    return Measurements(figures=figures, chip_rates=rates)


@functools.cache
def _packaged() -> Measurements:
    return load()


def figure(key: str) -> Figure:
    """The packaged file's figure named `key`."""
    return _packaged().figure(key)


def chip_rates(name: str) -> ChipRates:
    """The packaged file's published rates of chip `name` ('h200', 'b200', 'v5e', ...)."""
    return _packaged().rates(name)


def all_chip_rates() -> tuple[ChipRates, ...]:
    """Every chip's published rates in the packaged file, in file order."""
    return _packaged().chip_rates
