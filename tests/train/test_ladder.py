"""The ladder: tokens-to-target arithmetic on synthetic curves, tables, plots, config,
and a two-policy, few-step ladder end to end (with diagnostics not changing losses)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from train import ladder as L
from train import ladder_report as R
from train.config import ConfigError

NAN = float("nan")


# --------------------------------------------------------------------------- arithmetic
def test_tokens_to_target_interpolates_the_first_crossing():
    curve = [(0, 6.0), (100, 5.0), (200, 4.0), (300, 3.5), (400, 4.2)]
    assert R.tokens_to_target(curve, 4.5) == 150.0  # halfway between 5.0 and 4.0
    assert R.tokens_to_target(curve, 4.0) == 200.0  # reached exactly at an evaluation
    assert R.tokens_to_target(curve, 3.75) == 250.0
    assert R.tokens_to_target(curve, 6.5) == 0.0  # already below at the first evaluation
    assert R.tokens_to_target(curve, 3.0) is None
    # a non-finite loss ends the scan, even if later points are below the target
    assert R.tokens_to_target([(0, 6.0), (100, NAN), (200, 3.0)], 4.0) is None
    assert R.tokens_to_target([(0, 6.0), (100, "nan"), (200, 3.0)], 4.0) is None  # JSONL form
    with pytest.raises(ValueError, match="tokens must increase"):
        R.tokens_to_target([(0, 6.0), (0, 5.0)], 4.0)
    with pytest.raises(ValueError, match="target"):
        R.tokens_to_target(curve, NAN)


def test_classify_run():
    ok = R.classify_run([(0, 6.0), (100, 5.0), (200, 4.0)], target=4.5, max_tokens=300)
    assert (ok.status, ok.tokens_to_target) == ("converged", 150.0)
    slow = R.classify_run([(0, 6.0), (100, 5.0), (200, 4.6)], target=4.5, max_tokens=200)
    assert slow.status == "not_converged" and "not reached" in slow.reason
    late = R.classify_run([(0, 6.0), (300, 5.0), (400, 4.0)], target=4.5, max_tokens=300)
    assert late.status == "not_converged" and "beyond the budget" in late.reason  # t* = 350
    nan = R.classify_run([(0, 6.0), (100, 5.0), (200, NAN)], target=4.5, max_tokens=300)
    assert nan.status == "diverged" and "non-finite" in nan.reason
    up = R.classify_run([(0, 6.0), (100, 5.0), (200, 6.3)], target=4.5, max_tokens=300,
                        diverge_loss=6.0)
    assert up.status == "diverged" and "rose above" in up.reason
    guard = R.classify_run([(0, 6.0), (100, 5.0)], target=4.5, max_tokens=300,
                           stopped_nonfinite=True)
    assert guard.status == "diverged" and "guard" in guard.reason
    # reaching the target first wins over a later blow-up
    first = R.classify_run([(0, 6.0), (100, 4.0), (200, NAN)], target=4.5, max_tokens=300)
    assert first.status == "converged"


def _outcomes(policy, tokens):
    return [R.RunOutcome(policy=policy, seed=s, status="converged" if t else "not_converged",
                         tokens_to_target=t, final_eval_loss=4.0, tokens_trained=2000)
            for s, t in enumerate(tokens)]


def test_overhead_is_paired_by_seed_with_mean_and_spread():
    base = _outcomes("fp8", [1000.0, 1200.0])
    r = R.summarize_policy(_outcomes("mxfp4_all", [1100.0, 1260.0]), base)
    np.testing.assert_allclose(r.overheads, [0.10, 0.05])
    assert r.overhead_mean == pytest.approx(0.075)
    assert r.overhead_std == pytest.approx(0.05 / math.sqrt(2))  # sample std, ddof 1
    assert r.tokens_mean == 1180.0 and r.status == "converged"
    assert R.format_cell(r) == "+7.5% ± 3.5"
    b = R.summarize_policy(base, base)
    assert b.overhead_mean == 0.0 and b.overhead_std == 0.0
    # seed 1 has no converged baseline: the mean baseline (1000) is the reference
    r2 = R.summarize_policy(_outcomes("x", [1100.0, 1320.0]), _outcomes("fp8", [1000.0, None]))
    np.testing.assert_allclose(r2.overheads, [0.10, 0.32])


def test_does_not_converge_cells():
    base = _outcomes("fp8", [1000.0, 1000.0])
    none = R.summarize_policy(_outcomes("mxfp4_all_sr", [None, None]), base)
    assert none.status == "does not converge" and R.format_cell(none) == "does not converge"
    part = R.summarize_policy(_outcomes("nvfp4", [1200.0, None]), base)
    assert part.status == "partial"
    assert R.format_cell(part) == "+20.0% ± 0.0 (1/2 seeds did not converge)"
    div = R.summarize_policy([R.RunOutcome(policy="t", seed=0, status="diverged",
                                           tokens_to_target=None, final_eval_loss=NAN,
                                           tokens_trained=10)], base)
    assert R.format_cell(div) == "does not converge (diverged)"
    with pytest.raises(ValueError, match="one policy"):
        R.summarize_policy(_outcomes("a", [1.0]) + _outcomes("b", [1.0]), base)


def test_tables_in_the_papers_layout():
    base = _outcomes("fp8", [1000.0, 1000.0])
    res = {p: R.summarize_policy(_outcomes(p, t), base) for p, t in {
        "fp8": [1000.0, 1000.0], "mxfp4_fprop": [1080.0, 1090.0],
        "mxfp4_all": [1260.0, 1270.0], "mxfp4_all_sr": [None, None],
        "mxfp4_all_h16": [1085.0, 1085.0], "mxfp4_all_h32": [1090.0, 1090.0],
        "nvfp4": [1100.0, 1100.0]}.items()}
    t = R.paper_table(res)
    lines = t.splitlines()
    assert lines[0] == "| configuration | Fprop | +Dgrad | +Wgrad |"
    row = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:5]] for ln in lines[2:]}
    assert row["no stabilization"][0].startswith("+8.5% ± 0.7")
    assert row["no stabilization"][1] == "—"  # mxfp4_fprop_dgrad not in the results
    assert row["no stabilization"][2].startswith("+26.5%") and "(paper: 26–27%)" in \
        row["no stabilization"][2]
    assert row["stochastic rounding"][2].startswith("does not converge")
    assert row["deterministic Hadamard 16 (32)"][2].startswith("H16: +8.5% ± 0.0 / H32: +9.0%")
    assert row["randomized Hadamard 16"] == ["—", "—", "—"]
    extra = R.extra_table(res)
    assert "| nvfp4 | +10.0% ± 0.0 |" in extra and "tseng" not in extra
    d = R.details_table(res, [o for p in res for o in _outcomes(p, [1.0])], ["fp8", "nvfp4"])
    assert len(d.splitlines()) == 4


def test_plots(tmp_path):
    curves = {("fp8", 0): [(0, 6.0), (100, 5.0)], ("mxfp4_all", 0): [(0, 6.0), (100, "nan")],
              ("fp8", 1): [(0, 6.1), (100, 4.9)]}
    p = R.plot_curves(curves, tmp_path / "c.png", target=5.0)
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recs = [{"step": s, "eval_loss": 5.0 if s % 2 == 0 else None,
             "diag/fprop/lhs_rel_err": 0.1 + s / 100, "diag/wgrad/lhs_underflow": 0.01,
             "diag_slots": {"L*.q_proj": {"fprop": {"lhs_rel_err": 0.1, "rhs_rel_err": 0.2}},
                            "L*.k_proj": {"wgrad": {"lhs_rel_err": 0.3}}} if s % 2 == 0
             else None} for s in range(1, 6)]
    q = R.plot_run_diagnostics(recs, tmp_path / "d.png", title="t")
    assert q.read_bytes()[:4] == b"\x89PNG"
    assert R.plot_run_diagnostics([{"step": 1, "loss": 3.0}], tmp_path / "n.png") is None
    assert not (tmp_path / "n.png").exists()


# --------------------------------------------------------------------------- config
def test_ladder_config_validation():
    with pytest.raises(ConfigError, match="unknown ladder key"):
        L.from_dict({"polices": ["fp8"]})
    with pytest.raises(ConfigError, match="unknown"):
        L.from_dict({"policies": ["fp8", "fp5"]})
    with pytest.raises(ConfigError, match="baseline"):
        L.from_dict({"policies": ["bf16"], "baseline": "fp8"})
    with pytest.raises(ConfigError, match="run.seed"):
        L.from_dict({"run": {"seed": 3}})
    with pytest.raises(ConfigError, match="run.train.steps"):
        L.from_dict({"run": {"train": {"steps": 3}}})
    with pytest.raises(ConfigError, match="budget_multiple"):
        L.from_dict({"budget_multiple": 0.5})
    with pytest.raises(ConfigError, match="run: unknown config key"):
        L.from_dict({"run": {"trian": {}}})
    with pytest.raises(ConfigError, match="diagnostics.seeds"):
        L.from_dict({"diagnostics": {"seeds": "zero"}})
    with pytest.raises(ConfigError, match="diagnostics.policies"):
        L.from_dict({"policies": ["fp8"], "diagnostics": {"policies": ["nvfp4"]}})
    c = L.from_dict({"baseline_steps": 10, "budget_multiple": 1.25, "seeds": [3]})
    assert c.max_steps == 13 and c.seeds == (3,) and c.policies == L.LADDER_POLICIES


def test_shipped_configs_parse():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    tiny = L.load(root / "configs" / "ladder_target_tiny.yaml")
    assert set(tiny.policies) == set(L.LADDER_POLICIES) and len(tiny.seeds) >= 2
    gpu = L.load(root / "configs" / "ladder_target_gpu_1b.yaml")
    assert gpu.run["model"]["preset"] == "llama3_1b"


def test_llama_slot_labels():
    from models.llama import LlamaConfig

    c = LlamaConfig.tiny(n_layers=2)
    assert L.llama_slot_labels(c) == ["L*.q_proj", "L*.k_proj", "L*.v_proj", "L*.o_proj",
                                      "L*.gate_proj", "L*.up_proj", "L*.down_proj"]
    u = L.llama_slot_labels(c.replace(scan_layers=False, quantize_embed_head=True))
    assert u[0] == "embed" and u[1] == "L0.q_proj" and u[8] == "L1.q_proj" and u[-1] == "lm_head"
    a = L.llama_slot_labels(c.replace(quantize_attention=True))
    assert a[3:5] == ["L*.attn_scores", "L*.attn_values"]


# --------------------------------------------------------------------------- end to end
MODEL = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 64,
         "max_seq_len": 32}


def _run_section(cache, jax_cache=None):
    return {"jax_cache_dir": None if jax_cache is None else str(jax_cache),
            "model": {"preset": "tiny", "overrides": dict(MODEL)},
            "data": {"cache_dir": str(cache), "max_docs": 3000, "vocab_size": 260, "seq_len": 16},
            "optim": {"lr": 3e-3, "warmup_steps": 1},
            "train": {"global_batch": 4, "eval_every": 2, "eval_sequences": 4,
                      "progress": "off", "plot": False},
            "checkpoint": {"every": 0, "async_save": False}}


# The older tokens-to-target ladder (make ladder-target); its unit tests above stay in the
# default run, this end-to-end one (~90 s of CPU) runs with make test-slow.
@pytest.mark.slow
def test_two_policy_ladder_end_to_end(tmp_path, tmp_path_factory):
    from train import config as C
    from train import loop
    from train.output.metrics import read_jsonl

    cfg = L.from_dict({"name": "t", "out_dir": str(tmp_path / "ladder"),
                       "policies": ["fp8", "mxfp4_all"], "seeds": [0, 1], "baseline_steps": 4,
                       "budget_multiple": 1.5,
                       "diagnostics": {"enabled": True, "seeds": [0], "policies": ["mxfp4_all"],
                                       "cosine": False},  # cosine: see test_diagnostics.py
                       # the compilation cache makes seed 1 and the resumed stage cheap
                       "run": _run_section(tmp_path / "data",
                                           tmp_path_factory.getbasetemp() / "jax_cache")})
    rep = L.run_ladder(cfg, verbose=False)
    out = tmp_path / "ladder"
    for f in ("ladder.md", "ladder.json", "ladder_curves.png", "target.json"):
        assert (out / f).is_file(), f
    md = (out / "ladder.md").read_text()
    assert "| configuration | Fprop | +Dgrad | +Wgrad |" in md
    assert set(rep["policies"]) == {"fp8", "mxfp4_all"}
    assert rep["max_steps"] == 6 and rep["tokens_per_step"] == 64
    base_recs = read_jsonl(out / "runs" / "fp8" / "seed0" / "metrics.jsonl")
    at4 = [r["eval_loss"] for r in base_recs if r["step"] == 4 and r["eval_loss"] is not None]
    at4 += [r["eval_loss"] for r in read_jsonl(out / "runs" / "fp8" / "seed1" / "metrics.jsonl")
            if r["step"] == 4 and r["eval_loss"] is not None]
    assert rep["target_eval_loss"] == pytest.approx(np.mean(at4))
    assert rep["policies"]["fp8"]["n_converged"] == 2
    for run in rep["runs"]:
        assert run["status"] in ("converged", "not_converged", "diverged")
        assert run["curve"][0][0] == 0
    # diagnostics: seed 0 runs record them, seed 1 runs do not
    mx0 = read_jsonl(out / "runs" / "mxfp4_all" / "seed0" / "metrics.jsonl")
    trained = [r for r in mx0 if r["step"] > 0]
    assert all(0 < r["diag/wgrad/lhs_rel_err"] < 1 for r in trained)
    assert all(r["diag_gemm"] is None for r in trained)  # raw arrays are not kept
    slots = [r["diag_slots"] for r in trained if r.get("diag_slots")]
    assert slots and set(slots[0]) == {"L*.q_proj", "L*.k_proj", "L*.v_proj", "L*.o_proj",
                                       "L*.gate_proj", "L*.up_proj", "L*.down_proj"}
    assert (out / "runs" / "mxfp4_all" / "seed0" / "diagnostics.png").is_file()
    for other in ("mxfp4_all/seed1", "fp8/seed0"):
        recs = read_jsonl(out / "runs" / other / "metrics.jsonl")
        assert not any("diag/wgrad/lhs_rel_err" in r for r in recs)
    assert "## Diagnostics" in md and "| mxfp4_all | 0 |" in md
    # TensorBoard: one run per policy and seed; the per-GEMM diagnostics where they were on
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer(size_guidance={"scalars": 0}).AddRunsFromDirectory(str(out / "runs"))
    mux.Reload()
    tb = {name.replace("\\", "/"): tags["scalars"] for name, tags in mux.Runs().items()}
    assert set(tb) == {"fp8/seed0", "fp8/seed1", "mxfp4_all/seed0", "mxfp4_all/seed1"}
    assert all({"train/loss", "eval/loss"} <= set(tags) for tags in tb.values())
    assert "diag/wgrad/lhs_rel_err" in tb["mxfp4_all/seed0"]
    assert "diag/wgrad/lhs_rel_err" not in tb["mxfp4_all/seed1"]

    # switching diagnostics on does not change losses: the same run without them
    raw = L.run_config(cfg, "mxfp4_all", 0, cfg.max_steps, rep["target_eval_loss"]).to_dict()
    raw.update(out_dir=str(tmp_path / "plain"))
    plain = loop.run(C.from_dict(raw), verbose=False)
    plain_recs = read_jsonl(plain.metrics_path)
    assert [r["loss"] for r in plain_recs] == [r["loss"] for r in mx0]
    assert [r["eval_loss"] for r in plain_recs] == [r["eval_loss"] for r in mx0]

    # resumable: a second invocation trains nothing and reports the same numbers
    stamp = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/metrics.jsonl")}
    rep2 = L.run_ladder(cfg, verbose=False)
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/metrics.jsonl")} == stamp
    assert json.dumps(rep2["policies"]) == json.dumps(rep["policies"])


def test_cli_rejects_bad_config(tmp_path, capsys):
    p = tmp_path / "l.yaml"
    p.write_text("policies: [fp8, nope]\n")
    assert L.main(["--config", str(p)]) == 2
    assert "unknown" in capsys.readouterr().err
