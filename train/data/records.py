"""The documents of one shard, for the grain loader (`train.data.stream`).

`RecordReader` reads JSON lines (C4 shards, ``.gz`` or not) line by line and parquet files
row group by row group, yielding each document or the problem of a bad record: a corrupt
or truncated gzip stream, invalid UTF-8, a bad or too deeply nested JSON line, a missing
or non-string text field, a text with a lone surrogate, an unreadable parquet row group.
`probe_shards` (``--check`` and every start) reads each shard up to its first document;
`BadRecordLog` reports skipped records on stderr, boundedly.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from train.config import ConfigError
from train.data.sources import DataError

REPORTED_BAD_RECORDS = 10  # skipped records reported one by one; then a summary now and then
BAD_RECORD_SUMMARY_S = 30.0  # seconds between two summaries of the records skipped since


def shard_format(path: Path) -> str:
    """'jsonl' for .json/.jsonl(.gz), 'parquet' for .parquet; DataError otherwise."""
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".json", ".jsonl")):
        return "jsonl"
    if path.name.lower().endswith(".parquet"):
        return "parquet"
    raise DataError(f"{path}: data.loader grain reads JSON lines (.json/.jsonl, .gz or not; C4 "
                    "shards) and parquet files; for plain text use data.loader: prepared")


def require_pyarrow(what: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{what}: reading parquet needs the 'pyarrow' package, which is not "
                          "installed (pip install pyarrow)") from None
    return pq


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordReader:
    """Reads the documents of one shard from a line (row) on; see `records`."""

    text_key: str = "text"
    on_bad_record: str = "error"

    def records(self, path: str, start: int = 0) -> Iterator[tuple[int, str | None, str | None]]:
        """Yield ``(lines consumed so far, text or None, problem or None)`` from line (row)
        ``start`` on (0-based; the lines before it are read and dropped).

        A problem raises DataError naming the file and line under ``on_bad_record:
        error``; under ``skip`` it is yielded as the problem of that line (text None).
        Empty documents yield ``(n, None, None)``.
        """
        p = Path(path)
        kind = shard_format(p)
        gen = self._parquet(p, start) if kind == "parquet" else self._jsonl(p, start)
        for n, text, problem in gen:
            if problem is not None and self.on_bad_record == "error":
                raise DataError(f"{problem} (data.on_bad_record: skip would skip it and count "
                                "it in the metrics)")
            yield n, text, problem

    def _jsonl(self, p: Path, start: int) -> Iterator[tuple[int, str | None, str | None]]:
        gz = p.name.lower().endswith(".gz")
        n = 0
        try:
            f = gzip.open(p, "rb") if gz else open(p, "rb")  # noqa: SIM115 (closed below)
        except OSError as e:
            raise DataError(f"{p}: cannot open ({e})") from None
        with f:
            while True:
                try:
                    raw = f.readline()
                except (OSError, EOFError, zlib.error) as e:
                    kind = "corrupt or truncated gzip data" if gz else "read error"
                    yield n, None, (f"{p}: line {n + 1}: {kind} ({type(e).__name__}: {e}); the "
                                    "rest of this file cannot be read")
                    return
                if not raw:
                    return
                n += 1
                if n <= start:
                    continue
                yield n, *self._parse(raw, p, n)

    def _parse(self, raw: bytes, p: Path, n: int) -> tuple[str | None, str | None]:
        if not raw.strip():
            return None, None
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return None, f"{p}: line {n}: invalid UTF-8 ({e.reason})"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            return None, f"{p}: line {n}: invalid JSON ({e.msg})"
        except RecursionError:
            return None, f"{p}: line {n}: JSON nested too deeply to parse"
        if not isinstance(obj, dict) or self.text_key not in obj:
            return None, f"{p}: line {n}: no {self.text_key!r} field (set data.text_key)"
        text = obj[self.text_key]
        if not isinstance(text, str):
            return None, f"{p}: line {n}: field {self.text_key!r} is not a string"
        bad = unencodable(text)
        if bad is not None:
            return None, f"{p}: line {n}: field {self.text_key!r} {bad}"
        return (text or None), None

    def _parquet(self, p: Path, start: int) -> Iterator[tuple[int, str | None, str | None]]:
        """Rows row group by row group: a row group that cannot be read (a corrupt page) is
        one problem, after which reading goes on at the next row group (its rows count as
        consumed, so line numbers and resume positions stay those of the file)."""
        pq = require_pyarrow("data.sources")
        try:
            pf = pq.ParquetFile(p)
            groups = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
        except Exception as e:  # noqa: BLE001 (pyarrow raises assorted types)
            yield 0, None, f"{p}: not a readable parquet file ({type(e).__name__}: {e})"
            return
        if self.text_key not in pf.schema_arrow.names:
            raise DataError(f"{p}: no column {self.text_key!r} (set data.text_key); columns: "
                            f"{', '.join(pf.schema_arrow.names)}")
        n = 0
        for g, rows in enumerate(groups):
            end = n + rows
            if end <= start:
                n = end
                continue
            batches = pf.iter_batches(batch_size=1024, row_groups=[g], columns=[self.text_key])
            while True:
                try:
                    batch = next(batches, None)
                except Exception as e:  # noqa: BLE001 (pyarrow: OSError, ArrowInvalid, ...)
                    yield end, None, (f"{p}: rows {n + 1}-{end} (row group {g + 1} of "
                                      f"{len(groups)}) cannot be read ({type(e).__name__}: "
                                      f"{e})")
                    n = end
                    break
                if batch is None:
                    break
                for text in batch.column(0).to_pylist():
                    n += 1
                    if n <= start:
                        continue
                    if text is not None and not isinstance(text, str):
                        yield n, None, f"{p}: row {n}: column {self.text_key!r} is not a string"
                    elif text and (bad := unencodable(text)) is not None:
                        yield n, None, f"{p}: row {n}: column {self.text_key!r} {bad}"
                    else:
                        yield n, (text or None), None
            n = end


def unencodable(text: str) -> str | None:
    """Why `text` cannot be tokenized (a lone surrogate, which JSON's ``\\ud800`` escapes
    can produce and UTF-8 cannot encode), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"holds a lone surrogate ({text[e.start]!r} at character {e.start}): not "
                "valid Unicode text")
    return None


def probe_shards(files: Sequence[Path], reader: RecordReader) -> None:
    """Read each shard up to its first document (the first line of a good shard); a
    ConfigError naming every shard that holds none (empty, blank lines, every text empty,
    or, under ``on_bad_record: skip``, no good record). Under ``error`` a bad record met
    before the first document is a ConfigError naming it."""
    barren = []
    for p in files:
        try:
            if not any(text is not None for _, text, _ in reader.records(str(p))):
                barren.append(str(p))
        except DataError as e:
            raise ConfigError(f"data.sources: {e}") from None
    if barren:
        raise ConfigError(f"data.sources: {len(barren)} shard(s) hold no document (an empty "
                          "file, blank lines, every text empty, or no good record): "
                          f"{name_some(barren)}; remove them from data.sources or fix them")


def name_some(paths: Sequence[str], most: int = 8) -> str:
    more = f" and {len(paths) - most} more" if len(paths) > most else ""
    return ", ".join(paths[:most]) + more


class BadRecordLog:
    """Reports skipped records on stderr: the first `REPORTED_BAD_RECORDS` one by one, then
    at most one summary line per `BAD_RECORD_SUMMARY_S` seconds (a shard of millions of bad
    lines must not write a line each)."""

    def __init__(self, *, clock: Any = time.monotonic):
        self._clock = clock
        self._reported = 0
        self._pending = 0  # skipped since the last line printed
        self._latest: str | None = None
        self._last_summary = clock()

    def report(self, messages: Sequence[str], count: int) -> None:
        """`count` records were skipped; `messages` describe the first of them."""
        for msg in messages:
            if self._reported < REPORTED_BAD_RECORDS:
                self._reported += 1
                count -= 1
                tail = ("" if self._reported < REPORTED_BAD_RECORDS else
                        f" (the first {REPORTED_BAD_RECORDS} are reported one by one; from now "
                        "on a count every few seconds; data_bad_records counts them all)")
                print(f"[data] skipped a bad record: {msg}{tail}", file=sys.stderr, flush=True)
            self._latest = msg
        self._pending += max(count, 0)
        if self._pending and self._clock() - self._last_summary >= BAD_RECORD_SUMMARY_S:
            print(f"[data] skipped {self._pending} more bad record(s); the latest: "
                  f"{self._latest}", file=sys.stderr, flush=True)
            self._pending, self._last_summary = 0, self._clock()
