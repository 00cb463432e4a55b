"""Reliability round 3 (issue 45, items 9-12 and the non-data UNCLEAR items): what a careless
user or an operator does to a run, each answered by a message that says what to do."""

from __future__ import annotations

import pytest

from tests.train.data.stream_testutil import grain_sets, write_shards
from tests.train.train_testutil import ROOT, fast_sets, load
from train import loop
from train.__main__ import main
from train.config import ConfigError

FIXTURE = ROOT / "tests" / "models" / "data" / "hf_tiny_llama"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("c4"), n_shards=2)


def test_init_from_architecture_is_checked_under_grain(shards, data_cache, tmp_path, capsys):
    """Item 9: the grain loader checks model.init_from's architecture as the prepared loader
    does (at --check and at start), naming each differing field; exit 2."""
    cfg = load(tmp_path / "g", data_cache, f"model.init_from={FIXTURE}", *grain_sets(shards))
    with pytest.raises(ConfigError, match="model.init_from") as e:
        loop.validate(cfg, verbose=False)
    assert "rope_theta: checkpoint 10000.0, run 500000.0" in str(e.value)
    capsys.readouterr()
    sets = [*fast_sets(tmp_path / "g", data_cache), f"model.init_from={FIXTURE}",
            *grain_sets(shards)]
    rc = main(["--check", *[f"--set={s}" for s in sets]])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("config error: model.init_from"), err
    assert "Traceback" not in err


def test_every_out_of_memory_advice_resumes_the_run(data_cache, tmp_path):
    """Item 10: each setting the out-of-memory message proposes (remat, a smaller micro-batch)
    is accepted by the resume check of a checkpoint written without it."""
    import dataclasses

    from train import compat, memory

    cfg = load(tmp_path / "a", data_cache)
    plan = loop.validate(cfg, verbose=False)
    meta = {"compat": compat.fingerprint(plan)}
    remat = dataclasses.replace(plan.model_config, remat=True)
    budget = memory.estimate(remat, seq_len=64, micro_batch=8, accum_steps=1,
                             mesh=plan.mesh_axes).total
    advice = memory.what_fits(plan.model_config, seq_len=64, global_batch=8, micro_batch=8,
                              mesh=plan.mesh_axes, budget=budget)
    assert "model.overrides.remat=true" in advice and any("micro_batch" in a for a in advice)
    for a in advice:
        new = loop.validate(load(tmp_path / "a", data_cache, *a.split()), verbose=False)
        compat.check_compatible(meta, compat.fingerprint(new), tmp_path, "passthrough")


@pytest.mark.slow
def test_resume_with_remat_and_another_micro_batch_says_so(data_cache, tmp_path, capsys):
    """Item 10 and UNCLEAR (micro_batch/mesh/eval_batch on resume): remat switched on and a
    smaller micro-batch resume the run; a notice names both and says the continuation is
    not bit-identical. The same settings again resume without a notice."""
    sets = ("train.eval_every=0", "train.eval_at_start=false", "optim.decay_steps=3")
    assert loop.run(load(tmp_path / "r", data_cache, "train.steps=1", *sets),
                    verbose=False).status == "completed"
    capsys.readouterr()
    more = ("model.overrides.remat=true", "train.micro_batch=4")
    s = loop.run(load(tmp_path / "r", data_cache, "train.steps=2", *sets, *more))
    err = capsys.readouterr().err
    assert s.status == "completed" and s.resumed_from == 1 and s.steps == 2
    assert "notice: resuming with changed settings (train.micro_batch: 8 -> 4; " \
           "model.overrides.remat: False -> True)" in err, err
    assert "not bit-identical" in err
    s = loop.run(load(tmp_path / "r", data_cache, "train.steps=3", *sets, *more))
    assert s.resumed_from == 2 and "notice:" not in capsys.readouterr().err


def test_out_onto_a_directory_of_the_users_files_is_refused(data_cache, tmp_path, capsys):
    """Item 12: --out onto a directory holding a config.yaml and a metrics.jsonl that no run
    wrote: exit 5 naming both, and neither file is touched."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("my: notes\n")
    (out / "metrics.jsonl").write_text('{"mine": 1}\n')
    (out / "notes.txt").write_text("kept")
    rc = main([*[f"--set={s}" for s in fast_sets(out, data_cache, "train.steps=1")]])
    err = capsys.readouterr().err
    assert rc == 5, err
    assert err.startswith(f"output directory error: output directory {out} holds config.yaml, "
                          "metrics.jsonl, which no run wrote there"), err
    assert "Choose another --out, or move those files away" in err
    assert (out / "config.yaml").read_text() == "my: notes\n"
    assert (out / "metrics.jsonl").read_text() == '{"mine": 1}\n'
    assert not (out / ".run.lock").exists()


def _writer(path, resume_step=None):
    from train.output.metrics import MetricsWriter

    warnings: list[str] = []
    return MetricsWriter(path, resume_step=resume_step, warn=warnings.append), warnings


def test_metrics_file_deleted_or_replaced_mid_run_is_recreated_whole(tmp_path):
    """Item 11: a deleted (or replaced) metrics.jsonl is noticed at the next record and
    recreated holding every record, with a warning naming it."""
    from train.output.metrics import read_jsonl

    path = tmp_path / "metrics.jsonl"
    w, warnings = _writer(path)
    w.write({"step": 1})
    path.unlink()
    w.write({"step": 2})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    assert len(warnings) == 1 and f"the metrics file {path} was deleted, replaced" in warnings[0]
    path.write_text('{"step": 99}\n')  # overwritten in place
    w.write({"step": 3})
    w.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3] and len(warnings) == 2
    assert [r["step"] for r in w.records] == [1, 2, 3] and w.complete


def test_metrics_write_failure_names_the_file_and_loses_no_record(tmp_path, monkeypatch):
    """UNCLEAR (a full disk while writing metrics.jsonl): one warning naming the file and
    what to do; the records are kept and the file rewritten whole once writes succeed."""
    from train.output.metrics import read_jsonl

    path = tmp_path / "metrics.jsonl"
    w, warnings = _writer(path)
    w.write({"step": 1})
    w._f = open("/dev/full", "a")  # noqa: SIM115 (the next writes fail with ENOSPC)
    monkeypatch.setattr(w, "_intact", lambda: True)

    def full(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(w, "_rewrite", full)  # the retries fail too while the disk is full
    w.write({"step": 2})
    w.write({"step": 3})
    assert not w.complete and len(warnings) == 1, warnings
    assert f"cannot write the metrics file {path} (No space left on device)" in warnings[0]
    assert "free space" in warnings[0]
    monkeypatch.undo()
    w.write({"step": 4})  # the disk has room again
    w.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4] and w.complete
    assert "written again" in warnings[1]


def test_metrics_file_missing_on_resume_is_a_warning(tmp_path):
    """UNCLEAR (metrics.jsonl deleted between segments): the resume says its history before
    the resume step is gone, naming the file; kept records survive an ordinary resume."""
    from train.output.metrics import read_jsonl

    path = tmp_path / "metrics.jsonl"
    w, warnings = _writer(path, resume_step=5)
    w.write({"step": 6})
    w.close()
    assert len(warnings) == 1 and f"the metrics file {path} is missing" in warnings[0]
    assert "records up to step 5 are lost" in warnings[0]
    path.write_text("".join(f'{{"step": {i}}}\n' for i in range(1, 9)))
    w, warnings = _writer(path, resume_step=5)
    w.write({"step": 6})
    w.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5, 6] and not warnings


@pytest.mark.slow
def test_summary_counts_the_evaluations_after_metrics_jsonl_is_deleted(data_cache, tmp_path,
                                                                        capsys):
    """Item 11: metrics.jsonl deleted mid-run (here by an on_record hook at step 2): the file
    comes back whole and summary.json holds every evaluation."""
    from train.hooks import Hooks
    from train.output.metrics import read_jsonl

    out = tmp_path / "d"

    def delete_at_2(rec):
        if rec["step"] == 2 and (out / "metrics.jsonl").exists():
            (out / "metrics.jsonl").unlink()

    s = loop.run(load(out, data_cache, "train.steps=3", "train.eval_every=1",
                      "checkpoint.enabled=false"), hooks=Hooks(on_record=delete_at_2))
    assert s.status == "completed"
    assert [e[0] for e in s.eval_history] == [0, 1, 2, 3]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2, 3]
    assert "was deleted, replaced or changed while the run wrote it" in capsys.readouterr().err


def test_init_from_symlink_loop_and_nan_weight_are_config_errors(tmp_path):
    """UNCLEAR: model.init_from at a symlink loop says so (not "does not exist"), and a NaN
    weight in the checkpoint is a config error naming the tensor (exit 2), where it made
    every step of a run skipped."""
    import json
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from models import hf as mhf
    from train import hf as thf

    mc = mhf.config_from_hf(str(FIXTURE))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ConfigError, match=r"^model.init_from: .*loop is a symlink loop"):
        thf.check_init_from(str(tmp_path / "loop"), mc)
    d = tmp_path / "hf"
    shutil.copytree(FIXTURE, d)
    name = "model.norm.weight"
    fn = json.loads((d / mhf.INDEX_FILE).read_text())["weight_map"][name]
    tensors = load_file(str(d / fn))
    tensors[name] = np.full_like(tensors[name], np.nan)
    save_file(tensors, str(d / fn), metadata={"format": "pt"})
    thf.check_init_from(str(d), mc)  # the architecture is right
    with pytest.raises(ConfigError, match=rf"^model.init_from: tensor '{name}' .* non-finite"):
        thf.load_init_params(str(d), mc, None, None)


def test_execution_changes_name_mesh_devices_and_eval_batch():
    """UNCLEAR (mesh, device count, eval_batch on resume): each change is named; a
    checkpoint written before the record existed is compared on what its config holds."""
    from train import execution

    old = {"micro_batch": 8, "eval_batch": 8, "mesh": [2, 1, 1], "devices": 2, "remat": False,
           "attention_impl": "explicit"}
    now = dict(old, eval_batch=4, mesh=[1, 4, 1], devices=4)
    assert execution.changes({"execution": old}, now) == [
        "train.eval_batch: 8 -> 4", "mesh (data, fsdp, tensor): 2x1x1 -> 1x4x1",
        "device count: 2 -> 4"]
    assert execution.changes({"execution": old}, old) == []
    before = {"config": {"train": {"global_batch": 8, "micro_batch": None,
                                   "eval_sequences": 16, "eval_batch": None}},
              "compat": {"model": {"remat": False, "attention_impl": "explicit"}}}
    assert execution.changes(before, dict(old, micro_batch=4, eval_batch=4)) == [
        "train.micro_batch: 8 -> 4", "train.eval_batch: 8 -> 4"]
    # The remat policy is an execution setting: named when it changes, not compared with a
    # checkpoint that predates it.
    keep = dict(old, remat=True, remat_policy="quantized_residuals")
    assert execution.changes({"execution": dict(keep, remat_policy="full")}, keep) == [
        "model.overrides.remat_policy: 'full' -> 'quantized_residuals'"]
    assert execution.changes({"execution": old}, dict(old, remat_policy="full")) == []
