"""The MLPerf config (configs/llama3_8b_mlperf.yaml) shrunk to CPU size, trained a few steps:
its mllog.txt goes through MLCommons' compliance checker (training 6.1.0, closed llama31_8b)
and its TensorBoard events are read back with TensorBoard's own reader.

Shrunk: a 2-layer d-64 model instead of Llama 3.1-8B, the bundled Austen corpus (BPE 512)
standing in for C4, sequences of 64 tokens, 4 steps of 8 sequences (2 micro-batches), 16 eval
sequences, no checkpoints, and the bf16 policy (the MLPerf file's mxfp4_all_h16 would double the
compile time; its precision records are tested in test_mlperf.py). The optimizer section,
seed, target and submission records are the MLPerf file's. Four rules cannot hold at that size,
and the checker must name exactly those:

* ``max_sequence_length`` must be 8192 (here 64),
* ``eval_samples`` must be 1024 (here 16),
* ``max_steps`` must be 1,200,000 (here 4),
* ``eval_accuracy`` must reach 3.3 at least once (a 4-step tiny model stays near ln 512 ~ 6.2).
"""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.train.train_testutil import MODEL, ROOT
from train import config as C
from train import loop
from train.output import mlperf as M
from train.output.metrics import read_jsonl

CANNOT_PASS_AT_CPU_SIZE = {
    "max_sequence_length": "v['value'] == 8192",
    "eval_samples": "v['value'] == 1024",
    "max_steps": "v['value'] == 1200000",
    "eval_accuracy": "(v['value'] <= 3.3) and v['value'] > 0.0",
}
SHRINK = [
    "policy=passthrough", "model.preset=tiny",
    f"model.overrides={MODEL}",
    "data.loader=prepared", "data.sources=[embedded:austen]", "data.val_sources=[]",
    "data.format=auto",
    "data.tokenizer=bpe", "data.eos_token=null", "data.vocab_size=512", "data.max_docs=3000",
    "data.seq_len=64",
    "train.steps=4", "train.global_batch=8", "train.micro_batch=4", "train.eval_every=2",
    "train.eval_sequences=16", "train.eval_batch=8", "train.progress=off",
    "checkpoint.enabled=false", "jax_cache_dir=null",
]


@pytest.fixture(scope="module")
def mlperf_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlperf") / "run"
    cache = tmp_path_factory.getbasetemp() / "mlperf_data_cache"
    cfg = C.load(ROOT / "configs" / "llama3_8b_mlperf.yaml",
                 [*SHRINK, f"out_dir={out}", f"data.cache_dir={cache}"])
    return cfg, loop.run(cfg, verbose=False)


@pytest.mark.slow
def test_compliance_checker_on_the_shrunk_mlperf_run(mlperf_run):
    cfg, summary = mlperf_run
    assert summary.status == "completed" and summary.steps == 4
    res = M.check_compliance(cfg.out_path / "mllog.txt")
    assert set(res.failures) == set(CANNOT_PASS_AT_CPU_SIZE), res.failures
    for key, test in CANNOT_PASS_AT_CPU_SIZE.items():
        assert test in res.failures[key], (key, res.failures[key])
    assert res.warnings == {}


def test_mllog_records_of_the_run(mlperf_run):
    cfg, summary = mlperf_run
    recs = M.read_records(cfg.out_path / "mllog.txt")
    values = {r["key"]: r["value"] for r in recs}
    assert values["submission_benchmark"] == "llama31_8b"
    assert values["lowest_numerical_precision_in_linear"] == "bfloat16"  # bf16 policy
    assert values["lowest_numerical_precision_in_attn"] == "bfloat16"
    assert values["gradient_accumulation_steps"] == 2 and values["micro_batch_size"] == 4
    assert values["opt_learning_rate_decay_steps"] == 1_200_000 - 512
    assert values["config_filename"] == str(cfg.out_path / "config.yaml")
    ev = [r for r in recs if r["key"] == "eval_accuracy"]
    assert [(r["metadata"]["samples_count"], r["value"]) for r in ev] == \
        [(16, summary.eval_history[0][2]), (32, summary.eval_history[1][2])]
    assert recs[-1]["key"] == "run_stop" and recs[-1]["metadata"]["status"] == "aborted"


def test_tensorboard_events_of_the_run(mlperf_run):
    cfg, summary = mlperf_run
    acc = EventAccumulator(str(cfg.out_path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "eval/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
            "train/skipped_steps"} <= tags
    recs = read_jsonl(summary.metrics_path)
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in recs]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == \
        [(s, pytest.approx(v, rel=1e-6)) for s, _, v in summary.eval_history]
    assert json.loads((cfg.out_path / "summary.json").read_text())["steps"] == 4
