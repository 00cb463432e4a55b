"""Own text to the grain loader in one step: ``python -m train.data tokenizer`` writes a
tokenizer.json where the user says (train/data/own_tokenizer.py), which the grain loader
then takes; parquet under the prepared loader names the loader that reads it."""

from __future__ import annotations

import json

import pytest

from tests.train.data.stream_testutil import austen_docs, grain_sets, write_shards
from tests.train.train_testutil import fast_sets
from train.__main__ import main as train_main
from train.data import sources as S
from train.data.__main__ import main as data_main
from train.data.tokenizer import load_hf, train_bpe


def _write_parquet(path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs}), path)


def test_tokenizer_command_writes_a_tokenizer_json_the_grain_loader_takes(
        tmp_path, data_cache, capsys):
    data = write_shards(tmp_path / "c4", n_shards=2)
    _write_parquet(tmp_path / "extra.parquet", austen_docs(20))
    out = tmp_path / "mine" / "tokenizer.json"  # its directory does not exist yet
    code = data_main(["tokenizer", "--source", f"{data['dir']}/c4-train.*.json.gz",
                      "--source", str(tmp_path / "extra.parquet"), "--vocab-size", "400",
                      "--out", str(out)])
    assert code == 0
    said = capsys.readouterr().out.strip()
    assert said == (f"wrote {out}: 400 ids, trained on 140 documents of 3 file(s); end of "
                    f"document '<|endoftext|>'. Use it: --set data.tokenizer={out}")
    docs = austen_docs(120)[:120] + austen_docs(20)  # the shards' 2 x 60, then the parquet's
    assert out.read_text() == train_bpe(docs, 400).to_str()  # the same, deterministic BPE
    assert load_hf(out).vocab_size == 400 and list(tmp_path.glob("mine/.*")) == []
    sets = [*fast_sets(tmp_path / "run", data_cache), *grain_sets(data),
            f"data.tokenizer={out}"]
    assert train_main(["--check", "--quiet", *[a for s in sets for a in ("--set", s)]]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["loader"] == "grain" and report["vocab_size"] == 400


def test_tokenizer_command_keeps_an_existing_file_unless_forced(tmp_path, capsys):
    src = tmp_path / "my.txt"
    src.write_text("\n\n".join(austen_docs(30)))
    out = tmp_path / "tokenizer.json"
    out.write_text("mine")
    argv = ["tokenizer", "--source", str(src), "--vocab-size", "300", "--out", str(out)]
    assert data_main(argv) == 2
    assert capsys.readouterr().err.strip() == (f"error: --out {out} exists; pass --force to "
                                               "replace it, or name another file")
    assert out.read_text() == "mine"
    assert data_main([*argv, "--force"]) == 0
    assert load_hf(out).vocab_size == 300
    capsys.readouterr()
    assert data_main(["tokenizer", "--source", str(tmp_path / "none*.txt"), "--vocab-size",
                      "300", "--out", str(tmp_path / "t.json")]) == 2
    assert "--source: no file matches" in capsys.readouterr().err


def test_parquet_under_the_prepared_loader_names_the_grain_loader(tmp_path, data_cache, capsys):
    _write_parquet(tmp_path / "docs.parquet", austen_docs(10))
    sets = fast_sets(tmp_path / "run", data_cache, f"data.sources=[{tmp_path}/docs.parquet]")
    assert train_main(["--check", "--quiet", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"config error: data.sources: {tmp_path}/docs.parquet: parquet is read by "
                   "the grain loader, not by data.loader prepared: use the grain loader (--set "
                   "data.loader=grain, with the 'parquet' extra: pip install -e "
                   "'.[train,parquet]'; docs/DATA.md)")
    with pytest.raises(S.DataError, match="use the grain loader"):
        S.detect_format(tmp_path / "docs.parquet")
    with pytest.raises(S.DataError, match="data.loader prepared reads plain text"):
        S.detect_format(tmp_path / "docs.csv")


def test_format_and_tokenizer_errors_name_the_loader_and_the_command():
    """``data.format: parquet`` said "must be one of 'auto' | 'text' | 'jsonl'", and the
    grain loader with the trained 'bpe' tokenizer did not say how to get a tokenizer.json."""
    from train.config import ConfigError, load
    from train.data.stream import check_stream

    with pytest.raises(ConfigError, match=r"^data\.format: parquet files are read by the "
                       r"grain loader, .*--set data\.loader=grain"):
        load(None, ["data.format=parquet"])
    cfg = load(None, ["data.loader=grain", "data.sources=[c4/*.json.gz]"])
    with pytest.raises(ConfigError, match=r"the trained 'bpe' tokenizer needs data\.loader: "
                       r"prepared\. For your own text, python -m train\.data tokenizer "):
        check_stream(cfg.data)


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-docs", "-1"], "error: --max-docs -1: give a document count of 1 or more"),
    (["--max-docs", "0"], "error: --max-docs 0: give a document count of 1 or more"),
    (["--vocab-size", "200"], "error: --vocab-size 200: a byte-level BPE needs at least 257"),
])
def test_tokenizer_command_names_a_bad_count_in_one_line(tmp_path, capsys, argv, message):
    """A negative --max-docs once raised islice's ValueError as a traceback, and 0 said the
    sources hold no document; both, and a too small --vocab-size, name the argument."""
    (tmp_path / "a.txt").write_text("one paragraph\n\nanother paragraph\n")
    code = data_main(["tokenizer", "--source", str(tmp_path / "a.txt"), "--vocab-size", "300",
                      "--out", str(tmp_path / "tokenizer.json"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(message) and len(err.splitlines()) == 1
    assert not (tmp_path / "tokenizer.json").exists()


def test_one_shard_and_one_worker_in_the_singular():
    """The run's log said '1 shards streamed (grain, 1 workers per process)'."""
    from train.config import load
    from train.data.run_data import StreamRunData

    def line(n, workers):
        data = load(None, [f"data.workers={workers}", "data.seq_len=64"]).data
        return StreamRunData(data=data, val=None, n_sources=n, vocab_size=512,
                             global_batch=8).summary()

    assert line(1, 1) == ("1 shard streamed (grain, 1 worker per process) into sequences of "
                          "64 tokens")
    assert line(2, 0).startswith("2 shards streamed (grain, 0 workers per process)")
