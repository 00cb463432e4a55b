"""The ladder study: config checks, unit planning, branch pairing, and the report's arithmetic."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from mxjax import policies
from study import config as SC
from study import engine as E
from study import policies as SP
from study import report as R
from study import runner
from study import states as ST
from study import units as SU
from train.checkpoint import IncompatibleCheckpointError
from train.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 96,
        "max_seq_len": 64}


def _raw(tmp: Path, cache: Path, **top) -> dict:
    return {"name": "t", "out_dir": str(tmp), "rungs": ["fp8", "mxfp4_all"],
            "ablations": ["mxfp4_wgrad_only_rht16"], "seeds": [0, 1], "steps": 12, "eval_every": 4,
            "rung_eval_every": 4, "eval_sequences": 8, "width": 32, "workers": 1,
            "probe": False,
            "branch": {"points": [4, 6], "late_from": 5, "steps": 2, "exact_steps": 4,
                       "exact_eval_every": 2},
            "run": {"jax_cache_dir": str(cache / "jax"),
                    "model": {"preset": "tiny", "overrides": TINY},
                    "data": {"sources": ["embedded:austen"], "tokenizer": "bpe",
                             "vocab_size": 512, "seq_len": 32, "max_docs": 3000,
                             "cache_dir": str(cache)},
                    "optim": {"lr": 3e-3, "warmup_steps": 2},
                    "train": {"global_batch": 4, "eval_batch": 8}},
            **top}


# --------------------------------------------------------------------------- config
def test_shipped_study_configs_load():
    tiny = SC.load(ROOT / "configs" / "ladder_tiny.yaml")
    gpu = SC.load(ROOT / "configs" / "ladder_gpu_1b.yaml")
    assert len(tiny.seeds) >= 4 and tiny.eval_sequences * 128 >= 65536
    assert set(SP.RUNGS) <= set(tiny.rungs) and set(SP.RUNGS) <= set(gpu.rungs)
    assert tiny.scale.widths and gpu.workers == 1
    # the GPU study: fp8 baseline and MXFP4 rungs on the chip's units
    assert SC.run_config(gpu, gpu.width).backend == "auto"
    assert SC.run_config(tiny, tiny.width).backend == "auto"  # the train default: on a CPU
    # 'auto' is the emulation, bit for bit


@pytest.mark.parametrize("change, match", [
    ({"ablations": ["nope"]}, "ablations: unknown"),
    ({"baseline": "mxfp4_all_h16"}, "baseline"),
    ({"seeds": [0]}, "seeds"),
    ({"branch": {"points": [11], "steps": 2}}, "branch.points"),
    ({"branch": {"steps": 4, "exact_steps": 2}}, "exact_steps"),
    ({"branch": {"exact_eval_every": 3}}, "exact_eval_every"),
    ({"scale": {"widths": [32]}}, "scale.widths"),
    ({"run": {"policy": "fp8"}}, "run.policy"),
    ({"workers": 0}, "workers"),
    ({"run": {"backend": "fp4"}}, "run: backend: expected one of"),
])
def test_bad_study_configs_name_the_key(tmp_path, change, match):
    raw = _raw(tmp_path, tmp_path)
    for k, v in change.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) and k in raw else v
    with pytest.raises(ConfigError, match=match):
        SC.from_dict(raw)


def test_run_backend_reaches_every_run_of_the_study(tmp_path):
    """``run: {backend: auto}``: the shared train config carries it, and `CompiledRun` compiles
    the baseline and every rung on it (tests/train/test_config_policy_spec.py)."""
    raw = _raw(tmp_path, tmp_path)
    raw["run"] = {**raw["run"], "backend": "auto"}
    cfg = SC.from_dict(raw)
    assert SC.run_config(cfg, cfg.width).backend == "auto"
    assert SC.run_config(SC.from_dict(_raw(tmp_path, tmp_path)), 32).backend == "auto"
    raw["run"] = {**raw["run"], "backend": "xla"}  # the emulation on every chip
    assert SC.run_config(SC.from_dict(raw), 32).backend == "xla"


def test_units_cover_every_run_and_branch_and_group_by_policy(tmp_path):
    cfg = SC.from_dict(_raw(tmp_path, tmp_path, scale={"widths": [16], "seeds": [0],
                                                      "policies": ["mxfp4_all"]}))
    units = SU.plan_units(cfg)
    runs = [u for u in units if u.kind == "run"]
    branches = [u for u in units if u.kind == "branch"]
    # 3 ladder policies x 2 seeds at the main width + the scale width's reference run.
    assert len(runs) == 3 * 2 + 1
    # main: 2 seeds x 2 points x (exact + 3 policies); scale: 1 seed x 2 points x 2.
    assert len(branches) == 2 * 2 * 4 + 2 * 2
    assert all(u.phase == 0 for u in units if u.kind == "run" and u.policy == "none")
    assert len({u.path(tmp_path) for u in units}) == len(units)
    for group in SU.chunks(units):
        assert len({(u.phase, u.width, u.kind, u.policy) for u in group}) == 1


def test_ablations_are_the_studys_and_former_names_still_read():
    assert set(SP.ABLATIONS) <= set(SP.PRESETS)
    assert set(SP.ABLATIONS) & set(policies.names()) == {"mxfp4_all_h16_wgrad"}
    assert all(SP.get(n).name == n for n in SP.ABLATIONS)
    for name in SP.ABLATION_PRESETS:  # study policies, not library API
        with pytest.raises(ValueError, match="unknown preset"):
            policies.get(name)
        assert SP.get(f"{name}@xla_fp8").name == f"{name}@xla_fp8"
    assert SP.get("none") is None
    for old, new in SP.LEGACY.items():
        with pytest.warns(DeprecationWarning, match=f"study policy '{old}' is now '{new}'"):
            assert SP.get(old) == SP.get(new)
    with pytest.raises(ValueError, match="unknown study policy 'mxfp5'"):
        SP.get("mxfp5")
    with pytest.raises(TypeError):
        SP.LEGACY["mine"] = "mxfp4_all"  # the registry is read-only


def _mine():
    return {**policies.to_dict(SP.get("mxfp4_wgrad_only_rht16")), "name": "mine"}


@pytest.mark.parametrize("form", ["name", "dict", "policy", "unnamed", "none"])
def test_study_policy_lists_take_every_form_resolve_takes(tmp_path, form):
    # A rung given as a mapping is read, not "rungs[1]: expected a string, got dict".
    spec = {"name": "mxfp4_all_h16", "dict": _mine(), "none": None,
            "policy": policies.from_dict(_mine()),
            "unnamed": policies.get("mxfp4_all_h16").replace(fprop=None)}[form]
    raw = _raw(tmp_path, tmp_path, rungs=["fp8", spec], ablations=[spec],
               scale={"widths": [16], "seeds": [0], "policies": [spec]})
    cfg = SC.from_dict(raw)
    name = cfg.rungs[1]
    assert cfg.ablations == (name,) and cfg.scale.policies == (name,)
    assert cfg.policy(name) == policies.resolve(spec)
    if form in ("dict", "policy"):
        assert name == "mine" and set(cfg.custom_policies) == {"mine"}
    elif form == "unnamed":
        assert name.startswith("custom-") and set(cfg.custom_policies) == {name}
    else:
        assert name == ("none" if spec is None else spec) and cfg.custom_policies == {}
    assert SC.from_dict(json.loads(json.dumps(SC.to_dict(cfg)))) == cfg  # what workers get
    assert {u.policy for u in SU.plan_units(cfg)} >= {name}


def test_study_policy_dict_errors_name_the_key(tmp_path):
    def bad(**top):
        return SC.from_dict(_raw(tmp_path, tmp_path, **top))

    with pytest.raises(ConfigError, match=r"rungs\[1\]: .*fprop: missing keys \['rhs'\]"):
        bad(rungs=["fp8", {"fprop": {"lhs": "mxfp4"}}])
    with pytest.raises(ConfigError, match=r"ablations\[0\]: the policy named 'mxfp4_all' "
                                          r"differs from the preset"):
        bad(ablations=[{**_mine(), "name": "mxfp4_all"}])
    with pytest.raises(ConfigError, match=r"two different policies are both named 'mine'"):
        bad(ablations=[_mine(), {**policies.to_dict("mxfp4_all"), "name": "mine"}])
    with pytest.raises(ConfigError, match=r"rungs\[1\]: policy: expected a preset name"):
        bad(rungs=["fp8", 3])
    with pytest.raises(ConfigError, match="seeds: at least 2") as e:
        bad(seeds=[0])
    assert "issue" not in str(e.value)
    with pytest.warns(DeprecationWarning, match="'wgrad_mx_h16' is now 'mxfp4_wgrad_only_h16'"):
        assert bad(ablations=["wgrad_mx_h16"]).ablations == ("mxfp4_wgrad_only_h16",)


# --------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def bench(tmp_path_factory, data_cache):
    """One width's compiled pieces (a train.run.CompiledRun, as the study builds them)."""
    cfg = SC.from_dict(_raw(tmp_path_factory.mktemp("study"), data_cache))
    return cfg, E.make_run(SC.run_config(cfg, cfg.width))


def _same_arrays(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_branches_are_paired_and_the_exact_branch_continues_the_reference(bench, tmp_path):
    _, b = bench
    saved = {}

    def save(k, state):
        if k == 4:
            ST.save_state(tmp_path / "s4", state, b, step=4)
            saved[k] = jax.device_get(state)

    ref = E.fixed_budget_run(b, "none", 0, 8, 4, save)
    assert saved and ref["skipped"] == 0 and [k for k, _ in ref["curve"]] == [0, 4, 8]
    # Saved through train.checkpoint (orbax) and restored onto the run's layout, bit for bit.
    _same_arrays(ST.load_state(tmp_path / "s4", b), saved[4])
    # A missing state (a branch point added later) is replayed to the same bits.
    E.replay_state(b, "none", 0, 4, tmp_path / "r4")
    _same_arrays(ST.load_state(tmp_path / "r4", b), saved[4])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r4", "s4"]  # no temporary left

    def go(policy, steps, batch_set=0, every=None):
        start = ST.load_state(tmp_path / "s4", b)
        return E.branch(b, policy, start, 0, 4, batch_set, steps, 2, every)

    exact = go("none", 4, every=2)
    # Set 0 continues the reference run's own batches and keys: bit-identical losses.
    np.testing.assert_array_equal(exact["train_loss"], ref["train_loss"][4:8])
    assert exact["curve"][2][1] == ref["curve"][2][1]  # the held-out loss at step 8
    rht = go("mxfp4_wgrad_only_rht16", 2)
    again = go("mxfp4_wgrad_only_rht16", 2)
    # Same batches and keys in every branch of the point (the digest), and a randomized
    # policy's noise is a function of (seed, step): re-running gives the same numbers.
    assert rht["batch_digest"] == exact["batch_digest"]
    assert rht["curve"] == again["curve"] and rht["train_loss"] == again["train_loss"]
    assert rht["curve"][-1][1] != exact["curve"][1][1]  # the rotation + MXFP4 changed it
    other = go("mxfp4_wgrad_only_rht16", 2, batch_set=1)
    assert other["batch_digest"] != rht["batch_digest"]
    # A policy defined in the study config runs by its name: the same policy, the same numbers.
    start = ST.load_state(tmp_path / "s4", b)
    mine = E.branch(b, "mine", start, 0, 4, 0, 2, 2, custom_policies={"mine": _mine()})
    assert mine["train_loss"] == rht["train_loss"] and mine["policy"] == "mine"


def test_load_state_refuses_another_layout(bench, tmp_path):
    _, b = bench
    ST.save_state(tmp_path / "bad", {"params": {"w": np.zeros((3,), np.float32)}}, b, step=1)
    with pytest.raises(IncompatibleCheckpointError, match="other state arrays than this run"):
        ST.load_state(tmp_path / "bad", b)
    wider = E.make_run(SC.run_config(bench[0], 48))  # another width: refused by its record
    ST.save_state(tmp_path / "w48", {"params": {"w": np.zeros((3,), np.float32)}}, wider, step=1)
    with pytest.raises(IncompatibleCheckpointError, match="does not match this model's layout"):
        ST.load_state(tmp_path / "w48", b)
    with pytest.raises(FileNotFoundError, match="no saved reference state"):
        ST.load_state(tmp_path / "missing", b)
    assert not (tmp_path / "missing").exists()


def test_unit_records_are_written_atomically(tmp_path):
    E.write_json(tmp_path / "a" / "r.json", {"x": 1.5})
    assert json.loads((tmp_path / "a" / "r.json").read_text()) == {"x": 1.5}
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["r.json"]


# --------------------------------------------------------------------------- report
def _branch_rec(policy, seed, point, curve, steps, digest="d"):
    return {"policy": policy, "seed": seed, "point": point, "batch_set": 0, "steps": steps,
            "curve": curve, "skipped": 0, "batch_digest": digest}


def test_branch_table_reads_each_policy_against_its_own_exact_curve():
    exact = [(0, 5.0), (2, 4.9), (4, 4.8)]
    reps = {}
    for seed, (pol_loss, base_loss) in enumerate([(4.95, 4.9), (4.9, 4.85)]):
        reps[(seed, 10, 0)] = {
            "none": _branch_rec("none", seed, 10, exact, 4),
            "p": _branch_rec("p", seed, 10, [(2, pol_loss)], 2),
            "fp8": _branch_rec("fp8", seed, 10, [(2, base_loss)], 2)}
    t = R.branch_table(reps, "none", "fp8", late_from=5)
    rows = t["replicates"]
    # seed 0: decrease 0.05 = 1 exact step of 2 -> efficiency 0.5; seed 1: 0.1 -> 1.0.
    assert [r["policies"]["p"]["efficiency"] for r in rows] == pytest.approx([0.5, 1.0])
    assert [r["policies"]["fp8"]["efficiency"] for r in rows] == pytest.approx([1.0, 1.5])
    all_p = t["table"]["p"]["all"]
    assert all_p["vs_exact"]["overhead"] == pytest.approx(np.sqrt(2.0) - 1)  # geometric mean
    assert all_p["vs_baseline"]["overhead"] == pytest.approx(np.sqrt(2.0 * 1.5) - 1)
    assert "early" not in t["table"]["p"] and t["table"]["p"]["late"]["n"] == 2
    assert all_p["loss_minus_exact"]["mean"] == pytest.approx((0.05 + 0.0) / 2)


def test_branch_table_refuses_unpaired_branches():
    reps = {(0, 10, 0): {"none": _branch_rec("none", 0, 10, [(0, 5.0), (2, 4.9)], 2),
                         "p": _branch_rec("p", 0, 10, [(2, 4.95)], 2, digest="other")}}
    with pytest.raises(ValueError, match="did not see the same batches"):
        R.branch_table(reps, "none", None, late_from=5)


def test_fixed_budget_tokens_are_read_off_the_baselines_curve():
    def run(policy, seed, final, curve=None):
        return {"policy": policy, "seed": seed, "steps": 100, "final_eval": final,
                "final_eval_own_forward": final, "skipped": 0,
                "curve": curve or [(0, 7.0), (100, final)]}

    base = [(0, 7.0), (50, 5.0), (100, 4.0)]
    runs = {"none": {s: run("none", s, 4.0, base) for s in (0, 1)},
            "p": {0: run("p", 0, 4.5), 1: run("p", 1, 4.5)}}
    t = R.fixed_budget_table(runs, "none", "none")
    # The reference reaches 4.5 at step 75: the policy needs 100/75 - 1 = 33% more tokens.
    tok = t["p"]["tokens_vs_reference"]
    assert tok["overhead"] == pytest.approx(100 / 75 - 1) and tok["censored"] == 0
    d = t["p"]["loss_vs_reference"]
    # Identical differences: a zero-width interval at +0.5, which excludes 0.
    assert d["mean"] == pytest.approx(0.5) and d["separated"] is True


@pytest.mark.slow
def test_report_end_to_end_on_a_tiny_study(tmp_path, data_cache, capsys):
    # Same steps as the `bench` fixture: the reference's programs come from the persistent
    # compilation cache.
    cfg = SC.from_dict(_raw(tmp_path, data_cache, rungs=["fp8"], ablations=[],
                            branch={"points": [4], "late_from": 5, "steps": 2,
                                    "exact_steps": 4, "exact_eval_every": 2}))
    rep = runner.run_study(cfg, verbose=True)
    # Each compilation is announced and timed; the estimate leaves it out
    err = capsys.readouterr().err.splitlines()
    for policy in ("none", "fp8"):
        i = next(i for i, ln in enumerate(err)
                 if ln.startswith(f"[study]   compiling the train step (policy {policy}, "))
        assert re.fullmatch(rf"\[study\]   train step \(policy {policy}\) compiled in "
                            r"\d+\.\d s", err[i + 1]), err[i:i + 2]
    done = [ln for ln in err if " units done, " in ln]
    assert all(re.search(r" min elapsed \(\d+ s compiling\), ~\d+ (s|min) of training left",
                         ln) for ln in done[:-1]), done
    assert done[-1].endswith(" s compiling)"), done
    assert set(rep["branch"]["table"]) == {"fp8"}
    for name in ("ladder.md", "ladder.json", "ladder_overhead.png", "ladder_curves.png"):
        assert (tmp_path / name).stat().st_size > 0
    text = (tmp_path / "ladder.md").read_text()
    assert "Branch-and-compare" in text and "`fp8`" in text
    # the run's backend, here the train config's default
    assert "quantized GEMMs on backend `auto` (each chip its fastest exact route)." in text
    # Resuming finds every unit done and trains nothing.
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.json") if "w32" in str(p)}
    runner.run_study(cfg, verbose=False)
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.json") if "w32" in str(p)}
    assert before == after


def test_study_help_lists_the_config_keys(capsys):
    from study.__main__ import main as study_main

    with pytest.raises(SystemExit) as e:
        study_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "config keys (set in the YAML file or with --set key=value):" in out
    for key in ("seeds (default (0, 1, 2, 3))", "branch: Branch-and-compare",
                "  exact_steps (default 48)", "scale: The scale trend", "run (default {})"):
        assert key in out, key


def test_study_out_that_is_a_file_is_a_config_error(tmp_path, capsys):
    from study.__main__ import main as study_main

    f = tmp_path / "a-file"
    f.write_text("not a directory")
    for out in (f, f / "sub"):
        assert study_main(["--config", "configs/ladder_tiny.yaml", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"config error: out_dir (--out) {out} "), err
        assert "a file, not a directory; choose another output directory" in err
    assert f.read_text() == "not a directory"


def test_seeds_needed_is_given_only_with_enough_seeds_and_replicates():
    fixed = {p: {"tokens_vs_reference": {"overhead": 0.1, "low": -0.9, "high": 1.1},
                 "final": {"n": n}} for p, n in (("few", 2), ("enough", 3))}
    branch = {p: {"all": {"n": 4, "vs_exact": {"overhead": 0.1, "low": 0.09, "high": 0.11}}}
              for p in ("few", "enough")}
    nz = R.noise_comparison(fixed, branch, ["few", "enough"])
    assert nz["few"]["seeds_needed"] is None  # 2 seeds: the widths are the t quantile's
    assert nz["enough"]["seeds_needed"] == pytest.approx(3 * 100.0 ** 2)


def test_a_small_studys_report_says_what_it_cannot_conclude(tmp_path, data_cache):
    cfg = SC.from_dict(_raw(tmp_path, data_cache, rungs=["fp8", "mxfp4_all"],
                            ablations=[], baseline="fp8"))
    fixed = {"tokens_vs_reference": {"overhead": 0.1, "low": -5.0, "high": 5.0},
             "final": {"n": 2}}
    rep = {"branch": {"table": {}}, "fixed_budget": {},
           "noise": R.noise_comparison(
               {"mxfp4_all": fixed},
               {"mxfp4_all": {"all": {"n": 2, "vs_exact": {"overhead": 0.1, "low": 0.0999,
                                                           "high": 0.1001}}}},
               ["mxfp4_all"]),
           "scale": {"32": {"n_params": None, "table": {}}}, "probe": None}
    text = R.render(rep, cfg)
    sections = text.split("\n## ")
    for title, why in (("Branch-and-compare", "no branch of a rung or ablation was paired"),
                       ("The paper's Table 1", "this study branched none of the paper's"),
                       ("Fixed-budget ladder", "no fixed-budget run has finished"),
                       ("How much less noisy", "'seeds needed' wants at least 3 seeds"),
                       ("Scale trend", "scale.widths is empty")):
        section = next(s for s in sections if s.startswith(title))
        assert f"_Nothing to conclude here: {why}" in section, (title, section)
    assert "| `mxfp4_all` |" in text and "n/a (2 seeds, 2 replicates)" in text
    assert "What each ablation changes" not in text  # no ablations, no heading


def test_an_unknown_rung_gets_did_you_mean(tmp_path, data_cache):
    """An unknown rung listed every known name (460 characters) and no guess."""
    with pytest.raises(ConfigError) as e:
        SC.from_dict(_raw(tmp_path, data_cache, rungs=["fp8", "mxfp4_al"], baseline="fp8"))
    msg = str(e.value)
    assert msg.startswith("rungs: unknown 'mxfp4_al' (did you mean 'mxfp4_all'")
    assert msg.endswith("; every name: study.policies.names() and custom_policies")
    with pytest.raises(ConfigError, match=r"^reference: unknown 'xyzzy'; known: fp8, "):
        SC.from_dict(_raw(tmp_path, data_cache, reference="xyzzy"))


def test_a_backend_a_policy_cannot_use_is_a_config_error_before_training(tmp_path, data_cache):
    """``run: backend: xla_fp8`` crashed with a traceback when the fp8 baseline compiled,
    after the reference runs had trained; a backend without a speed-up on this CPU trained."""
    def cfg(backend, **top):
        raw = _raw(tmp_path, data_cache, **top)
        raw["run"] = {**raw["run"], "backend": backend}
        return SC.from_dict(raw)

    with pytest.raises(ConfigError, match=r"^policy 'fp8' on run\.backend 'xla_fp8': policy\."
                       r"fprop\.backend: backend 'xla_fp8' implements MXFP4 x MXFP4 only, "):
        runner.check_backends(cfg("xla_fp8"))
    mx = {"rungs": ["mxfp4_all"], "baseline": "mxfp4_all", "ablations": []}
    with pytest.raises(ConfigError, match=r"^policy 'mxfp4_all' on run\.backend 'xla_fp4': "
                       r"policy\.fprop\.backend: backend 'xla_fp4' gives no speed-up on 'cpu'"):
        runner.check_backends(cfg("xla_fp4", **mx))
    runner.check_backends(cfg("auto"))
    runner.check_backends(cfg("xla", **mx))
