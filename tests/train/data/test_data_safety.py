"""Prepared-data cache keyed by whole file content; bad sources named before BPE training."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from train import data as D
from train.config import DataSection
from train.data import cache


def _spec(tmp_path, sources, **kw) -> DataSection:
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    kw.setdefault("vocab_size", 300)
    return DataSection(sources=tuple(str(s) for s in sources), **kw)


def test_cache_key_covers_bytes_past_the_first_mib(tmp_path):
    # The probe: 40 bytes changed at offset 2,000,000 of a 2.4 MB source, same size.
    src = tmp_path / "big.txt"
    rng = np.random.default_rng(0)
    words = rng.integers(ord("a"), ord("z") + 1, size=2_400_000, dtype=np.uint8)
    words[::7] = ord(" ")
    words[::701] = ord("\n")
    src.write_bytes(words.tobytes())
    spec = _spec(tmp_path, [src])
    before = D.fingerprint(spec)
    data = bytearray(src.read_bytes())
    data[2_000_000:2_000_040] = b"X" * 40
    src.write_bytes(bytes(data))
    after = D.fingerprint(spec)
    assert after["sources"][0]["size"] == before["sources"][0]["size"]
    assert after["hash"] != before["hash"]
    assert D.prepared_dir(spec, after) != D.prepared_dir(spec, before)


def test_file_digest_is_sha256_of_the_whole_file(tmp_path):
    import hashlib

    p = tmp_path / "x.bin"
    payload = bytes(range(256)) * 9000  # > 2 chunks of 1 MiB
    p.write_bytes(payload)
    assert D.file_digest(p) == hashlib.sha256(payload).hexdigest()


def _training_must_not_start(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("tokenizer training started before the sources were checked")
    monkeypatch.setattr(cache, "train_bpe", refuse)  # the name prepare() calls


GOOD = "A fine first paragraph.\n\nAnd a second one.\n"


def _bad_sources(tmp_path):
    """name -> (path, regex the DataError must match)."""
    cases = {}
    p = tmp_path / "latin1.txt"
    p.write_bytes(GOOD.encode() + b"caf\xe9 au lait\n")
    off = len(GOOD.encode()) + 3
    cases["non_utf8_txt"] = (p, rf"latin1\.txt: line 4, byte offset {off}: invalid UTF-8")
    p = tmp_path / "binary.txt"
    p.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    cases["binary_txt"] = (p, r"binary\.txt: line 1, byte offset 7: NUL byte")
    p = tmp_path / "trunc.txt.gz"
    p.write_bytes(gzip.compress((GOOD * 2000).encode())[:300])
    cases["truncated_gz"] = (p, r"trunc\.txt\.gz: cannot read this gzip file .*EOFError")
    p = tmp_path / "fake.txt.gz"
    p.write_text(GOOD)
    cases["fake_gz"] = (p, r"fake\.txt\.gz: cannot read this gzip file .*BadGzipFile")
    p = tmp_path / "c4.json.gz"
    lines = [json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(5)]
    lines[3] = b'{"text": "bad \xff byte"}\n'
    with gzip.open(p, "wb") as f:
        f.write(b"".join(lines))
    off = sum(len(x) for x in lines[:3]) + lines[3].index(b"\xff")
    cases["non_utf8_jsonl_gz"] = (p, rf"c4\.json\.gz: line 4, decompressed byte offset {off}")
    p = tmp_path / "late.jsonl"
    p.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(50))
                 + "{oops\n")
    cases["bad_json_late"] = (p, r"late\.jsonl:51: invalid JSON")
    return cases


@pytest.mark.parametrize("case", ["non_utf8_txt", "binary_txt", "truncated_gz", "fake_gz",
                                  "non_utf8_jsonl_gz", "bad_json_late"])
def test_bad_source_is_named_before_tokenizer_training(tmp_path, monkeypatch, case):
    path, pattern = _bad_sources(tmp_path)[case]
    good = tmp_path / "good.txt"
    good.write_text(GOOD)
    _training_must_not_start(monkeypatch)
    with pytest.raises(D.DataError, match=pattern):
        D.prepare(_spec(tmp_path, [good, path]), verbose=False)
    assert not list((tmp_path / "cache").glob(".*tmp*"))  # nothing half-written is left


def test_bad_source_is_named_with_an_hf_tokenizer_too(tmp_path):
    # No training pass: the one tokenizing pass names the file.
    from train.data.tokenizer import train_bpe

    tok = tmp_path / "tokenizer.json"
    train_bpe(["some text to learn from " * 20], 290).save(str(tok))
    path, pattern = _bad_sources(tmp_path)["non_utf8_txt"]
    with pytest.raises(D.DataError, match=pattern):
        D.prepare(_spec(tmp_path, [path], tokenizer=str(tok)), verbose=False)


def test_crlf_text_reads_as_before(tmp_path):
    # Reading bytes (for offsets) keeps the universal-newline behaviour of text mode.
    p = tmp_path / "crlf.txt"
    p.write_bytes(b"one\r\ntwo\r\n\r\nthree\rfour\r\r five")
    assert list(D.iter_documents(p)) == ["one\ntwo", "three\nfour", "five"]


def test_sequences_refuse_token_ids_outside_the_vocabulary():
    toks = np.arange(40, dtype=np.uint32) % 10
    toks[23] = 10
    seqs = D.Sequences(toks, 4, vocab_size=10)
    assert seqs.take(np.array([0, 1])).dtype == np.int32
    with pytest.raises(D.DataError, match=r"token id 10 at position 3 of sequence 5 "
                                          r"\(stream offset 23\) is outside the vocabulary "
                                          r"\[0, 10\)"):
        seqs.take(np.array([0, 5]))
    assert D.Sequences(toks, 4).take(np.array([5]))[0, 3] == 10  # unchecked without a vocab


def test_prepared_meta_with_ids_beyond_the_vocabulary_is_refused(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(f"doc {i} " * 5 for i in range(50)))
    prep = D.prepare(_spec(tmp_path, [src]), verbose=False)
    meta = json.loads((prep.path / "meta.json").read_text())
    meta["max_token_id"] = meta["vocab_size"]
    (prep.path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(D.DataError, match="max_token_id .* outside the tokenizer's vocabulary"):
        D.open_prepared(prep.path)
