"""A run's faults end in a message, and nothing is lost: with
checkpoints off a run never overwrites another run's outputs; a damaged batch mid-run saves
the last good step, stops with status data_error, and the same command resumes once the data
is fixed; damaged prepared data and a file in place of checkpoints/ are exit codes 7 and 5,
not tracebacks."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tests.train.train_testutil import fast_sets, load
from train import data as datamod
from train import loop
from train.__main__ import main
from train.checkpoint import Checkpointer
from train.config import ConfigError
from train.output.metrics import read_jsonl


def _private_cache(cache, tmp_path):
    """A copy of the session's prepared data (which other tests share) to damage, with
    the compilation cache still shared."""
    cfg = load(tmp_path / "probe", cache)
    prepared = datamod.prepare(cfg.data, verbose=False)
    mine = tmp_path / "cache"
    shutil.copytree(prepared.path, mine / prepared.path.name)
    return mine, mine / prepared.path.name


# The schedule of test_train_loop's base run (decay over 12 steps): the same train step, so
# the compilation cache serves it.
SCHEDULE = "optim.decay_steps=12"


def _sets(out, cache, private, *extra):
    return [*fast_sets(out, cache, SCHEDULE, *extra), f"data.cache_dir={private}"]


def test_disabled_checkpoints_never_overwrite_another_run(tmp_path, data_cache):
    out = tmp_path / "run"
    first = load(out, data_cache, SCHEDULE, "train.steps=2", "checkpoint.enabled=false")
    s = loop.run(first, verbose=False)
    assert s.status == "completed"
    before = {n: (out / n).read_bytes() for n in ("metrics.jsonl", "summary.json",
                                                   "config.yaml", "mllog.txt")}
    other = load(out, data_cache, SCHEDULE, "train.steps=2", "checkpoint.enabled=false",
                 "optim.lr=1e-3")
    with pytest.raises(ConfigError, match=r"holds the outputs of another run .*checkpoint\."
                                          r"enabled is false(.|\n)*optim\.lr: 0\.003 -> 0\.001"):
        loop.run(other, verbose=False)
    # the same config again: the finished run is reported, not repeated
    again = loop.run(first, verbose=False)
    assert again.status == "completed" and again.message.startswith("run already complete")
    assert {n: (out / n).read_bytes() for n in before} == before


def test_damaged_batch_mid_run_saves_stops_and_resumes(tmp_path, data_cache):
    private, prepared = _private_cache(data_cache, tmp_path)
    out = tmp_path / "run"
    cfg = load(out, data_cache, SCHEDULE, "train.steps=4", "checkpoint.every=0",
               f"data.cache_dir={private}")
    # damage one token of the batch of the third step (step index 2)
    good = (prepared / "train.bin").read_bytes()
    tokens = np.memmap(prepared / "train.bin", dtype=np.uint32, mode="r+")
    loader = datamod.TrainLoader(datamod.Sequences(tokens, cfg.data.seq_len),
                                 global_batch=cfg.train.global_batch, seed=cfg.seed)
    tokens[int(loader.indices(2)[0]) * cfg.data.seq_len + 5] = 10**6
    tokens.flush()
    del tokens, loader
    s = loop.run(cfg, verbose=False)
    assert s.status == "data_error" and s.steps == 2
    assert f"{prepared}/train.bin: token id 1000000" in s.message
    assert f"checkpoint step 2 in {out}/checkpoints" in s.message
    with Checkpointer(out / "checkpoints", keep=3) as ck:
        assert ck.steps() == [2] and ck.read_meta(2)["status"] == "data_error"
    assert read_jsonl(out / "metrics.jsonl")[-1]["step"] == 2
    assert "run_stop" not in (out / "mllog.txt").read_text()  # the MLPerf run goes on
    (prepared / "train.bin").write_bytes(good)
    s = loop.run(cfg, verbose=False)
    assert s.status == "completed" and s.resumed_from == 2 and s.steps == 4
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]


def test_truncated_prepared_data_is_exit_7(tmp_path, data_cache, capsys):
    private, prepared = _private_cache(data_cache, tmp_path)
    with open(prepared / "val.bin", "r+b") as f:
        f.truncate(100)
    args = [a for s in _sets(tmp_path / "run", data_cache, private, "train.steps=2")
            for a in ("--set", s)]
    assert main(["--quiet", *args]) == 7
    err = capsys.readouterr().err
    # The first line that is not a "[train] note:" (a worker that ran another test first has
    # its JAX compilation cache set elsewhere and says so) is the message, with no traceback.
    lines = [ln for ln in err.splitlines() if not ln.startswith("[train] note:")]
    assert lines[0].startswith(f"data error: {prepared}/val.bin: size 100 bytes does not match")
    assert "Traceback" not in err
    assert f"delete {prepared} and prepare again" in err


def test_checkpoints_path_that_is_a_file_is_exit_5(tmp_path, data_cache, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("not a directory")
    args = [a for s in fast_sets(out, data_cache, SCHEDULE, "train.steps=2")
            for a in ("--set", s)]
    assert main(["--quiet", *args]) == 5
    err = capsys.readouterr().err
    assert f"{out}/checkpoints is a file, where the run writes its checkpoints" in err
    assert not (out / "metrics.jsonl").exists()  # refused before training
