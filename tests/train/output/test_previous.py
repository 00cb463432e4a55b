"""train.output.previous: a run without checkpoints never overwrites another run's outputs
and a copied run directory reports its own paths."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from train import config as C
from train.config import ConfigError
from train.output.previous import check_reuse, config_changes, relocated
from train.output.summary import RunSummary, read_summary

CFG = C.load(None, ["checkpoint.enabled=false", "train.steps=5"]).to_dict()


def _summary(out, status="completed", steps=5) -> RunSummary:
    return RunSummary(
        status=status, message="trained", steps=steps, tokens=steps * 10,
        final_eval_loss=1.0, best_eval_loss=1.0, eval_history=[(steps, steps * 10, 1.0)],
        target_eval_loss=None, target_step=None, target_tokens=None, skipped_steps=0,
        wall_time_s=1.0, tokens_per_s=None, policy="bf16", out_dir=str(out),
        metrics_path=str(out / "metrics.jsonl"), plot_path=str(out / "plot.png"),
        checkpoint_dir=None, resumed_from=None)


def _write_run(out, cfg=CFG, summary=None):
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    if summary is not None:
        (out / "summary.json").write_text(json.dumps(summary.to_dict()))


def test_empty_directory_may_be_written(tmp_path):
    assert check_reuse(tmp_path / "new", CFG, steps=5) is None
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert check_reuse(tmp_path / "other", CFG, steps=5) is None


def test_another_runs_outputs_are_refused_naming_the_differences(tmp_path):
    _write_run(tmp_path, summary=_summary(tmp_path))
    new = C.load(None, ["checkpoint.enabled=false", "train.steps=5", "optim.lr=1e-3",
                        "seed=3"]).to_dict()
    with pytest.raises(ConfigError, match=r"holds the outputs of another run \(config\.yaml, "
                                          r"metrics\.jsonl, summary\.json\)(.|\n)*optim\.lr: "
                                          r"0\.0003 -> 0\.001\n  seed: 0 -> 3\nUse another"):
        check_reuse(tmp_path, new, steps=5)


def test_unreadable_config_yaml_is_refused(tmp_path):
    _write_run(tmp_path)
    (tmp_path / "config.yaml").write_text("{not: yaml: [")
    with pytest.raises(ConfigError, match=r"config\.yaml is missing or unreadable"):
        check_reuse(tmp_path, CFG, steps=5)
    (tmp_path / "config.yaml").unlink()
    with pytest.raises(ConfigError, match=r"config\.yaml is missing or unreadable"):
        check_reuse(tmp_path, CFG, steps=5)


def test_same_config_finished_is_returned_unfinished_starts_over(tmp_path):
    _write_run(tmp_path, summary=_summary(tmp_path))
    assert check_reuse(tmp_path, CFG, steps=5).status == "completed"
    _write_run(tmp_path, summary=_summary(tmp_path, status="preempted", steps=3))
    assert check_reuse(tmp_path, CFG, steps=5) is None
    _write_run(tmp_path, summary=None)
    (tmp_path / "summary.json").unlink()
    assert check_reuse(tmp_path, CFG, steps=5) is None  # killed before its summary


def test_cosmetic_settings_do_not_count_as_another_run():
    moved = {**CFG, "out_dir": "/elsewhere", "jax_cache_dir": "/jc",
             "train": {**CFG["train"], "progress": "off"},
             "data": {**CFG["data"], "cache_dir": "/dc"}}
    assert config_changes(CFG, moved) == []
    policy = {**CFG, "policy": {"fprop": "x"}}
    assert config_changes(CFG, policy) == ["policy: None -> {'fprop': 'x'}"]


def test_relocated_summary_points_into_the_new_directory(tmp_path):
    old = _summary(tmp_path / "old")
    old = dataclasses.replace(old, checkpoint_dir=str(tmp_path / "old" / "checkpoints"))
    new = relocated(old, tmp_path / "new")
    assert (new.out_dir, new.metrics_path, new.plot_path, new.checkpoint_dir) == (
        str(tmp_path / "new"), str(tmp_path / "new" / "metrics.jsonl"),
        str(tmp_path / "new" / "plot.png"), str(tmp_path / "new" / "checkpoints"))
    assert relocated(dataclasses.replace(old, plot_path=None), tmp_path).plot_path is None
    assert read_summary(tmp_path / "missing.json") is None
