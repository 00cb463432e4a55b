"""The grain loader (data.loader: grain, train/data/stream.py) on small generated C4-layout
shards: host sharding (disjoint and complete over 1, 2, 4 hosts), the packed stream against
an independent reference, exact resume (in the loader and in training), bad records
(error naming file and line, or skipped and counted), missing shards at --check time, and
the validation set's independence of the host count.

Two-process and SIGTERM/SIGKILL runs with this loader: tests/train/test_two_process_resume.py
and test_grain_sigterm_sigkill_resume below (slow)."""

from __future__ import annotations

import gzip
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.train.data.stream_testutil import grain_sets, write_shards
from tests.train.train_testutil import ROOT, fast_sets, load, run_cli
from train import loop, plan
from train.config import ConfigError
from train.data import sources as S
from train.data import stream
from train.data.loader import Sequences, epoch_permutation, eval_batches
from train.data.tokenizer import load_hf
from train.output.metrics import read_jsonl

T = 32


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return write_shards(tmp_path_factory.mktemp("c4"))


def _files(shards) -> list[str]:
    return sorted(str(p) for p in shards["dir"].glob("c4-train.*.json.gz"))


def _spec(shards, files=None, **kw) -> stream.StreamSpec:
    args = {"files": tuple(files or _files(shards)), "seed": 3, "seq_len": T,
            "tokenizer": str(shards["tokenizer"]), "workers": 0}
    args.update(kw)
    return stream.StreamSpec(**args)


def _file_tokens(shards, path) -> np.ndarray:
    """The reference: every document of a file tokenized directly, EOS after each."""
    tok = load_hf(shards["tokenizer"])
    docs = list(S.iter_documents(Path(path)))
    return np.concatenate(tok.encode_documents(docs))


# ------------------------------------------------------------------------------ sharding

@pytest.mark.parametrize("n_files,hosts", [(8, 1), (8, 2), (8, 4), (1024, 3), (7, 4)])
def test_host_shards_are_disjoint_and_complete(n_files, hosts):
    files = [f"c4-train.{i:05d}-of-01024.json.gz" for i in range(n_files)]
    per = [stream.host_shards(files, i, hosts) for i in range(hosts)]
    flat = [f for p in per for f in p]
    assert sorted(flat) == files and len(set(flat)) == len(flat)
    assert max(map(len, per)) - min(map(len, per)) <= 1


def test_fewer_files_than_hosts_is_an_error():
    with pytest.raises(ConfigError, match="2 file.*for 4 processes"):
        stream.host_shards(["a", "b"], 0, 4)


@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_one_epoch_over_simulated_hosts_reads_every_document_once(shards, hosts):
    """Each simulated host (process_index i of `hosts`) streams its own shards; over one epoch
    the hosts' token streams are, file by file, exactly the files' directly tokenized
    documents: nothing read twice, nothing left out."""
    files = _files(shards)
    seen: dict[str, np.ndarray] = {}
    for i in range(hosts):
        mine = stream.host_shards(files, i, hosts)
        it = _spec(shards, mine).chunk_dataset().__iter__()
        parts: dict[str, list[np.ndarray]] = {}
        while True:
            el = next(it)
            if el["epoch"] == 1:
                break
            path = el["where"].rsplit(":", 1)[0]
            parts.setdefault(path, []).append(el["tokens"])
        assert sorted(parts) == sorted(mine)
        for path, chunks in parts.items():
            assert path not in seen
            seen[path] = np.concatenate(chunks)
    assert sorted(seen) == files
    for path in files:
        np.testing.assert_array_equal(seen[path], _file_tokens(shards, path))


# ------------------------------------------------------------------------- the packing

def test_stream_is_todays_packing_of_the_seeded_file_order(shards):
    """workers 0: the stream is the prepared path's packing (sequence i = tokens[i*T : i*T +
    T + 1]) of the documents in the seeded per-epoch file order, across an epoch boundary."""
    files = _files(shards)
    toks = [np.concatenate([_file_tokens(shards, files[k])
                            for k in epoch_permutation(len(files), 3, e)]) for e in (0, 1)]
    ref = Sequences(np.concatenate(toks), T)
    loader = stream.StreamLoader(_spec(shards), global_batch=4)
    steps = len(toks[0]) // (4 * T) + 3  # past the end of epoch 0
    got = np.concatenate([loader.batch(s) for s in range(steps)])
    np.testing.assert_array_equal(got, ref.take(np.arange(4 * steps)))
    assert loader.epoch(steps - 1) == 1.0
    loader.close()


def test_order_depends_on_the_seed(shards):
    a = stream.StreamLoader(_spec(shards, seed=3), global_batch=4).batch(0)
    b = stream.StreamLoader(_spec(shards, seed=4), global_batch=4).batch(0)
    assert not np.array_equal(a, b)


def test_batches_must_be_read_in_step_order(shards):
    loader = stream.StreamLoader(_spec(shards), global_batch=2)
    loader.batch(0)
    with pytest.raises(RuntimeError, match="the next batch is step 1's, not step 5's"):
        loader.batch(5)


def _resumed(spec, steps: int, at: int, global_batch: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """(uninterrupted batches, batches with a JSON round trip of the state at step `at`
    into a fresh loader)."""
    a = stream.StreamLoader(spec, global_batch=global_batch)
    ref = np.stack([a.batch(s) for s in range(steps)])
    a.close()
    b = stream.StreamLoader(spec, global_batch=global_batch)
    got = [b.batch(s) for s in range(at)]
    state = json.loads(json.dumps(b.state_for(at)))
    b.close()
    c = stream.StreamLoader(spec, global_batch=global_batch)
    c.restore(state, at)
    got += [c.batch(s) for s in range(at, steps)]
    c.close()
    return ref, np.stack(got)


@pytest.mark.parametrize("at", [1, 7, 40])  # mid-file, and in the second epoch's files
def test_restored_state_gives_the_same_batches(shards, at):
    ref, got = _resumed(_spec(shards), 48, at)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.slow  # worker processes start in ~5 s each on 2 cores
@pytest.mark.parametrize("workers", [1, 2])
def test_restore_with_worker_processes(shards, workers):
    """grain's multiprocess iterator: each worker reads its own shards (worker w: shards w,
    w+W, ... of the host's order); the state (each worker's shard and line, the next worker,
    the packer's offset) resumes exactly in a fresh loader (fresh workers)."""
    spec = _spec(shards, workers=workers, chunk_docs=16)
    a = stream.StreamLoader(spec, global_batch=4)
    ref = [a.batch(s) for s in range(13)]
    state = json.loads(json.dumps(a.state_for(13)))
    ref += [a.batch(s) for s in range(13, 30)]
    a.close()
    b = stream.StreamLoader(spec, global_batch=4)
    b.restore(state, 13)
    got = [b.batch(s) for s in range(13, 30)]
    b.close()
    np.testing.assert_array_equal(np.stack(got), np.stack(ref[13:]))
    one = stream.StreamLoader(_spec(shards, workers=0, chunk_docs=16), global_batch=4)
    same = np.array_equal(np.stack(ref), np.stack([one.batch(s) for s in range(30)]))
    # one worker reads in the in-process order; two interleave two shards' chunks (of 16
    # documents: a shard holds 60)
    assert same == (workers == 1)


def test_a_state_of_other_shards_is_refused(shards):
    files = _files(shards)
    a = stream.StreamLoader(_spec(shards, files[0::2]), global_batch=2)
    a.batch(0)
    b = stream.StreamLoader(_spec(shards, files[1::2]), global_batch=2)
    with pytest.raises(S.DataError, match="another list of shards"):
        b.restore(a.state_for(1), 1)


def test_state_before_a_read_that_failed_is_kept(shards, tmp_path):
    """A data error while reading step s's batch: state_for(s) is the state before it (what
    the trainer checkpoints before stopping)."""
    loader = stream.StreamLoader(_spec(shards), global_batch=4)
    loader.batch(0)
    before = loader.state_for(1)
    loader.batch(1)
    assert loader.state_for(1) == before and loader.state_for(2) != before


# --------------------------------------------------------------------------- bad records

def _damaged(shards, tmp_path, kind: str) -> list[str]:
    files = _files(shards)
    bad = tmp_path / Path(files[0]).name
    with gzip.open(files[0], "rt") as f:
        lines = f.read().splitlines(keepends=True)
    if kind == "json":
        lines[4] = '{"text": "unterminated\n'
        bad.write_bytes(gzip.compress("".join(lines).encode()))
    else:  # the compressed stream cut in the middle: a truncated shard
        raw = gzip.compress("".join(lines).encode())
        bad.write_bytes(raw[:len(raw) // 2])
    return [str(bad), *files[1:]]


def _first_epoch_steps(loader) -> int:
    """Read batches until the stream is in its second epoch; the number of steps read."""
    s = 0
    while loader.epoch(s) < 1:
        loader.batch(s)
        s += 1
        assert s < 1000
    return s


@pytest.mark.parametrize("kind,where", [("json", r": line 5: invalid JSON"),
                                        ("gzip", r": line \d+: corrupt or truncated gzip")])
def test_a_bad_record_stops_the_stream_naming_file_and_line(shards, tmp_path, kind, where):
    files = _damaged(shards, tmp_path, kind)
    loader = stream.StreamLoader(_spec(shards, files, seed=0), global_batch=4)
    with pytest.raises(S.DataError, match=f"{tmp_path}/c4-train.00000-of-01024.json.gz{where}"
                       ) as e:
        _first_epoch_steps(loader)
    assert str(e.value).endswith("(data.on_bad_record: skip would skip it and count it in the "
                                 "metrics)")


@pytest.mark.parametrize("kind", ["json", "gzip"])
def test_skip_counts_bad_records_and_reports_them(shards, tmp_path, kind, capfd):
    files = _damaged(shards, tmp_path, kind)
    loader = stream.StreamLoader(_spec(shards, files, seed=0, on_bad_record="skip"),
                                 global_batch=4)
    n = _first_epoch_steps(loader)
    assert loader.bad_records == 1
    err = capfd.readouterr().err
    assert f"skipped a bad record: {tmp_path}/c4-train.00000-of-01024.json.gz" in err
    # the resumed count includes the records skipped before the checkpoint
    state = loader.state_for(n)
    again = stream.StreamLoader(_spec(shards, files, seed=0, on_bad_record="skip"),
                                global_batch=4)
    again.restore(state, n)
    again.batch(n)
    assert again.bad_records == 1


def test_streaming_settings_leave_the_prepared_cache_key_alone():
    """The prepared directory's fingerprint (hence its data, and the losses of runs on it)
    does not depend on the grain loader's settings: caches and checkpoints made before
    these settings existed stay valid."""
    import dataclasses

    from train.config import DataSection
    from train.data.cache import fingerprint

    d = DataSection()
    other = dataclasses.replace(d, loader="grain", workers=7, on_bad_record="skip")
    assert fingerprint(d)["hash"] == fingerprint(other)["hash"]
    assert not {"loader", "workers", "on_bad_record"} & set(fingerprint(d))


def test_skip_needs_the_grain_loader(tmp_path):
    with pytest.raises(ConfigError, match="data.on_bad_record: 'skip' is data.loader grain's"):
        load(tmp_path, tmp_path, "data.on_bad_record=skip")


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    p = tmp_path / "part-0.parquet"
    p.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if not installed
    with pytest.raises(ConfigError, match="needs the 'pyarrow' package"):
        next(stream.RecordReader().records(str(p)))


def test_parquet_rows_are_documents(shards, tmp_path):
    """A parquet shard's text column, row by row (rows counted as lines), resumable mid-file."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = list(S.iter_documents(Path(_files(shards)[0])))
    path = tmp_path / "train-00000.parquet"
    pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), path,
                   row_group_size=7)
    got = list(stream.RecordReader().records(str(path)))
    assert [t for _, t, _ in got] == docs and got[-1][0] == len(docs)
    assert [t for _, t, _ in stream.RecordReader().records(str(path), 10)] == docs[10:]
    ref = _spec(shards, [_files(shards)[0]])
    a = stream.StreamLoader(ref, global_batch=2)
    b = stream.StreamLoader(_spec(shards, [str(path)]), global_batch=2)
    for s in range(6):
        np.testing.assert_array_equal(a.batch(s), b.batch(s))
    with pytest.raises(S.DataError, match="no column 'body'"):
        next(stream.RecordReader(text_key="body").records(str(path)))


# ------------------------------------------------------------ --check, validation set

@pytest.mark.parametrize("source,msg", [("nothing-*.json.gz", "no file matches"),
                                        ("c4-train.00099-of-01024.json.gz", "file not found")])
def test_missing_shard_is_an_error_at_check_time(shards, tmp_path, source, msg):
    cfg = load(tmp_path / "run", tmp_path, *grain_sets(shards),
               f"data.sources=[{shards['dir']}/c4-train.00000-of-01024.json.gz, "
               f"{shards['dir']}/{source}]")
    with pytest.raises(ConfigError, match=f"data.sources: {msg}"):
        plan.validate(cfg, verbose=False)


@pytest.mark.slow  # two CLI processes (~12 s); plan.validate's checks are tested above
def test_check_cli_reports_the_stream(shards, tmp_path):
    args = ["--check", "--quiet"]
    for s in fast_sets(tmp_path / "run", tmp_path, *grain_sets(shards)):
        args += ["--set", s]
    r = run_cli(args)
    assert r.returncode == 0, r.stderr[-2000:]
    facts = json.loads(r.stdout)
    assert facts["loader"] == "grain" and facts["train_shards"] == 8
    r = run_cli([*args, "--set", f"data.sources=[{shards['dir']}/absent-*.json.gz]"])
    assert r.returncode != 0 and "data.sources: no file matches" in r.stderr


def test_validation_set_is_the_same_on_any_number_of_hosts(shards):
    """The first eval_sequences sequences of the validation file, packed as the prepared path
    packs; each of n hosts takes its rows of every eval batch, and together they are it."""
    from train.config import DataSection

    d = DataSection(sources=(str(shards["dir"] / "*.json.gz"),),
                    val_sources=(str(shards["val"]),), tokenizer=str(shards["tokenizer"]),
                    seq_len=T, loader="grain")
    tok = load_hf(shards["tokenizer"])
    ref_tokens = np.concatenate(tok.encode_documents(list(S.iter_documents(shards["val"]))))
    ref = eval_batches(Sequences(ref_tokens, T), 16, 8)
    val = stream.validation_tokens(d, 16, tokenizer=tok)
    assert val.size == 16 * T + 1
    full = eval_batches(Sequences(val, T), 16, 8)
    for hosts in (1, 2, 4):
        per = 8 // hosts
        rows = [np.concatenate([b[i * per:(i + 1) * per] for i in range(hosts)]) for b in full]
        for a, b in zip(rows, ref):
            np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------ training runs

SETS = ("checkpoint.every=3", "optim.decay_steps=8", "train.eval_every=5")


@pytest.fixture(scope="module")
def grain_run(tmp_path_factory, shards, data_cache):
    """8 steps on the grain loader, uninterrupted (checkpoints every 3, evals at 5 and 8)."""
    root = tmp_path_factory.mktemp("grain_run")
    cfg = load(root / "a", data_cache, "train.steps=8", *SETS, *grain_sets(shards))
    return root, cfg, loop.run(cfg, verbose=False)


@pytest.mark.slow
def test_resumed_training_is_bit_identical(grain_run, shards, data_cache):
    """Stop after 5 steps (a checkpoint with the loader's state, mid-chunk), resume to 8: the
    losses, grad norms and eval losses equal the uninterrupted run's bit for bit."""
    root, _, s = grain_run
    assert s.status == "completed"
    b = root / "b"
    five = loop.run(load(b, data_cache, "train.steps=5", *SETS, *grain_sets(shards)),
                    verbose=False)
    assert five.steps == 5
    s2 = loop.run(load(b, data_cache, "train.steps=8", *SETS, *grain_sets(shards)),
                  verbose=False)
    assert s2.status == "completed" and s2.resumed_from == 5
    ra, rb = read_jsonl(root / "a" / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    fields = ("step", "loss", "grad_norm", "eval_loss", "lr", "data_bad_records")
    assert [[r[f] for f in fields] for r in ra] == [[r[f] for f in fields] for r in rb]
    assert len(ra) == 9 and sum(r["eval_loss"] is not None for r in ra) == 3


@pytest.mark.parametrize("change,key", [("data.workers=2", "workers"),
                                        ("data.seq_len=32", "seq_len"),
                                        ("data.on_bad_record=skip", "on_bad_record")])
def test_changed_data_config_on_resume_is_refused(grain_run, shards, tmp_path, data_cache, change,
                                                  key):
    from train.checkpoint import IncompatibleCheckpointError

    _, cfg, _ = grain_run
    out = tmp_path / "copy"
    shutil.copytree(cfg.out_path, out)
    more = load(out, data_cache, "train.steps=9", *SETS, *grain_sets(shards), change)
    with pytest.raises(IncompatibleCheckpointError, match=f"  data: .*{key}: "):
        loop.run(more, verbose=False)


def test_prepared_and_grain_do_not_resume_each_other(grain_run, tmp_path, data_cache):
    from train.checkpoint import IncompatibleCheckpointError

    _, cfg, _ = grain_run
    out = tmp_path / "copy"
    shutil.copytree(cfg.out_path, out)
    with pytest.raises(IncompatibleCheckpointError, match="loader: 'grain' -> None"):
        loop.run(load(out, data_cache, "train.steps=9", *SETS), verbose=False)


def _same_size_edit(path: Path) -> None:
    """Change one letter of a document of the gzip shard `path`, keeping the file's size
    (written as `write_shards` writes it: line by line through a text stream)."""
    import io

    def gz(text: bytes) -> bytes:
        buf = io.BytesIO()
        with (gzip.GzipFile(filename=path.name.removesuffix(".gz"), mode="wb",
                            fileobj=buf) as g, io.TextIOWrapper(g, encoding="utf-8") as w):
            for line in text.decode().splitlines(keepends=True):
                w.write(line)
        return buf.getvalue()

    size, text = path.stat().st_size, gzip.decompress(path.read_bytes())
    for i in range(200, len(text)):
        t = bytearray(text)
        if not chr(t[i]).isalpha():
            continue
        t[i] = ord("x") if t[i] != ord("x") else ord("y")
        raw = gz(bytes(t))
        if len(raw) == size:
            path.write_bytes(raw)
            return
    raise AssertionError("no same-size edit found")


@pytest.mark.parametrize("change", ["removed", "added", "edited, same size", "grown"])
def test_a_changed_shard_list_on_resume_names_the_files(grain_run, shards, tmp_path, data_cache,
                                                        change):
    """Issue 45 (unclear): a changed shard list was refused showing hashes and counts only,
    with deleting the checkpoints as the only remedy, and a shard edited in place (same
    size) resumed silently on other data. The refusal now names each file and says how to
    resume."""
    from train.checkpoint import IncompatibleCheckpointError

    _, cfg, _ = grain_run
    out = tmp_path / "copy"
    shutil.copytree(cfg.out_path, out)
    d = tmp_path / "c4"
    shutil.copytree(shards["dir"], d)
    files = sorted(d.glob("c4-train.*.json.gz"))
    if change == "removed":
        files[3].unlink()
        want = f"data.sources: removed {files[3].name}"
    elif change == "added":
        shutil.copy(files[0], d / "c4-train.00100-of-01024.json.gz")
        want = "data.sources: added c4-train.00100-of-01024.json.gz"
    elif change == "grown":
        size = files[2].stat().st_size
        with gzip.open(files[2], "at") as f:
            f.write(json.dumps({"text": "one more document"}) + "\n")
        want = f"data.sources: changed {files[2].name} \\({size} -> {files[2].stat().st_size} "
    else:
        _same_size_edit(files[5])
        want = f"data.sources: changed {files[5].name} \\(same size, other content\\)"
    more = load(out, data_cache, "train.steps=9", *SETS, *grain_sets({**shards, "dir": d}))
    with pytest.raises(IncompatibleCheckpointError, match=want) as e:
        loop.run(more, verbose=False)
    assert "put them back as they were" in str(e.value)
    assert "model.init_from=HF_DIR" in str(e.value)


@pytest.mark.slow
def test_resume_after_files_went_missing_mid_run(shards, tmp_path, data_cache):
    """Issue 45 FAIL 6 and 7: a tokenizer, validation file or shard glob missing when a
    checkpoint was written killed the run with nothing saved (every save re-read them for
    the fingerprint), and after a shard vanished mid-run (exit 7, saved) the run could not
    be resumed once the file was back. Now the saves go on, the vanished shard stops the run
    with a checkpoint, and putting the files back resumes it."""
    from train.hooks import Hooks

    d = tmp_path / "c4"
    shutil.copytree(shards["dir"], d)
    away = tmp_path / "away"
    away.mkdir()
    data = {**shards, "dir": d, "val": d / shards["val"].name, "tokenizer": d / "tokenizer.json"}
    sets = ("train.steps=30", "checkpoint.every=2", "train.log_every=1", "train.eval_every=0",
            *grain_sets(data))

    def vanish(rec):
        if rec["step"] == 1:  # every data file away: the tokenizer, the validation set, shards
            for p in d.iterdir():
                p.rename(away / p.name)

    out = tmp_path / "run"
    s = loop.run(load(out, data_cache, *sets), hooks=Hooks(on_record=vanish), verbose=False)
    assert s.status == "data_error" and 2 < s.steps < 30, s.message
    assert "cannot open" in s.message and str(d) in s.message
    for p in away.iterdir():
        p.rename(d / p.name)
    s2 = loop.run(load(out, data_cache, *sets), verbose=False)
    assert s2.status == "completed" and s2.resumed_from == s.steps, s2.message


@pytest.mark.slow  # a training run (~10-25 s); the loader's error is tested above
def test_a_bad_record_in_training_stops_with_a_checkpoint(shards, tmp_path, data_cache):
    """A bad JSON line in the second shard the stream reads: the run stops at a step boundary
    (status data_error) naming the file and line, with a checkpoint of the last step that
    holds the loader's state before the failed batch."""
    from train.checkpoint import Checkpointer

    bad = tmp_path / "c4"
    shutil.copytree(shards["dir"], bad)
    files = sorted(bad.glob("c4-train.*.json.gz"))
    second = files[int(epoch_permutation(len(files), 0, 0)[1])]  # seed 0: fast_sets' seed
    with gzip.open(second, "rt") as f:
        lines = f.read().splitlines(keepends=True)
    lines[2] = "{not json\n"
    second.write_bytes(gzip.compress("".join(lines).encode()))
    data = {**shards, "dir": bad}
    out = tmp_path / "run"
    s = loop.run(load(out, data_cache, "train.steps=40", *SETS, *grain_sets(data)),
                 verbose=False)
    assert s.status == "data_error" and 0 < s.steps < 40, s.message
    assert f"{second}: line 3: invalid JSON" in s.message
    with Checkpointer(out / "checkpoints", keep=3) as ck:
        meta = ck.read_meta(ck.latest_step())
    assert ck.latest_step() == s.steps and meta["data_state"][0]["step"] == s.steps


# ------------------------------------------------------------------ SIGTERM / SIGKILL (slow)

def _spawn(args) -> subprocess.Popen:
    import os

    from tests.train.train_testutil import xla_flags

    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags())
    return subprocess.Popen([sys.executable, "-m", "train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _when(proc, out, ready) -> None:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        recs = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
        ck = [int(p.name) for p in (out / "checkpoints").glob("*") if p.name.isdigit()] \
            if recs else []
        if recs and ready(recs[-1]["step"], ck):
            return
        time.sleep(0.01)
    raise AssertionError(f"the run ended first: {proc.communicate()[1][-2000:]}")


@pytest.mark.slow  # three CLI runs with two tokenizer workers each, ~110 s on 2 busy cores
def test_grain_sigterm_sigkill_resume(shards, tmp_path):
    steps = 16

    def args(out):
        a = ["--quiet"]
        for s in fast_sets(out, tmp_path / "cache", f"train.steps={steps}", "train.eval_every=8",
                           "checkpoint.every=4", "checkpoint.keep=2",
                           *grain_sets(shards, 2, f"data.seq_len={T}")):
            a += ["--set", s]
        return a

    a, b = tmp_path / "a", tmp_path / "b"
    r = run_cli(args(a), timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    p = _spawn(args(b))
    _when(p, b, lambda step, ck: step >= 3)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 75, err[-3000:]
    p = _spawn(args(b))
    _when(p, b, lambda step, ck: step >= 9 and max(ck, default=0) >= 8)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    r = run_cli(args(b), timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    ra, rb = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    fields = ("step", "loss", "grad_norm", "eval_loss", "lr")
    assert [[x[f] for f in fields] for x in ra] == [[x[f] for f in fields] for x in rb]
    assert [x["step"] for x in rb] == list(range(steps + 1))
