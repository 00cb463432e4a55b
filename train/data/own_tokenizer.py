"""A ``tokenizer.json`` trained on your own text, at a path you name.

``python -m train.data tokenizer --source 'my/*.jsonl' --vocab-size 8192 --out
my/tokenizer.json`` trains the byte-level BPE of `train.data.tokenizer.train_bpe` (the one
``data.tokenizer: bpe`` trains for the prepared loader: deterministic, ``<|endoftext|>``
its end-of-document token, id 0) on the documents of the sources, in file order, and
writes it as a Hugging Face ``tokenizer.json``: what ``data.tokenizer`` takes under the
grain loader (and under the prepared one, and what `transformers` loads).

Sources are read as each loader reads them: plain text (``.txt``, split into paragraphs
or whole files) and JSON lines (``.json``/``.jsonl``, ``.gz`` or not) as the prepared
loader does, parquet as the grain loader does (needs ``pyarrow``, the ``parquet`` extra).
The file is written whole or not at all (a temporary file renamed), and an existing one
is replaced only with ``force``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from train.config import ConfigError
from train.data.records import RecordReader, require_pyarrow
from train.data.sources import iter_documents, resolve_sources
from train.data.tokenizer import BPE_EOS, train_bpe

__all__ = ["TokenizerFile", "documents", "write_tokenizer"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerFile:
    """What `write_tokenizer` wrote: the ``path``, its ``vocab_size`` (ids, specials
    included), the ``documents`` and ``files`` it was trained on, its ``eos_token``."""

    path: Path
    vocab_size: int
    documents: int
    files: int
    eos_token: str = BPE_EOS


def documents(files: Sequence[Path], *, fmt: str = "auto", text_key: str = "text",
              split: str = "paragraph") -> Iterator[str]:
    """The documents of `files`, in order (parquet through the grain loader's reader, the
    rest through the prepared loader's); a DataError names a bad file and line."""
    for p in files:
        if p.name.lower().endswith(".parquet"):
            require_pyarrow("--source")
            for _, text, _ in RecordReader(text_key=text_key).records(str(p)):
                if text:
                    yield text
        else:
            yield from iter_documents(p, fmt=fmt, text_key=text_key, split=split)


def write_tokenizer(sources: Sequence[str], out: str | Path, *, vocab_size: int,
                    fmt: str = "auto", text_key: str = "text", split: str = "paragraph",
                    max_docs: int | None = None, force: bool = False) -> TokenizerFile:
    """Train a byte-level BPE of `vocab_size` ids on the documents of `sources` (files or
    globs; at most `max_docs` of them) and write it to `out` as a tokenizer.json.

    ConfigError: `vocab_size` below 257 or `max_docs` below 1, no source matches, `out`
    exists (without `force`) or is a directory, or the sources hold no document; DataError:
    a bad file (named, with its line).
    """
    if vocab_size < 257:
        raise ConfigError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 ids "
                          "(256 bytes and <|endoftext|>); give 257 or more, e.g. 8192")
    if max_docs is not None and max_docs < 1:
        raise ConfigError(f"--max-docs {max_docs}: give a document count of 1 or more, or "
                          "leave it out to train on every document")
    path = Path(out)
    if path.is_dir():
        raise ConfigError(f"--out {path} is a directory; name the file to write, e.g. "
                          f"{path / 'tokenizer.json'}")
    if path.exists() and not force:
        raise ConfigError(f"--out {path} exists; pass --force to replace it, or name another "
                          "file")
    files = resolve_sources(sources, "--source")
    counted = [0]

    def docs() -> Iterator[str]:
        for doc in itertools.islice(documents(files, fmt=fmt, text_key=text_key, split=split),
                                    max_docs):
            counted[0] += 1
            yield doc

    tok = train_bpe(docs(), vocab_size)
    if counted[0] == 0:
        raise ConfigError(f"--source: {len(files)} file(s) hold no document to train on")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(tok.to_str())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return TokenizerFile(path=path, vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
                         documents=counted[0], files=len(files))
