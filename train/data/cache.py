"""The prepared (tokenized) data directory: fingerprint, preparation, reading it back.

`prepare` turns the ``data`` section of a config into a cached directory
``<cache_dir>/<name>-<tokenizer>-<fingerprint>/`` (see the package docstring
for its files); `open_prepared` reads one back as a `PreparedData`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from train.config import ConfigError, DataSection
from train.data.sources import (
    DataError,
    check_files,
    file_digest,
    iter_split,
    resolve_sources,
)
from train.data.tokenizer import TextTokenizer, TokenizerError, load_hf, train_bpe

FORMAT_VERSION = 2


def _file_id(path: Path) -> dict[str, Any]:
    return {"name": path.name, "size": path.stat().st_size, "sha256": file_digest(path)}


def fingerprint(spec: DataSection) -> dict[str, Any]:
    """Everything the prepared files depend on (not seq_len: packing happens at load time)."""
    d = dataclasses.asdict(spec)
    # not the prepared files' inputs: packing happens at load time; the streaming
    # loader's settings (absent from this fingerprint before they existed)
    for k in ("seq_len", "cache_dir", "loader", "workers", "on_bad_record"):
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


_TMP_INFIX = ".tmp-"
_LEGACY_TMP_AGE_S = 24 * 3600


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove the temporary directories that killed preparations of `out` left behind.

    A preparation writes into ``.<name>.tmp-<host>-<pid>-<random>`` and renames it
    into place when complete; a kill (SIGKILL, or SIGTERM's default action) leaves
    it. Removed: those of this host whose process is gone, and unattributable ones
    (from before the name held the pid) older than a day. A live preparation's,
    and other hosts' (on a shared cache), are left alone. Returns what was removed.
    """
    removed = []
    host = socket.gethostname()
    prefix = f".{out.name}{_TMP_INFIX}"
    for p in out.parent.glob(f"{glob.escape(prefix)}*"):
        m = re.fullmatch(r"(.+)-(\d+)-[^-]+", p.name[len(prefix):])
        if m is not None:
            stale = m.group(1) == host and not _pid_alive(int(m.group(2)))
        else:
            try:
                stale = time.time() - p.stat().st_mtime > _LEGACY_TMP_AGE_S
            except OSError:
                continue
        if stale and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


@contextlib.contextmanager
def _cache_write_errors(cache_dir: Path):
    """An OSError while writing the cache (full, read-only, a file where a directory should
    be) becomes one naming the cache and what to do."""
    try:
        yield
    except OSError as e:
        reason = e.strerror or str(e)
        raise OSError(e.errno, f"cannot write the prepared data into {cache_dir} ({reason}"
                      f"{f': {e.filename}' if e.filename else ''}); set data.cache_dir to a "
                      "writable directory with free space (nothing was left half-written)"
                      ) from e


def _save_tokenizer(raw, path: Path) -> None:
    """``raw.save(path)``; the tokenizers library reports write errors as a bare
    Exception ("File too large (os error 27)"): re-raised as the OSError it is."""
    try:
        raw.save(str(path))
    except Exception as e:
        m = re.search(r"os error (\d+)", str(e))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from e


def prepare(spec: DataSection, *, verbose: bool = True, batch_docs: int = 512) -> PreparedData:
    """Tokenize the data described by `spec` once; return the cached prepared directory.

    Raises OSError naming ``data.cache_dir`` when it cannot be written (full,
    read-only); the temporary directory is removed, as are those of earlier
    preparations that were killed (`remove_stale_temporaries`).
    """
    check_files(spec)
    fp = fingerprint(spec)
    out = prepared_dir(spec, fp)
    if (out / "meta.json").is_file():
        return open_prepared(out)
    with _cache_write_errors(Path(spec.cache_dir)):
        return _prepare(spec, fp, out, verbose=verbose, batch_docs=batch_docs)


def _prepare(spec: DataSection, fp: dict[str, Any], out: Path, *, verbose: bool,
             batch_docs: int) -> PreparedData:
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in remove_stale_temporaries(out):
        if verbose:
            _log(f"removed {p}, left by a killed preparation")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{_TMP_INFIX}{socket.gethostname()}-"
                                       f"{os.getpid()}-", dir=out.parent))
    try:
        if spec.tokenizer == "bpe":
            # A bad source must fail before the (long) tokenizer training, not after.
            if verbose:
                _log("checking the sources (gzip, UTF-8, JSON)")
            check_documents(spec)
            if verbose:
                _log(f"training a {spec.vocab_size}-token byte-level BPE on the training documents")
            raw = train_bpe((doc for s, doc in iter_split(spec) if s == "train"), spec.vocab_size)
            _save_tokenizer(raw, tmp / "tokenizer.json")
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

