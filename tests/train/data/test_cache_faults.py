"""The prepared-data cache under faults: a cache that cannot be
written is an OSError naming data.cache_dir, with nothing half-written left; a killed
preparation's temporary directory is removed by the next one; a damaged token stream is
named in the error."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.file_faults import file_size_limit
from train import data as D
from train.config import DataSection
from train.data import cache


def _spec(tmp_path, cache_dir) -> DataSection:
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(f"document {i} has a few words " * 3 for i in range(60)))
    return DataSection(sources=(str(src),), cache_dir=str(cache_dir), vocab_size=300)


def test_cache_dir_that_is_a_file(tmp_path):
    (tmp_path / "dc").write_text("a file")
    with pytest.raises(OSError, match=rf"cannot write the prepared data into {tmp_path}/dc "
                                      r".*set data\.cache_dir to a writable directory"):
        D.prepare(_spec(tmp_path, tmp_path / "dc"), verbose=False)


def test_full_cache_names_it_and_leaves_nothing(tmp_path):
    dc = tmp_path / "dc"
    dc.mkdir()
    spec = _spec(tmp_path, dc)
    with file_size_limit(1000), pytest.raises(
            OSError, match=rf"cannot write the prepared data into {dc} \(File too large: "
                           r".*tokenizer\.json\); set data\.cache_dir"):
        D.prepare(spec, verbose=False)
    assert os.listdir(dc) == []


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_killed_preparations_temporaries_are_removed(tmp_path):
    spec = _spec(tmp_path, tmp_path / "dc")
    out = cache.prepared_dir(spec)
    out.parent.mkdir(parents=True)
    host = socket.gethostname()
    dead = out.parent / f".{out.name}.tmp-{host}-{_dead_pid()}-abc123"
    alive = out.parent / f".{out.name}.tmp-{host}-{os.getpid()}-abc123"
    elsewhere = out.parent / f".{out.name}.tmp-another-host-{_dead_pid()}-abc123"
    legacy_old = out.parent / f".{out.name}.tmp-k2j4h5"  # before names held the pid
    legacy_new = out.parent / f".{out.name}.tmp-q9w8e7"
    other = out.parent / ".another-bpe300-0123456789ab.tmp-x"
    for d in (dead, alive, elsewhere, legacy_old, legacy_new, other):
        d.mkdir()
        (d / "train.bin").write_bytes(b"\0" * 64)
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(legacy_old, (day_ago, day_ago))
    prepared = D.prepare(spec, verbose=False)
    assert prepared.path == out and (out / "meta.json").is_file()
    left = sorted(p.name for p in out.parent.iterdir())
    assert left == sorted([out.name, alive.name, elsewhere.name, legacy_new.name, other.name])


def test_damaged_stream_names_its_file(tmp_path):
    toks = np.arange(40, dtype=np.uint32) % 10
    toks[23] = 99
    src = tmp_path / "prep" / "train.bin"
    seqs = D.Sequences(toks, 4, vocab_size=10, source=src)
    with pytest.raises(D.DataError, match=rf"{src}: token id 99 at position 3 of sequence 5 "
                                          rf".*the file is damaged: delete {src.parent} and "
                                          r"prepare again"):
        seqs.take(np.array([5]))
