"""The grain loader under bad shards (issue 45): nothing hangs, nothing spins, every bad record
is a bad record (skipped under ``on_bad_record: skip``, a DataError naming the file and line
otherwise), never a traceback.

Empty shards and shards with no good record end in an error within seconds (and at
``--check``); a lone surrogate, a deeply nested JSON line and a corrupt parquet row group are
bad records; the skip log is bounded. Worker processes (``data.workers > 0``) die with the
trainer and ignore Ctrl-C (the trainer stops them): tests at the end."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.train.data.stream_testutil import within, write_shards
from tests.train.train_testutil import ROOT
from train.config import ConfigError
from train.data import stream
from train.data.sources import DataError
from train.preemption import StopSignals

T = 32


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return write_shards(tmp_path_factory.mktemp("c4f"), n_shards=2, docs_per_shard=30,
                        val_docs=40)


def _good(shards) -> list[str]:
    return sorted(str(p) for p in shards["dir"].glob("c4-train.*.json.gz"))


def _loader(shards, files, **kw) -> stream.StreamLoader:
    args = {"files": tuple(str(f) for f in files), "seed": 0, "seq_len": T,
            "tokenizer": str(shards["tokenizer"]), "workers": 0}
    args.update(kw)
    return stream.StreamLoader(stream.StreamSpec(**args), global_batch=2)


def _empty_shard(tmp_path: Path, kind: str) -> Path:
    if kind == "zero_bytes":
        p = tmp_path / "c4-train.00000-of-00001.json"
        p.write_bytes(b"")
    elif kind == "empty_gz":
        p = tmp_path / "c4-train.00000-of-00001.json.gz"
        p.write_bytes(gzip.compress(b""))
    elif kind == "blank_lines":
        p = tmp_path / "c4-train.00000-of-00001.json.gz"
        p.write_bytes(gzip.compress(b"\n   \n\n" * 50))
    else:  # every "text" empty
        p = tmp_path / "c4-train.00000-of-00001.jsonl"
        p.write_text("".join(json.dumps({"text": "", "url": str(i)}) + "\n" for i in range(50)))
    return p


EMPTY = ["zero_bytes", "empty_gz", "blank_lines", "empty_texts"]


# --------------------------------------------------------------------------- empty shards

@pytest.mark.parametrize("kind", EMPTY)
@pytest.mark.parametrize("on_bad_record", ["error", "skip"])
def test_an_empty_shard_is_an_error_within_seconds(shards, tmp_path, kind, on_bad_record):
    """Issue 45 FAIL 1: it used to spin at 100% CPU forever."""
    p = _empty_shard(tmp_path, kind)
    loader = _loader(shards, [p], on_bad_record=on_bad_record)
    with within(10), pytest.raises(DataError, match="no document") as e:
        loader.batch(0)
    assert str(p) in str(e.value)


def test_an_empty_shard_beside_good_ones_is_read_past(shards, tmp_path):
    """Only when no shard can give a document is it an error: an empty one among good ones
    is passed over (``--check`` refuses it up front, below)."""
    p = _empty_shard(tmp_path, "empty_gz")
    loader = _loader(shards, [p, *_good(shards)])
    with within(60):
        for s in range(20):
            assert loader.batch(s).shape == (2, T + 1)
    loader.close()


@pytest.mark.parametrize("kind", EMPTY)
def test_check_names_a_shard_without_documents(shards, tmp_path, kind):
    p = _empty_shard(tmp_path, kind)
    reader = stream.RecordReader()
    with pytest.raises(ConfigError, match="holds? no document") as e:
        stream.probe_shards([Path(f) for f in _good(shards)] + [p], reader)
    assert str(p) in str(e.value) and _good(shards)[0] not in str(e.value)
    stream.probe_shards([Path(f) for f in _good(shards)], reader)  # good shards pass


def test_check_refuses_an_empty_shard(shards, tmp_path):
    """``--check`` (plan.validate, which every start runs too) names the empty shard."""
    from tests.train.data.stream_testutil import grain_sets
    from tests.train.train_testutil import load
    from train import plan

    p = _empty_shard(tmp_path, "blank_lines")
    cfg = load(tmp_path / "run", tmp_path, *grain_sets(shards),
               f"data.sources=[{_good(shards)[0]}, {p}]", f"data.seq_len={T}")
    with pytest.raises(ConfigError, match=f"data.sources: 1 shard\\(s\\) hold no document.*{p}"):
        plan.validate(cfg, verbose=False)


# ------------------------------------------------------------- no good record under skip

def _all_bad(tmp_path: Path, kind: str, n: int = 3000) -> Path:
    if kind == "not_gzip":
        p = tmp_path / "c4-train.00000-of-00001.json.gz"
        p.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(n)))
    else:
        p = tmp_path / "c4-train.00000-of-00001.json"
        p.write_text("{not json\n" * n)
    return p


@pytest.mark.parametrize("kind", ["not_gzip", "bad_json"])
def test_skip_with_no_good_record_is_a_bounded_error(shards, tmp_path, kind, capfd):
    """Issue 45 FAIL 2: with on_bad_record: skip a shard with no good record looped forever,
    logging a line per skipped record."""
    p = _all_bad(tmp_path, kind)
    loader = _loader(shards, [p], on_bad_record="skip")
    with within(20), pytest.raises(DataError, match="no document") as e:
        loader.batch(0)
    assert str(p) in str(e.value)
    assert f"the latest bad record: {p}: line " in str(e.value)  # why: not gzip, not JSON
    err = capfd.readouterr().err
    assert len(err.splitlines()) <= stream.REPORTED_BAD_RECORDS + 2, err[:2000]


def test_the_skip_log_is_bounded_and_the_count_exact(shards, tmp_path, capfd):
    """3000 bad lines then good shards: every bad record is counted, but only the first
    REPORTED_BAD_RECORDS are printed one by one (then a summary)."""
    bad = _all_bad(tmp_path, "bad_json")
    loader = _loader(shards, [bad, *_good(shards)], on_bad_record="skip")
    s = 0
    while loader.bad_records < 3000:
        loader.batch(s)
        s += 1
        assert s < 500
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("[data]")]
    assert len(lines) <= stream.REPORTED_BAD_RECORDS + 2, lines[:20]
    assert f"skipped a bad record: {bad}: line 1: invalid JSON" in err
    loader.close()


# ---------------------------------------------------- records the tokenizer cannot take

def _shard_with(tmp_path: Path, shards, line: str, at: int = 3) -> Path:
    with gzip.open(_good(shards)[0], "rt") as f:
        lines = f.read().splitlines(keepends=True)
    lines[at - 1] = line + "\n"
    p = tmp_path / "c4-train.00000-of-00002.json.gz"
    p.write_bytes(gzip.compress("".join(lines).encode()))
    return p


BAD_LINES = {"surrogate": ('{"text": "a lone \\ud800 surrogate"}', "lone surrogate"),
             "nested": ("[" * 200000, "nested too deeply")}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_an_unencodable_record_is_a_bad_record(shards, tmp_path, kind):
    """Issue 45 FAIL 3 and 4: a lone surrogate ended in a tokenizer traceback, a deeply
    nested JSON line in a RecursionError, in both modes."""
    line, what = BAD_LINES[kind]
    p = _shard_with(tmp_path, shards, line)
    loader = _loader(shards, [p])
    with within(30), pytest.raises(DataError, match=f"{p}: line 3: .*{what}"):
        for s in range(200):
            loader.batch(s)
    skip = _loader(shards, [p], on_bad_record="skip")
    with within(30):
        for s in range(10):  # past the bad line (one shard: every pass meets it again)
            skip.batch(s)
    assert skip.bad_records >= 1


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_an_unencodable_validation_record_is_a_data_error(shards, tmp_path, kind):
    """The same record in the validation file: a DataError (`--check` reports it as a
    config error naming the file), not a traceback."""
    import dataclasses

    from train import config

    line, what = BAD_LINES[kind]
    val = tmp_path / "val.json"
    val.write_text(line + "\n" + shards["val"].read_text())
    d = config.load(None, [f"data.tokenizer={shards['tokenizer']}", "data.loader=grain",
                           f"data.val_sources=[{val}]", f"data.sources=[{_good(shards)[0]}]",
                           f"data.seq_len={T}"]).data
    with pytest.raises(DataError, match=f"{val}: line 1: .*{what}"):
        stream.validation_tokens(d, 4)
    toks = stream.validation_tokens(dataclasses.replace(d, on_bad_record="skip"), 4)
    assert toks.size == 4 * T + 1


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_the_prepared_loader_names_an_unencodable_record(tmp_path, kind):
    from train.data.sources import iter_documents

    line, what = BAD_LINES[kind]
    p = tmp_path / "docs.jsonl"
    p.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=f"{p}:2: .*{what}"):
        list(iter_documents(p))


# ------------------------------------------------------------------------------ parquet

def _corrupt_parquet(tmp_path: Path) -> tuple[Path, int]:
    """A snappy parquet file of 3 row groups of 200 rows whose second row group's data is
    overwritten with garbage; returns (path, rows per group)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "cat"]
    texts = [" ".join(rng.choice(words, 40)) + f" {i}" for i in range(600)]
    p = tmp_path / "c4-train.00000-of-00001.parquet"
    pq.write_table(pa.table({"text": texts}), p, row_group_size=200, compression="snappy",
                   use_dictionary=False)
    md = pq.ParquetFile(p).metadata
    col = md.row_group(1).column(0)
    start = col.data_page_offset
    raw = bytearray(p.read_bytes())
    mid = start + col.total_compressed_size // 2
    raw[mid:mid + 64] = bytes(rng.integers(0, 256, 64, dtype=np.uint8))
    p.write_bytes(bytes(raw))
    with pytest.raises(Exception):  # noqa: B017 (the precondition: pyarrow fails on it)
        pq.read_table(p)
    return p, 200


def test_a_corrupt_parquet_row_group_is_a_bad_record(tmp_path):
    """Issue 45 FAIL 5: it ended in 'I/O error: Corrupt snappy compressed data.' naming no
    file, ignoring skip mode. Now: a DataError naming the file and the rows; skip mode skips
    that row group and reads the others."""
    p, rows = _corrupt_parquet(tmp_path)
    with pytest.raises(DataError, match=f"{p}: rows {rows + 1}-{2 * rows} \\(row group 2 of 3\\)"):
        list(stream.RecordReader().records(str(p)))
    got = list(stream.RecordReader(on_bad_record="skip").records(str(p)))
    texts = [t for _, t, _ in got if t is not None]
    problems = [(n, q) for n, t, q in got if q is not None]
    assert len(texts) == 2 * rows and texts[-1].endswith(" 599") and texts[rows - 1].endswith(
        f" {rows - 1}")
    assert problems and problems[0][0] == 2 * rows  # the group's rows are behind it
    # resuming inside or after the bad group lands on the same rows
    after = list(stream.RecordReader(on_bad_record="skip").records(str(p), rows + 10))
    assert [t for _, t, _ in after if t is not None] == texts[rows:]


# ---------------------------------------------------------------- worker processes

def _worker_script(shards, workers: int) -> str:
    # Ctrl-C as a terminal gives it: Python's own handler. A job started in the background
    # by a shell without job control (`cmd &` in a script, as CI runners may) inherits
    # SIGINT ignored, and Python then installs no handler: the child would never stop.
    return (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from train.data import stream\n"
        f"spec = stream.StreamSpec(files=tuple({_good(shards)!r}), seed=0, seq_len={T},\n"
        f"    tokenizer={str(shards['tokenizer'])!r}, workers={workers})\n"
        "loader = stream.StreamLoader(spec, global_batch=2)\n"
        "loader.batch(0)\n"
        "import multiprocessing as mp\n"
        "print(' '.join(str(c.pid) for c in mp.active_children()), flush=True)\n"
        "try:\n"
        "    s = 1\n"
        "    while True:\n"
        "        loader.batch(s); s += 1; time.sleep(0.05)\n"
        "except KeyboardInterrupt:\n"
        "    loader.close()\n"
        "    print('closed', flush=True)\n")


def _spawn(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie (not yet reaped by init) counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    return True


def test_workers_die_with_a_killed_trainer(shards):
    """Issue 45 FAIL 8: SIGKILL of the trainer left its grain workers running (holding its
    stdout/stderr open)."""
    p = _spawn(_worker_script(shards, 1))
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert pids and all(_alive(w) for w in pids), p.stderr.read()[-3000:] if p.poll() else ""
        p.kill()
        p.wait(timeout=30)
        deadline = time.time() + 15
        while any(_alive(w) for w in pids) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_alive(w) for w in pids), "a grain worker outlived its killed parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=30)


@pytest.mark.slow
def test_ctrl_c_reaches_no_worker(shards):
    """Issue 45 FAIL 13: Ctrl-C (SIGINT to the terminal's whole process group) printed a
    worker's KeyboardInterrupt traceback and a leaked shared_memory warning."""
    p = _spawn(_worker_script(shards, 1))
    try:
        assert p.stdout.readline().strip(), p.stderr.read()[-3000:] if p.poll() else ""
        time.sleep(0.5)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=120)  # grain may wait 25 s for a worker
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    assert "closed" in out, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "leaked shared_memory" not in err, err[-3000:]


class _InterruptedOnce:
    """A grain iterator stand-in whose first read takes a Ctrl-C in its middle."""

    def __init__(self, inner):
        self.inner, self.reads, self.sent = inner, 0, False

    def __next__(self):
        if not self.sent:
            self.sent = True
            signal.raise_signal(signal.SIGINT)
        self.reads += 1
        return next(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test (the suite may run with SIGINT ignored,
    inherited from a background launch), the previous one restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_inside_a_read_lands_after_it(shards, python_sigint):
    """A KeyboardInterrupt raised inside grain's reads could leave its queues and locks
    half-used, and the close after it hang (a Ctrl-C under load once waited 180 s): the
    loader reads the whole batch, then raises, and can still be saved and closed."""
    reference = _loader(shards, _good(shards))
    expected = [reference.batch(0), reference.batch(1)]
    reference.close()
    loader = _loader(shards, _good(shards))
    np.testing.assert_array_equal(loader.batch(0), expected[0])
    loader._it = _InterruptedOnce(loader._iter())
    with pytest.raises(KeyboardInterrupt):
        loader.batch(1)
    assert loader._it.reads == 2 and loader._next == 2  # the batch was read through
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    state = loader.state_for(1)  # the state before the interrupted batch: resumable
    loader.close()
    again = _loader(shards, _good(shards))
    again.restore(state, 1)
    np.testing.assert_array_equal(again.batch(1), expected[1])
    again.close()


def test_a_second_ctrl_c_interrupts_at_once(python_sigint):
    reached = []
    with pytest.raises(KeyboardInterrupt), stream.interrupts_held():
        signal.raise_signal(signal.SIGINT)
        reached.append("held")
        signal.raise_signal(signal.SIGINT)
        reached.append("past the second")
    assert reached == ["held"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_interrupts_held_leaves_the_trainers_handler_alone(python_sigint):
    """Under the trainer's StopSignals a Ctrl-C is its stop request, at once as before."""
    with StopSignals(log=lambda msg: None) as stop, stream.interrupts_held():
        signal.raise_signal(signal.SIGINT)
        assert stop.requested == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_worker_chunks_never_travel_in_shared_memory(shards):
    """A chunk in a shared-memory segment when the trainer stops outlives it (the leaked
    shared_memory warning of a Ctrl-C under load): chunks cross from the workers pickled."""
    def segments() -> set[str]:
        return {p.name for p in Path("/dev/shm").glob("psm_*")}

    before = segments()
    spec = stream.StreamSpec(files=tuple(_good(shards)), seed=0, seq_len=T,
                             tokenizer=str(shards["tokenizer"]), workers=1)
    loader = stream.StreamLoader(spec, global_batch=2)
    try:
        seen: set[str] = set()
        for step in range(20):
            loader.batch(step)
            seen |= segments() - before
    finally:
        loader.close()
    assert not seen, f"chunks passed through shared memory: {sorted(seen)[:3]}"
