"""Data pipeline: read documents, tokenize once into uint32 memmaps, pack, shuffle, load.

Preparation (`prepare`) turns the `data` section of a config into a cached
directory ``<cache_dir>/<name>-<tokenizer>-<fingerprint>/`` holding

* ``train.bin`` / ``val.bin``: uint32 token streams, every document followed by
  EOS (and preceded by BOS when ``add_bos``), documents concatenated in order;
* ``tokenizer.json``: the tokenizer used (the trained BPE, or a copy of the HF file);
* ``meta.json``: counts, ids, the fingerprint of sources and settings.

The fingerprint covers the source files (name, size and a SHA-256 of the whole
content, streamed in 1 MiB chunks), the tokenizer spec and the split
settings, so a changed input gets a new directory and a cached one is never
stale. Before a BPE tokenizer is trained, every source is read once to check it
(gzip, UTF-8, JSON): a bad file is reported with its name and line before any
training. Directories are written to a temporary name and
renamed, so a killed preparation leaves nothing half-written.

Packing is Megatron-style: the stream is cut into sequences of ``seq_len + 1``
tokens overlapping by one (inputs ``s[:-1]``, targets ``s[1:]``), with no masking
at document boundaries. Training order is a per-epoch permutation derived from
the seed (a splitmix64 hash, independent of the NumPy version); the loader's only
state is the step, so a resumed run reads exactly the batches it would have.

Validation: ``val_sources`` when given (e.g. the C4 validation shard), else every
``holdout_every``-th block of ``holdout_block`` documents of ``sources`` is held out.
Evaluation uses the first ``eval_sequences`` packed validation sequences, in order.

CLI: ``python -m train.data prepare --config configs/tiny.yaml`` (or flags, see
``--help``); ``python -m train.data info DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import gzip
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from train import config as cfgmod
from train.config import ConfigError, DataSection
from train.tokenizer import TextTokenizer, TokenizerError, load_hf, train_bpe

FORMAT_VERSION = 2
EMBEDDED = {"austen": Path(__file__).resolve().parent / "assets" / "austen.txt.gz"}
_PARA_SPLIT = re.compile(r"\n[ \t\r\f\v]*\n")


class DataError(ValueError):
    """A data file or prepared-data problem."""


# --------------------------------------------------------------------------- readers

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
    raise DataError(f"{path}: cannot tell the format from the name; set data.format "
                    "to 'text' or 'jsonl'")


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
            if not isinstance(obj, dict) or text_key not in obj:
                raise DataError(f"{path}:{lineno}: no {text_key!r} field (set data.text_key)")
            text = obj[text_key]
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: field {text_key!r} is not a string")
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


# --------------------------------------------------------------------------- preparation

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


def _file_id(path: Path) -> dict[str, Any]:
    return {"name": path.name, "size": path.stat().st_size, "sha256": file_digest(path)}


def fingerprint(spec: DataSection) -> dict[str, Any]:
    """Everything the prepared files depend on (not seq_len: packing happens at load time)."""
    d = dataclasses.asdict(spec)
    for k in ("seq_len", "cache_dir"):
        d.pop(k)
    d["sources"] = [_file_id(p) for p in resolve_sources(spec.sources)]
    d["val_sources"] = [_file_id(p) for p in resolve_sources(spec.val_sources, "data.val_sources")]
    if spec.tokenizer == "bpe":
        d["tokenizer"] = {"type": "bpe", "vocab_size": spec.vocab_size}
    else:
        d["tokenizer"] = {"type": "hf", **_file_id(Path(spec.tokenizer))}
    if spec.tokenizer != "bpe":
        d.pop("vocab_size")
    if spec.val_sources:
        d.pop("holdout_every")
        d.pop("holdout_block")
    d["format_version"] = FORMAT_VERSION
    d["hash"] = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
    return d


def prepared_dir(spec: DataSection, fp: dict[str, Any] | None = None) -> Path:
    fp = fp or fingerprint(spec)
    first = resolve_sources(spec.sources)[0].name.split(".")[0]
    slug = re.sub(r"[^A-Za-z0-9_]+", "_", first)[:24] or "data"
    tok = f"bpe{spec.vocab_size}" if spec.tokenizer == "bpe" else "hf"
    return Path(spec.cache_dir) / f"{slug}-{tok}-{fp['hash'][:12]}"


def check_files(spec: DataSection) -> None:
    """Cheap existence checks (sources, tokenizer file), raising ConfigError."""
    resolve_sources(spec.sources)
    resolve_sources(spec.val_sources, "data.val_sources")
    if spec.tokenizer != "bpe" and not Path(spec.tokenizer).is_file():
        raise ConfigError(f"data.tokenizer: file not found: {spec.tokenizer} "
                          "(use 'bpe' or a path to a tokenizer.json)")


def check_documents(spec: DataSection) -> None:
    """Read every document of every source once (nothing kept): a bad file (corrupt or
    truncated gzip, invalid UTF-8, binary text, bad JSON) raises DataError naming it."""
    for _ in iter_split(spec):
        pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreparedData:
    """A prepared data directory. `meta` is the parsed meta.json."""

    path: Path
    meta: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    def tokenizer(self) -> TextTokenizer:
        return load_hf(self.path / "tokenizer.json", eos_token=self.meta["eos_token"],
                       add_bos=self.meta["bos_id"] is not None)

    def tokens(self, split: str) -> np.ndarray:
        """The uint32 token stream of 'train' or 'val' (read-only memmap)."""
        p = self.path / f"{split}.bin"
        n = int(self.meta[f"{split}_tokens"])
        if p.stat().st_size != 4 * n:
            raise DataError(f"{p}: size {p.stat().st_size} bytes does not match meta.json "
                            f"({n} tokens); delete {self.path} and prepare again")
        if n == 0:
            return np.zeros((0,), np.uint32)
        return np.memmap(p, dtype=np.uint32, mode="r", shape=(n,))


def open_prepared(path: str | Path) -> PreparedData:
    p = Path(path)
    try:
        meta = json.loads((p / "meta.json").read_text())
    except FileNotFoundError:
        raise DataError(f"{p}: no meta.json (not a prepared data directory)") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{p}/meta.json is corrupt ({e}); delete {p} and prepare again") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{p}: format version {meta.get('format_version')} != {FORMAT_VERSION}; "
                        "prepare again")
    if int(meta["max_token_id"]) >= int(meta["vocab_size"]):
        raise DataError(f"{p}/meta.json: max_token_id {meta['max_token_id']} is outside the "
                        f"tokenizer's vocabulary ({meta['vocab_size']}); delete {p} and prepare "
                        "again")
    return PreparedData(path=p, meta=meta)


def _log(msg: str) -> None:
    print(f"[data] {msg}", file=sys.stderr, flush=True)


def prepare(spec: DataSection, *, verbose: bool = True, batch_docs: int = 512) -> PreparedData:
    """Tokenize the data described by `spec` once; return the cached prepared directory."""
    check_files(spec)
    fp = fingerprint(spec)
    out = prepared_dir(spec, fp)
    if (out / "meta.json").is_file():
        return open_prepared(out)
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if spec.tokenizer == "bpe":
            # A bad source must fail before the (long) tokenizer training, not after.
            if verbose:
                _log("checking the sources (gzip, UTF-8, JSON)")
            check_documents(spec)
            if verbose:
                _log(f"training a {spec.vocab_size}-token byte-level BPE on the training documents")
            raw = train_bpe((doc for s, doc in iter_split(spec) if s == "train"), spec.vocab_size)
            raw.save(str(tmp / "tokenizer.json"))
        else:
            shutil.copyfile(spec.tokenizer, tmp / "tokenizer.json")
        try:
            tok = load_hf(tmp / "tokenizer.json", eos_token=spec.eos_token, add_bos=spec.add_bos)
        except TokenizerError as e:
            raise ConfigError(f"data.tokenizer: {e}") from None
        counts = {"train": [0, 0], "val": [0, 0]}  # docs, tokens
        max_id = [0]
        files = {s: open(tmp / f"{s}.bin", "wb") for s in counts}  # noqa: SIM115 (closed below)
        pending: dict[str, list[str]] = {"train": [], "val": []}

        def flush(split: str) -> None:
            docs = pending[split]
            if not docs:
                return
            arrs = tok.encode_documents(docs)
            buf = np.concatenate(arrs)
            files[split].write(buf.tobytes())
            max_id[0] = max(max_id[0], int(buf.max()))
            counts[split][0] += len(docs)
            counts[split][1] += int(buf.size)
            pending[split] = []

        try:
            for split, doc in iter_split(spec):
                pending[split].append(doc)
                if len(pending[split]) >= batch_docs:
                    flush(split)
                    if verbose and counts["train"][0] % (batch_docs * 200) == 0:
                        _log(f"{counts['train'][0]} train docs, {counts['train'][1]} tokens")
            for s in counts:
                flush(s)
        finally:
            for f in files.values():
                f.close()
        if counts["train"][1] == 0:
            raise DataError("no training tokens: the sources contain no documents")
        meta = {
            "format_version": FORMAT_VERSION,
            "fingerprint": fp,
            "vocab_size": tok.vocab_size,
            "max_token_id": max_id[0],
            "eos_token": tok.eos_token,
            "eos_id": tok.eos_id,
            "bos_id": tok.bos_id,
            "tokenizer_sha256": tok.sha256(),
            "train_docs": counts["train"][0],
            "train_tokens": counts["train"][1],
            "val_docs": counts["val"][0],
            "val_tokens": counts["val"][1],
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "meta.json").is_file():  # someone else won the race only if complete
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if verbose:
        _log(f"prepared {out}: {meta['train_tokens']} train / {meta['val_tokens']} val tokens "
             f"({meta['train_docs']} / {meta['val_docs']} docs) in {time.time() - t0:.1f}s")
    return open_prepared(out)


# --------------------------------------------------------------------------- packing & loading

class Sequences:
    """Packed view of a token stream: sequence i = tokens[i*T : i*T + T + 1].

    With ``vocab_size``, every batch read is checked on the host: a token id at or
    above it (a damaged ``.bin`` or a model built for a smaller vocabulary) raises
    DataError naming the sequence, instead of reaching the model.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, *, vocab_size: int | None = None):
        self.tokens = tokens
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.n = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def take(self, idx: np.ndarray) -> np.ndarray:
        """int32[len(idx), seq_len + 1] for sequence indices `idx`."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError(f"sequence index out of range [0, {self.n})")
        pos = idx[:, None] * self.seq_len + np.arange(self.seq_len + 1, dtype=np.int64)
        out = np.asarray(self.tokens[pos])
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            row, col = (int(v) for v in np.argwhere(out >= self.vocab_size)[0])
            raise DataError(f"token id {int(out[row, col])} at position {col} of sequence "
                            f"{int(idx[row])} (stream offset {int(pos[row, col])}) is outside "
                            f"the vocabulary [0, {self.vocab_size})")
        return out.astype(np.int32)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of range(n) fixed by (seed, epoch), stable across NumPy versions."""
    base = _splitmix64(np.array([(seed & 0xFFFFFFFF) << 32 | (epoch & 0xFFFFFFFF)], np.uint64))[0]
    with np.errstate(over="ignore"):
        keys = _splitmix64(np.arange(n, dtype=np.uint64) ^ base)
    return np.argsort(keys, kind="stable")


class TrainLoader:
    """Deterministic shuffled batches; the only state is the step.

    Step s uses global sample numbers [s*B, (s+1)*B); sample g is sequence
    ``perm_{g // n}[g % n]`` (a fresh permutation per epoch). A process of a
    multi-host run takes its contiguous slice of rows.
    """

    def __init__(self, seqs: Sequences, *, global_batch: int, seed: int,
                 process_index: int = 0, process_count: int = 1):
        if len(seqs) == 0:
            raise DataError(f"the training split has fewer than seq_len+1 = {seqs.seq_len + 1} "
                            "tokens")
        if global_batch % process_count:
            raise ConfigError(f"train.global_batch ({global_batch}) must be divisible by the "
                              f"number of processes ({process_count})")
        self.seqs, self.global_batch, self.seed = seqs, global_batch, seed
        self.local = global_batch // process_count
        self.offset = process_index * self.local
        self._perm: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, epoch_permutation(len(self.seqs), self.seed, epoch))
        return self._perm[1]

    def indices(self, step: int) -> np.ndarray:
        """Sequence indices (int64[local batch]) this process reads at `step`."""
        n = len(self.seqs)
        g = step * self.global_batch + self.offset + np.arange(self.local, dtype=np.int64)
        out = np.empty_like(g)
        for epoch in np.unique(g // n):
            sel = (g // n) == epoch
            out[sel] = self._permutation(int(epoch))[g[sel] % n]
        return out

    def batch(self, step: int) -> np.ndarray:
        """int32[local batch, seq_len + 1] for `step`."""
        return self.seqs.take(self.indices(step))

    def epoch(self, step: int) -> float:
        return step * self.global_batch / len(self.seqs)


def eval_batches(seqs: Sequences, n_sequences: int, batch: int) -> list[np.ndarray]:
    """The fixed validation set: first `n_sequences` sequences, in `batch`-sized chunks."""
    if n_sequences > len(seqs):
        raise ConfigError(f"train.eval_sequences={n_sequences} but the validation split has only "
                          f"{len(seqs)} sequences of {seqs.seq_len + 1} tokens")
    if n_sequences % batch:
        raise ConfigError(f"train.eval_sequences ({n_sequences}) must be a multiple of the eval "
                          f"batch ({batch})")
    return [seqs.take(np.arange(i, i + batch)) for i in range(0, n_sequences, batch)]


# --------------------------------------------------------------------------- CLI

def _spec_from_args(args: argparse.Namespace) -> DataSection:
    sets = list(args.set or [])
    flag_map = {"source": "sources", "val_source": "val_sources", "format": "format",
                "text_key": "text_key", "split": "split", "tokenizer": "tokenizer",
                "vocab_size": "vocab_size", "eos_token": "eos_token", "cache_dir": "cache_dir",
                "max_docs": "max_docs", "holdout_every": "holdout_every",
                "holdout_block": "holdout_block"}
    raw = cfgmod.read_yaml(args.config) if args.config else {}
    raw = cfgmod.apply_overrides(raw, sets)
    data = dict(raw.get("data") or {})
    for flag, key in flag_map.items():
        v = getattr(args, flag)
        if v is not None:
            data[key] = v
    if args.add_bos:
        data["add_bos"] = True
    raw["data"] = data
    return cfgmod.from_dict(raw).data


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize sources into a cached prepared directory")
    p.add_argument("--config", help="take the data section from this training config")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="config override, e.g. data.vocab_size=4096 (repeatable)")
    p.add_argument("--source", action="append", help="training file or glob (repeatable)")
    p.add_argument("--val-source", action="append", help="validation file or glob (repeatable)")
    p.add_argument("--format", choices=["auto", "text", "jsonl"])
    p.add_argument("--text-key", help="JSON field with the text (default 'text')")
    p.add_argument("--split", choices=["paragraph", "file"], help="plain-text document split")
    p.add_argument("--tokenizer", help="'bpe' or a path to tokenizer.json")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary size")
    p.add_argument("--eos-token", help="end-of-document token name")
    p.add_argument("--add-bos", action="store_true", help="put BOS before each document")
    p.add_argument("--cache-dir", help="cache directory (default data_cache)")
    p.add_argument("--max-docs", type=int, help="read at most this many documents")
    p.add_argument("--holdout-every", type=int)
    p.add_argument("--holdout-block", type=int)
    q = sub.add_parser("info", help="print a prepared directory's metadata and a sample")
    q.add_argument("dir")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "prepare":
            prep = prepare(_spec_from_args(args))
            print(prep.path)
        else:
            prep = open_prepared(args.dir)
            meta = {k: v for k, v in prep.meta.items() if k != "fingerprint"}
            print(json.dumps(meta, indent=1))
            toks = prep.tokens("train")
            print("sample:", repr(prep.tokenizer().decode(toks[:64])))
    except (ConfigError, DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
