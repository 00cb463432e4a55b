"""The prepared (tokenized) data directory: fingerprint, preparation, reading it back.

`prepare` turns the ``data`` section of a config into a cached directory
``<cache_dir>/<name>-<tokenizer>-<fingerprint>/`` (see the package docstring
for its files); `open_prepared` reads one back as a `PreparedData`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
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

