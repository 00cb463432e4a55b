"""Small generated C4-layout shards and a small BPE tokenizer for the grain loader's tests."""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import signal
from pathlib import Path

from train.data import sources as S
from train.data.tokenizer import train_bpe

N_SHARDS = 8
DOCS_PER_SHARD = 60


def austen_docs(n: int) -> list[str]:
    return list(itertools.islice(S.iter_documents(S.EMBEDDED["austen"]), n))


def write_shards(root: Path, *, n_shards: int = N_SHARDS, docs_per_shard: int = DOCS_PER_SHARD,
                 val_docs: int = 200) -> dict[str, Path]:
    """C4's layout under `root`: ``c4-train.XXXXX-of-01024.json.gz`` shards (JSON lines with
    text/timestamp/url, as published), the MLPerf validation file
    ``c4-validation_24567exp.json`` (plain JSON lines) and a 512-token BPE tokenizer.json.
    Returns {'dir', 'val', 'tokenizer'}."""
    root.mkdir(parents=True, exist_ok=True)
    docs = austen_docs(n_shards * docs_per_shard + val_docs)
    for i in range(n_shards):
        with gzip.open(root / f"c4-train.{i:05d}-of-01024.json.gz", "wt", encoding="utf-8") as f:
            for j, d in enumerate(docs[i * docs_per_shard:(i + 1) * docs_per_shard]):
                f.write(json.dumps({"text": d, "timestamp": "2019-04-25T12:57:54Z",
                                    "url": f"https://example.org/{i}/{j}"}) + "\n")
    val = root / "c4-validation_24567exp.json"
    with open(val, "w", encoding="utf-8") as f:
        for d in docs[n_shards * docs_per_shard:]:
            f.write(json.dumps({"text": d, "timestamp": "2019-04-25", "url": "u"}) + "\n")
    tok = root / "tokenizer.json"
    train_bpe(docs, 512).save(str(tok))
    return {"dir": root, "val": val, "tokenizer": tok}


def grain_sets(data: dict[str, Path], workers: int = 0, *extra: str) -> list[str]:
    """--set overrides (after `tests.train.train_testutil.fast_sets`) for the grain loader."""
    return ["data.loader=grain", "data.max_docs=null",
            f"data.sources=[{data['dir']}/c4-train.*-of-01024.json.gz]",
            f"data.val_sources=[{data['val']}]", f"data.tokenizer={data['tokenizer']}",
            f"data.workers={workers}", *extra]


class Hang(Exception):
    """Raised in a block that `within` gave up on."""


@contextlib.contextmanager
def within(seconds: float):
    """Fail (instead of hanging the suite) when the block runs longer than `seconds`: a
    SIGALRM raises `Hang` in the main thread, wherever it is (main thread only)."""
    def expire(signum, frame):
        raise Hang(f"still running after {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
