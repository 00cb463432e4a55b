"""train.diagnostics.numerics: the call-site labels, a run with ``diagnostics.enabled`` (its
fields in metrics.jsonl and TensorBoard, its losses unchanged) and the summary's readings
(instability point, diagnostics means)."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from models.llama import LlamaConfig
from mxjax import diagnostics as D
from tests.train.train_testutil import load
from train import config as C
from train import loop
from train.config import ConfigError
from train.diagnostics import numerics as N
from train.hooks import Hooks, StepContext
from train.output.metrics import MetricsWriter, read_jsonl
from train.output.summary import read_summary, segment_record, summarize


def test_llama_slot_labels():
    c = LlamaConfig.tiny(n_layers=2)
    assert N.llama_slot_labels(c) == ["L*.q_proj", "L*.k_proj", "L*.v_proj", "L*.o_proj",
                                      "L*.gate_proj", "L*.up_proj", "L*.down_proj"]
    u = N.llama_slot_labels(c.replace(scan_layers=False, quantize_embed_head=True))
    assert u[0] == "embed" and u[1] == "L0.q_proj" and u[8] == "L1.q_proj" and u[-1] == "lm_head"
    a = N.llama_slot_labels(c.replace(quantize_attention=True))
    assert a[3:5] == ["L*.attn_scores", "L*.attn_values"]


# --------------------------------------------------------------------------- host side
def _stats(fprop_lhs_rel_err_sums, count=2.0):
    """f32[n_slots, 3, N_GEMM_FIELDS] probe sums: `count` calls per GEMM, the given fprop
    lhs_rel_err sums, everything else zero."""
    st = np.zeros((len(fprop_lhs_rel_err_sums), 3, D.N_GEMM_FIELDS), np.float32)
    st[:, :, D.GEMM_FIELDS.index("count")] = count
    st[:, 0, D.GEMM_FIELDS.index("lhs_rel_err")] = fprop_lhs_rel_err_sums
    return st


def _hooked(labels):
    """A RunDiagnostics whose in_step has seen a 2-layer stacked kernel and one flat leaf."""
    rd = N.RunDiagnostics(labels=labels, cosine=False)
    params = {"layers": {"w": np.ones((2, 3), np.float32)}, "head": np.ones((4,), np.float32)}
    grads = {"layers": {"w": np.array([[3.0, 4.0, 0.0], [0.0, 0.0, 0.0]], np.float32)},
             "head": np.full((4,), 0.5, np.float32)}
    new = jax.tree.map(lambda x: 1.5 * x, params)  # every layer moves by half its norm
    out = rd.in_step(StepContext(params=params, grads=grads, new_params=new, loss=0.0,
                                 grad_norm=0.0, lr=0.0, step=0, aux={"gemm_stats": _stats([0])}))
    return rd, {k: np.asarray(v).tolist() for k, v in out.items()}


def test_on_record_turns_the_step_arrays_into_compact_fields():
    rd, arrays = _hooked(["L*.q_proj", "L*.k_proj"])
    # grad norms: layer 0 of w = 5, layer 1 = 0 (collapsed), head = 1; update 0.5 everywhere
    assert sorted(arrays["diag_grad_norm"]) == [0.0, 1.0, 5.0]
    rec = {"step": 3, "eval_loss": 4.0, **arrays, "diag_gemm": _stats([0.2, 0.6]).tolist()}
    more = rd.on_record(rec)
    assert more["diag/fprop/lhs_rel_err"] == pytest.approx(0.2)  # mean of 0.1 and 0.3
    assert more["diag/dgrad/lhs_rel_err"] == 0.0
    assert more["grad_collapse_rate"] == 0.33333  # 1 of 3 layers; fields keep 5 digits
    assert more["grad_norm_layer_min"] == 0.0
    assert more["update_ratio_mean"] == pytest.approx(0.5) and more["update_ratio_std"] == 0
    assert more["diag_slots"]["L*.k_proj"]["fprop"]["lhs_rel_err"] == pytest.approx(0.3)
    assert more["diag_layer_grad_norm"] == {"layers.0.w": 5.0, "layers.1.w": 0.0, "head": 1.0}
    assert more["diag_gemm"] is None and more["diag_update"] is None  # raw arrays dropped
    assert "diag_slots" not in rd.on_record({**rec, "eval_loss": None})  # eval steps only
    assert rd.on_record({"step": 0, "eval_loss": 4.0}) == {}  # the step-0 eval record


def test_on_record_with_labels_that_do_not_fit_names_slots_by_index(capsys):
    rd, arrays = _hooked(["only_one"])
    more = rd.on_record({"step": 1, "eval_loss": 1.0, **arrays,
                         "diag_gemm": _stats([0.2, 0.6]).tolist()})
    assert set(more["diag_slots"]) == {"gemm0", "gemm1"}
    assert "2 quantized GEMM call sites but 1 labels" in capsys.readouterr().err


def test_diagnostics_and_own_hooks_are_refused_together(tmp_path, data_cache):
    cfg = load(tmp_path / "run", data_cache, "diagnostics.enabled=true")
    with pytest.raises(ConfigError, match="diagnostics.enabled"):
        loop.run(cfg, hooks=Hooks(on_record=lambda r: None), verbose=False)


# --------------------------------------------------------------------------- a run
STEPS = ("train.steps=3", "train.eval_every=3", "checkpoint.enabled=false", "train.plot=false",
         "policy=mxfp4_all")


# Two compilations of an mxfp4_all step (one instrumented): ~1 min of CPU, so make test-slow.
@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """The same 3-step mxfp4_all run with and without diagnostics."""
    root = tmp_path_factory.mktemp("numerics")
    diag = load(root / "diag", data_cache, *STEPS, "diagnostics.enabled=true",
                "diagnostics.cosine=false")  # the cosine's own test: tests/mxjax
    plain = load(root / "plain", data_cache, *STEPS)
    return diag, loop.run(diag, verbose=False), plain, loop.run(plain, verbose=False)


@pytest.mark.slow
def test_a_run_with_diagnostics_records_them_and_keeps_its_losses(runs):
    diag, s_diag, plain, s_plain = runs
    recs, base = (read_jsonl(c.out_path / "metrics.jsonl") for c in (diag, plain))
    trained = [r for r in recs if r["step"] > 0]
    assert len(trained) == 3
    assert all(0 < r["diag/wgrad/lhs_rel_err"] < 1 for r in trained)
    assert all(0 <= r["grad_collapse_rate"] <= 1 and r["update_ratio_mean"] > 0 for r in trained)
    assert all(r["diag_gemm"] is None for r in trained)  # the raw arrays are not kept
    slots = [r["diag_slots"] for r in trained if r.get("diag_slots")]
    assert len(slots) == 1 and set(slots[0]) == set(N.llama_slot_labels(
        LlamaConfig.tiny(n_layers=2)))
    assert not any(k.startswith("diag") for r in base for k in r)
    # switching diagnostics on changes no loss
    assert [r["loss"] for r in recs] == [r["loss"] for r in base]
    assert [r["eval_loss"] for r in recs] == [r["eval_loss"] for r in base]
    acc = EventAccumulator(str(diag.out_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert "diag/wgrad/lhs_rel_err" in acc.Tags()["scalars"]
    # summary.json: the diagnostics means, none without them
    assert s_diag.diagnostics["diag/wgrad/lhs_rel_err"] == pytest.approx(
        trained[-1]["diag/wgrad/lhs_rel_err"])
    assert s_plain.diagnostics is None
    assert read_summary(diag.out_path / "summary.json") == s_diag


# --------------------------------------------------------------------------- summary
def _summary_of(tmp_path, grad_norms, **extra):
    cfg = C.load(None, [f"out_dir={tmp_path}", "train.plot=false"])
    w = MetricsWriter(tmp_path / "metrics.jsonl", resume_step=None)
    for step, g in enumerate(grad_norms, 1):
        w.write({"step": step, "tokens": step, "loss": 1.0, "eval_loss": None,
                 "grad_norm": g, **extra})
    w.close()
    return summarize(cfg, policy_name="none", status="completed", message="", step=len(grad_norms),
                     tokens_per_step=1, skipped=0, resumed=None, primary=True,
                     segments=[segment_record(first_step=0, last_step=len(grad_norms), wall_s=1.0,
                                              steady_steps=0, steady_s=0.0, tokens_per_step=1)])


def test_summary_names_the_instability_point(tmp_path):
    # steps 1-3 settle at 1.0, then 5 steps above 100x the running minimum (one non-finite)
    s = _summary_of(tmp_path, [2.0, 1.0, 1.5, 150.0, 200.0, math.inf, 300.0, 120.0, 1.0])
    assert (s.instability_step, s.instability_kind) == (4, "grad_norm_growth")
    assert s.diagnostics is None
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["instability_step"] == 4 and saved["instability_kind"] == "grad_norm_growth"


def test_summary_without_instability_and_with_diag_fields(tmp_path):
    # 4 steps of 4 fields: the means over the last quarter (the last record)
    s = _summary_of(tmp_path, [1.0, 0.9, 0.8, 0.7], **{"diag/fprop/lhs_rel_err": 0.25,
                                                        "grad_collapse_rate": 0.5})
    assert s.instability_step is None and s.instability_kind is None
    assert s.diagnostics == {"diag/fprop/lhs_rel_err": 0.25, "grad_collapse_rate": 0.5,
                             "grad_collapse_rate_max": 0.5}
