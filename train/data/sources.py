"""Source files of the data pipeline: find them, read their documents, split, digest.

``resolve_sources`` expands ``embedded:NAME`` (corpora bundled in ``assets/``)
and globs; ``iter_documents`` reads one text or JSONL file (gzip or not) and
``iter_split`` assigns every document to 'train' or 'val'. Every problem with a
file is a `DataError` (or a ConfigError for a missing file) naming it.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from train.config import ConfigError, DataSection

EMBEDDED = {"austen": Path(__file__).resolve().parent / "assets" / "austen.txt.gz"}
_PARA_SPLIT = re.compile(r"\n[ \t\r\f\v]*\n")


# What a parquet source under the prepared loader is told.
PARQUET_NEEDS_GRAIN = ("parquet is read by the grain loader, not by data.loader prepared: use "
                       "the grain loader (--set data.loader=grain, with the 'parquet' extra: "
                       "pip install -e '.[train,parquet]'; docs/DATA.md)")


class DataError(ValueError):
    """A data file or prepared-data problem."""


def resolve_sources(patterns: Sequence[str], what: str = "data.sources") -> list[Path]:
    """Expand ``embedded:NAME`` and globs; every pattern must match at least one file."""
    out: list[Path] = []
    for pat in patterns:
        if pat.startswith("embedded:"):
            name = pat.split(":", 1)[1]
            if name not in EMBEDDED:
                raise ConfigError(f"{what}: unknown embedded corpus {name!r}; have "
                                  f"{', '.join(sorted(EMBEDDED))}")
            out.append(EMBEDDED[name])
            continue
        p = Path(pat).expanduser()
        if glob.has_magic(pat):
            hits = sorted(Path(h) for h in glob.glob(str(p)) if Path(h).is_file())
            if not hits:
                raise ConfigError(f"{what}: no file matches {pat!r}")
            out.extend(hits)
        elif p.is_file():
            out.append(p)
        else:
            raise ConfigError(f"{what}: file not found: {pat}")
    return out


def detect_format(path: Path, fmt: str = "auto") -> str:
    """'text' for .txt(.gz), 'jsonl' for .json/.jsonl(.gz); `fmt` other than auto wins."""
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    name = name.removesuffix(".gz")
    if name.endswith((".json", ".jsonl")):
        return "jsonl"
    if name.endswith(".txt"):
        return "text"
    if name.endswith(".parquet"):
        raise DataError(f"{path}: {PARQUET_NEEDS_GRAIN}")
    raise DataError(f"{path}: cannot tell the format from the name; data.loader prepared reads "
                    "plain text (.txt) and JSON lines (.json/.jsonl), .gz or not: set "
                    "data.format to 'text' or 'jsonl' for another name")


def _is_gzip(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def _decode(raw: bytes, path: Path, offset: int, line: int) -> str:
    """UTF-8 text of `raw` (which starts at byte `offset`, on line `line`, of the file's
    decompressed bytes); a DataError naming the file, line and byte offset otherwise."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line += raw.count(b"\n", 0, e.start)
        stream = "decompressed byte" if _is_gzip(path) else "byte"
        raise DataError(f"{path}: line {line}, {stream} offset {offset + e.start}: invalid "
                        f"UTF-8 ({e.reason}); sources must be UTF-8 text") from None


@contextlib.contextmanager
def _read_errors(path: Path) -> Iterator[None]:
    """Translate read failures (unreadable file, corrupt or truncated gzip) into a
    DataError naming the file."""
    try:
        yield
    except (OSError, EOFError, zlib.error) as e:
        kind = "gzip file" if _is_gzip(path) else "file"
        raise DataError(f"{path}: cannot read this {kind} ({type(e).__name__}: {e}); is it "
                        "truncated, or not really gzip?") from None


def iter_documents(path: Path, *, fmt: str = "auto", text_key: str = "text",
                   split: str = "paragraph") -> Iterator[str]:
    """Yield the documents of one file, in order (empty documents skipped).

    text: the whole file, or blank-line separated paragraphs (stripped); line ends
    are normalized to ``\\n``.
    jsonl: one JSON object per line (C4 ``c4-*.json.gz`` shards), text in `text_key`.
    ``.gz`` files are decompressed. Every problem (bad gzip, invalid UTF-8, a NUL
    byte in text, bad JSON) raises DataError naming the file and the line (and the
    byte offset for encoding errors).
    """
    kind = detect_format(path, fmt)
    opener = gzip.open if _is_gzip(path) else open
    if kind == "text":
        with _read_errors(path), opener(path, "rb") as f:
            raw = f.read()
        nul = raw.find(b"\0")
        if nul >= 0:
            raise DataError(f"{path}: line {raw.count(b'\n', 0, nul) + 1}, byte offset {nul}: "
                            "NUL byte; this looks like a binary file, not text")
        text = _decode(raw, path, 0, 1).replace("\r\n", "\n").replace("\r", "\n")
        del raw
        parts = [text] if split == "file" else _PARA_SPLIT.split(text)
        for part in parts:
            part = part.strip()
            if part:
                yield part
        return
    offset = 0
    with _read_errors(path), opener(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, path, offset, lineno)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            except RecursionError:
                raise DataError(f"{path}:{lineno}: JSON nested too deeply to parse") from None
            if not isinstance(obj, dict) or text_key not in obj:
                raise DataError(f"{path}:{lineno}: no {text_key!r} field (set data.text_key)")
            text = obj[text_key]
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: field {text_key!r} is not a string")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(f"{path}:{lineno}: field {text_key!r} holds a lone surrogate "
                                f"({text[e.start]!r} at character {e.start}): not valid Unicode "
                                "text") from None
            if text:
                yield text


def iter_split(spec: DataSection) -> Iterator[tuple[str, str]]:
    """Yield ``(split, document)`` with split 'train' or 'val', in a fixed order."""
    sources = resolve_sources(spec.sources)
    n = 0
    for path in sources:
        for doc in iter_documents(path, fmt=spec.format, text_key=spec.text_key, split=spec.split):
            if spec.max_docs is not None and n >= spec.max_docs:
                break
            if spec.val_sources:
                yield "train", doc
            else:
                block = n // spec.holdout_block
                held_out = block % spec.holdout_every == spec.holdout_every - 1
                yield ("val" if held_out else "train"), doc
            n += 1
    if spec.val_sources:
        m = 0
        for path in resolve_sources(spec.val_sources, "data.val_sources"):
            for doc in iter_documents(path, fmt=spec.format, text_key=spec.text_key,
                                      split=spec.split):
                if spec.max_docs is not None and m >= spec.max_docs:
                    break
                yield "val", doc
                m += 1


HASH_CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    """SHA-256 of the file's whole content, streamed in 1 MiB chunks.

    SHA-256 rather than BLAKE2b: hashlib's SHA-256 uses the CPU's SHA extensions
    (x86 SHA-NI, ARMv8 crypto), about 2x BLAKE2b's speed where they exist
    (bench/data_hash.py).
    """
    h = hashlib.sha256()
    with _read_errors(path), open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()



def check_files(spec: DataSection) -> None:
    """Cheap existence checks (sources, tokenizer file), raising ConfigError; a parquet file
    under data.loader prepared, which cannot read it, is one too (naming the grain loader)."""
    for what, pats in (("data.sources", spec.sources), ("data.val_sources", spec.val_sources)):
        files = resolve_sources(pats, what)
        parquet = [p for p in files if p.name.lower().endswith(".parquet")]
        if parquet and spec.loader != "grain":
            raise ConfigError(f"{what}: {parquet[0]}: {PARQUET_NEEDS_GRAIN}")
    if spec.tokenizer != "bpe" and not Path(spec.tokenizer).is_file():
        raise ConfigError(f"data.tokenizer: file not found: {spec.tokenizer} "
                          "(use 'bpe' or a path to a tokenizer.json)")

