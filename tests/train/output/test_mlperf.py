"""train.output.mlperf: the MLPerf records written through mlperf_logging.mllog, checked by the
package's own compliance checker (ruleset training 6.1.0, closed llama31_8b)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mxjax import policies
from tests.train.train_testutil import ROOT
from train import config as C
from train.output import mlperf as M

MLPERF_YAML = ROOT / "configs" / "llama3_8b_mlperf.yaml"


def _facts(**kw) -> M.RunFacts:
    base = {"policy_name": "mxfp4_all_h16", "policy_record": None, "compute_dtype": "bfloat16",
            "quantized_attention": False, "tensor_parallelism": 1, "micro_batch_per_replica": 2,
            "train_samples": 161_000, "platform": "8xNVIDIA H200",
            "config_filename": "config.yaml"}
    return M.RunFacts(**{**base, **kw})


def _write_run(path: Path, cfg, evals, *, success: bool, facts: M.RunFacts | None = None):
    """The records of a run with evaluations at (step, loss); steps of global_batch sequences."""
    gbs = cfg.train.global_batch
    log = M.MLPerfLog(path, resume_step=None)
    log.begin_init(M.run_header(cfg, facts or _facts()))
    log.begin_run()
    last = 0
    for step, loss in evals:
        for s in range(last, step):
            log.train_block(step=s + 1, samples=s * gbs)
        log.evaluation(loss, step=step, samples=step * gbs)
        last = step
    log.end_run(success=success, step=last, samples=last * gbs)
    log.close()
    return M.read_records(path)


@pytest.fixture(scope="module")
def mlperf_cfg():
    return C.load(MLPERF_YAML, [])


def test_full_size_run_passes_the_checker(tmp_path, mlperf_cfg):
    """A log with the real MLPerf config's values and an eval at the 3.3 target passes, through
    the checker's API and its command line (`python -m mlperf_logging.compliance_checker`)."""
    path = tmp_path / "mllog.txt"
    _write_run(path, mlperf_cfg, [(768, 3.9), (1536, 3.29)], success=True)
    res = M.check_compliance(path)
    assert res.passed, res.failures
    assert res.failures == {} and res.warnings == {}
    cli = subprocess.run(
        [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
         "--ruleset", M.RULESET, "--log_output", str(tmp_path / "cc.log"), str(path)],
        capture_output=True, text=True, timeout=120, check=False)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "SUCCESS" in cli.stdout + cli.stderr


@pytest.mark.parametrize("sets, facts, key", [
    (["optim.b2=0.99"], {}, "opt_adamw_beta_2"),
    (["optim.decay_steps=1000000"], {}, "opt_learning_rate_decay_steps"),
    (["data.seq_len=4096"], {}, "max_sequence_length"),
    (["mlperf.benchmark=gpt3"], {}, "submission_benchmark"),
    ([], {"tensor_parallelism": 0}, "tensor_parallelism"),
])
def test_checker_names_a_broken_rule(tmp_path, mlperf_cfg, sets, facts, key):
    """The check is not vacuous: one rule broken fails exactly there."""
    cfg = C.load(MLPERF_YAML, sets) if sets else mlperf_cfg
    path = tmp_path / "mllog.txt"
    _write_run(path, cfg, [(768, 3.29)], success=True, facts=_facts(**facts))
    res = M.check_compliance(path)
    assert not res.passed and key in res.failures, res.failures


def test_target_missed_is_reported(tmp_path, mlperf_cfg):
    path = tmp_path / "mllog.txt"
    _write_run(path, mlperf_cfg, [(768, 3.6)], success=False)
    res = M.check_compliance(path)
    assert set(res.failures) == {"eval_accuracy"}, res.failures
    assert "<= 3.3" in res.failures["eval_accuracy"]


def test_record_order_and_metadata(tmp_path, mlperf_cfg):
    recs = _write_run(tmp_path / "mllog.txt", mlperf_cfg, [(2, 4.0), (4, 3.2)], success=True)
    keys = [r["key"] for r in recs]
    header = [k for k, _ in M.run_header(mlperf_cfg, _facts())]
    assert keys[:2] == ["cache_clear", "init_start"]
    assert keys[2:2 + len(header)] == header
    evaluation = ["block_stop", "eval_start", "eval_accuracy", "eval_stop"]
    assert keys[2 + len(header):] == (["init_stop", "run_start", "epoch_start", "block_start"]
                                       + evaluation + ["block_start"] + evaluation
                                       + ["epoch_stop", "run_stop"])
    ev = [r for r in recs if r["key"] == "eval_accuracy"]
    assert [r["value"] for r in ev] == [4.0, 3.2]
    assert [r["metadata"]["samples_count"] for r in ev] == [32, 64]
    assert [r["metadata"]["epoch_num"] for r in ev] == [32, 64]
    assert recs[-1]["metadata"]["status"] == "success"
    starts = [r["metadata"]["samples_count"] for r in recs if r["key"] == "block_start"]
    assert starts == [0, 32]
    # the caller (not the wrapper), relative to the repository
    assert all(r["metadata"]["file"] == "tests/train/output/test_mlperf.py" for r in recs)
    values = {r["key"]: r["value"] for r in recs}
    assert values["opt_learning_rate_decay_steps"] == 1_200_000 - 512


def test_resume_drops_later_records_and_keeps_the_block(tmp_path, mlperf_cfg):
    path = tmp_path / "mllog.txt"
    _write_run(path, mlperf_cfg, [(2, 4.0), (4, 3.9), (6, 3.8)], success=False)
    log = M.MLPerfLog(path, resume_step=3)  # a block opened at step 3 is still open
    log.train_block(step=4, samples=48)  # so this adds nothing
    log.evaluation(3.7, step=4, samples=64)
    log.end_run(success=False, step=4, samples=64)
    log.close()
    recs = M.read_records(path)
    assert [r["metadata"]["step"] for r in recs] == sorted(r["metadata"]["step"] for r in recs)
    assert [r["value"] for r in recs if r["key"] == "eval_accuracy"] == [4.0, 3.7]
    assert [r["key"] for r in recs].count("block_start") == 2
    assert [r["key"] for r in recs].count("run_stop") == 1


@pytest.mark.parametrize("policy, dtype, want", [
    ("mxfp4_all_h16", "bfloat16", "mxfp4"), ("mxfp4_fprop", "float32", "mxfp4"),
    ("fp8", "bfloat16", "fp8"), ("nvfp4", "bfloat16", "nvfp4"), ("tseng", "float32", "mxfp4"),
    ("passthrough", "float32", "fp32"), ("passthrough", "bfloat16", "bfloat16"),
    (None, "float16", "fp16"),
])
def test_policy_precision(policy, dtype, want):
    rec = policies.to_dict(policies.get(policy)) if policy else None
    assert M.policy_precision(rec, dtype) == want


def test_every_preset_has_a_precision_name():
    for name in policies.names():
        assert M.policy_precision(policies.to_dict(policies.get(name)), "bfloat16") in \
            {"mxfp4", "nvfp4", "fp8", "bfloat16"}


def test_bad_precision_inputs():
    with pytest.raises(ValueError, match="format 'int3'"):
        M.policy_precision({g: {"lhs": {"fmt": "int3"}, "rhs": {"fmt": "bf16"}}
                            for g in ("fprop", "dgrad", "wgrad")}, "bfloat16")
    with pytest.raises(ValueError, match="no MLPerf precision name for 'int8'"):
        M.dtype_precision("int8")
    with pytest.raises(ValueError, match="no fprop.lhs.fmt"):
        M.policy_precision({}, "float32")
    assert M.lowest(["fp32", "fp8", "bfloat16"]) == "fp8"


def test_check_run_log_picks_the_rules(tmp_path, mlperf_cfg):
    """configs/tiny.yaml logs submission_benchmark 'tiny', for which the
    checker has no rules file (its command line stops with FileNotFoundError
    .../closed_tiny.yaml). `check_run_log` checks such a log as llama31_8b: the structure
    must pass, that benchmark's own rules are listed apart. A llama31_8b log is checked as
    it is."""
    tiny = C.load(ROOT / "configs" / "tiny.yaml", [])
    path = tmp_path / "tiny.txt"
    recs = _write_run(path, tiny, [(25, 5.1), (50, 4.7)], success=False)
    assert {r["key"]: r["value"] for r in recs}["submission_benchmark"] == "tiny"
    raw = M.check_compliance(path)
    assert not raw.passed and any("closed_tiny.yaml" in v for v in raw.failures.values())
    chk = M.check_run_log(path)
    assert chk.passed and not chk.is_benchmark and chk.checked_as == "llama31_8b"
    assert set(chk.benchmark_differences) == {
        "max_sequence_length", "eval_samples", "max_steps", "opt_learning_rate_decay_steps",
        "eval_accuracy"}, chk.benchmark_differences
    assert set(chk.benchmark_differences) <= M.benchmark_rule_keys("llama31_8b")
    # a structural fault in such a log fails
    bad = tmp_path / "bad.txt"
    bad.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                           if '"key": "init_stop"' not in line))
    assert not M.check_run_log(bad).passed
    # the MLPerf config's log: every rule, passed
    full = tmp_path / "full.txt"
    _write_run(full, mlperf_cfg, [(768, 3.9), (1536, 3.29)], success=True)
    chk = M.check_run_log(full)
    assert chk.is_benchmark and chk.passed and chk.benchmark_differences == {}
    # ... and failed when one of its rules is broken
    broken = tmp_path / "broken.txt"
    _write_run(broken, C.load(MLPERF_YAML, ["optim.b2=0.99"]), [(768, 3.29)], success=True)
    chk = M.check_run_log(broken)
    assert chk.is_benchmark and not chk.passed and "opt_adamw_beta_2" in chk.result.failures
