"""Config parsing and validation: every error is reported, named, before compiling."""

from __future__ import annotations

import dataclasses

import pytest

from tests.train.train_testutil import MODEL, ROOT, fast_sets, run_cli
from train import config as C
from train import loop, optimizer
from train import plan as plan_mod
from train.config import ConfigError


@pytest.fixture(scope="module")
def cache(data_cache):
    return data_cache


def test_tiny_yaml_parses_with_documented_defaults():
    cfg = C.load(ROOT / "configs" / "tiny.yaml")
    assert cfg.name == "tiny"
    assert cfg.policy == "mxfp4_all_h16"
    assert cfg.data.sources == ("embedded:austen",)
    assert cfg.data.tokenizer == "bpe"
    assert cfg.model.preset == "tiny"
    o = cfg.optim
    assert (o.b1, o.b2, o.eps, o.weight_decay, o.clip_norm, o.final_lr_ratio) == \
        (0.9, 0.95, 1e-5, 0.1, 1.0, 0.1)


def test_unknown_keys_are_named():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\): trian"):
        C.from_dict({"trian": {"steps": 3}})
    with pytest.raises(ConfigError, match=r"section 'train'.*stepz"):
        C.from_dict({"train": {"stepz": 3}})


@pytest.mark.parametrize("raw, msg", [
    ({"train": {"steps": "ten"}}, r"train\.steps: expected an integer, got str 'ten'"),
    ({"train": {"steps": 2.5}}, r"train\.steps: expected an integer"),
    ({"optim": {"lr": "fast"}}, r"optim\.lr: expected a number"),
    ({"checkpoint": {"enabled": "yes please"}}, r"checkpoint\.enabled: expected true/false"),
    ({"data": {"sources": 3}}, r"data\.sources: expected a list"),
    ({"model": {"compute_dtype": "int8"}}, r"model\.compute_dtype: must be one of"),
    ({"model": 5}, r"model: expected a mapping"),
    ({"policy": 3}, r"policy: expected str \| mapping \| null"),
])
def test_wrong_types_are_named(raw, msg):
    with pytest.raises(ConfigError, match=msg):
        C.from_dict(raw)


@pytest.mark.parametrize("raw, msg", [
    ({"train": {"global_batch": 8, "micro_batch": 3}}, r"micro_batch \(3\) must divide"),
    ({"train": {"steps": 0}}, r"train\.steps must be >= 1"),
    ({"optim": {"decay_steps": 0}}, r"optim\.decay_steps must be >= 1"),
    ({"mesh": {"data": -1, "fsdp": -1}}, r"at most one axis may be -1"),
    ({"data": {"seq_len": 1}}, r"data\.seq_len must be >= 2"),
    ({"mesh": {"num_processes": 2, "process_id": 2}}, r"mesh\.process_id must be in"),
])
def test_bad_values(raw, msg):
    with pytest.raises(ConfigError, match=msg):
        C.from_dict(raw)


def test_overrides_parse_yaml_values_and_nest():
    cfg = C.load(None, ["train.steps=7", "optim.lr=3e-4", "policy=fp8",
                        f"model.overrides={MODEL}", "model.overrides.n_layers=3",
                        "train.progress=off", "data.sources=[a.txt, b.txt]"])
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.policy == "fp8"
    assert cfg.model.overrides["n_layers"] == 3 and cfg.model.overrides["dim"] == 64
    assert cfg.train.progress == "off"  # YAML 1.1 reads `off` as false; mapped back
    assert cfg.data.sources == ("a.txt", "b.txt")
    with pytest.raises(ConfigError, match="expects key=value"):
        C.load(None, ["train.steps"])
    with pytest.raises(ConfigError, match="'steps' is not a section"):
        C.load(None, ["train.steps=3", "train.steps.x=1"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        C.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        C.load(bad)


def test_to_dict_round_trips():
    cfg = C.load(ROOT / "configs" / "tiny.yaml", ["train.steps=9"])
    assert C.from_dict(cfg.to_dict()) == cfg


def test_describe_lists_every_key():
    text = C.describe()
    for section in (C.ModelSection, C.DataSection, C.OptimSection, C.TrainSection,
                    C.CheckpointSection, C.MeshSection):
        for f in dataclasses.fields(section):
            assert f"  {f.name} (" in text, f.name


# ---------------------------------------------------------------- validate (before compiling)

def test_validate_accepts_fast_config(tmp_path, cache):
    plan = loop.validate(C.load(None, fast_sets(tmp_path / "run", cache)), verbose=False)
    assert plan.policy_name == "passthrough"
    assert plan.model_config.vocab_size == plan.prepared.vocab_size == 512
    assert plan.mesh_axes == (1, 1, 1)


@pytest.mark.parametrize("extra, msg", [
    (["data.sources=[/nonexistent/corpus.txt]"], r"data\.sources: file not found"),
    (["data.sources=['/nonexistent/c4-*.json.gz']"], r"no file matches"),
    (["data.tokenizer=/nonexistent/tokenizer.json"], r"data\.tokenizer: file not found"),
    (["policy=mxfp5_magic"], r"unknown preset 'mxfp5_magic'; did you mean 'mxfp4_all'\?"),
    (["policy={fprop: 1}"], r"policy: invalid policy dict"),
    (["data.seq_len=256"], (r"data\.seq_len=256 is longer than the model supports "
                            r"\(max_seq_len=128")),
    (["model.overrides.n_layerz=2"], r"unknown LlamaConfig field\(s\) n_layerz"),
    (["model.overrides.dtype=bfloat16"], r"use model\.compute_dtype"),
    (["model.overrides.n_kv_heads=3"], r"model: .*multiple of n_kv_heads"),
    (["model.overrides.vocab_size=100"], (r"vocab_size=100 is too small for the data: token id "
                                          r"\d+ occurs")),
    (["mesh.data=4"], r"mesh: .* 4 devices, only 1 available"),
    (["train.eval_sequences=100000"], r"validation split has only \d+ sequences"),
    (["train.eval_sequences=12"], r"multiple of the eval batch \(8\)"),
])
def test_validate_reports_errors(tmp_path, cache, extra, msg):
    cfg = C.load(None, fast_sets(tmp_path / "run", cache, *extra))
    with pytest.raises(ConfigError, match=msg):
        loop.validate(cfg, verbose=False)


def test_policy_by_full_dict(tmp_path, cache):
    from mxjax import policies

    d = policies.to_dict(policies.get("mxfp4_all_sr"))
    d["name"] = "my_sr"
    cfg = C.from_dict({**C.load(None, fast_sets(tmp_path, cache)).to_dict(), "policy": d})
    plan = loop.validate(cfg, verbose=False)
    assert plan.policy == policies.from_dict(d)
    assert plan.policy.needs_key
    assert plan.policy_name == "my_sr"


@pytest.mark.slow
def test_cli_reports_config_errors_before_compiling(tmp_path, cache):
    out = tmp_path / "run"
    sets = []
    for s in fast_sets(out, cache, "data.seq_len=4096"):
        sets += ["--set", s]
    r = run_cli(["--config", "configs/tiny.yaml", *sets], timeout=120)
    assert r.returncode == 2, r.stderr
    assert "config error: data.seq_len=4096 is longer than the model supports" in r.stderr
    assert not (out / "checkpoints").exists()
    r = run_cli(["--config", "configs/tiny.yaml", "--policy", "nope", "--out", str(out)])
    assert r.returncode == 2 and "unknown preset 'nope'" in r.stderr
    r = run_cli(["--config", str(tmp_path / "missing.yaml")])
    assert r.returncode == 2 and "config file not found" in r.stderr


def test_cli_help_documents_everything():
    r = run_cli(["--help"], timeout=60)
    assert r.returncode == 0
    for word in ("--config", "--policy", "--set", "--out", "--distributed", "metrics.jsonl",
                 "plot.png", "checkpoints/", "exit codes", "eval_every", "target_eval_loss",
                 "max_nonfinite", "jax_cache_dir", "micro_batch"):
        assert word in r.stdout, word


# ---------------------------------------------------------------- the MLPerf config

def test_mlperf_config_is_the_real_setting():
    from models.llama import Llama, LlamaConfig, param_count

    cfg = C.load(ROOT / "configs" / "llama3_8b_mlperf.yaml")
    assert cfg.data.seq_len == 8192
    assert cfg.backend == "auto"  # the chip's FP8/FP4 units
    assert cfg.data.tokenizer.endswith("tokenizer.json")
    assert any("c4-train." in s and "-of-01024.json.gz" in s for s in cfg.data.sources)
    assert cfg.data.val_sources
    o, t = cfg.optim, cfg.train
    assert (o.lr, o.b1, o.b2, o.eps, o.weight_decay, o.clip_norm) == \
        (4e-4, 0.9, 0.95, 1e-5, 0.1, 1.0)
    assert (o.final_lr_ratio, cfg.decay_steps) == (0.1, 1_200_000)
    assert t.global_batch == 16 and t.target_eval_loss == 3.3
    assert t.eval_every * t.global_batch == 12_288 and t.eval_sequences == 1024
    assert cfg.model.compute_dtype == "bfloat16"
    mc = plan_mod.build_model_config(cfg, 128256)
    ref = LlamaConfig.llama3_8b()
    for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim",
              "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings"):
        assert getattr(mc, f) == getattr(ref, f), f
    assert str(mc.param_dtype) == "float32"
    assert cfg.data.seq_len <= mc.max_seq_len
    assert param_count(mc) == 8_030_261_248
    # the train state's shapes without allocating: params + AdamW moments
    from flax import nnx
    abstract = nnx.eval_shape(lambda: Llama(mc, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    assert params["embed_tokens"]["embedding"].shape == (128256, 4096)
    assert params["layers"]["gate_proj"]["kernel"].shape == (32, 4096, 14336)
    tx, _ = optimizer.make_optimizer(cfg)
    import jax
    opt = jax.eval_shape(tx.init, params)
    n_opt = sum(x.size for x in jax.tree.leaves(opt) if x.ndim > 0)
    assert n_opt == 2 * 8_030_261_248
    assert plan_mod.resolve_mesh(cfg, 8) == (1, 8, 1)


def test_fp32_master_weights_with_bf16_compute(tmp_path, cache):
    import jax
    import numpy as np

    cfg = C.load(None, fast_sets(tmp_path / "run", cache, "model.compute_dtype=bfloat16"))
    plan = loop.validate(cfg, verbose=False)
    assert np.dtype(plan.model_config.dtype) == np.dtype("bfloat16")
    assert np.dtype(plan.model_config.param_dtype) == np.dtype("float32")
    tr = loop.Trainer(plan, verbose=False)  # builds abstract state only, compiles nothing
    dtypes = {str(x.dtype) for x in jax.tree.leaves(tr.abs_state["params"])}
    assert dtypes == {"float32"}
    moments = [x for x in jax.tree.leaves(tr.abs_state["opt"]) if x.ndim > 0]
    assert moments and {str(x.dtype) for x in moments} == {"float32"}


@pytest.mark.parametrize("key", ["optim.lr", "optim.eps", "train.target_eval_loss",
                                 "optim.clip_norm"])
@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan", "inf", "nan"])
def test_non_finite_numbers_are_refused_naming_the_key(key, text):
    # optim.lr=.inf fails --check
    with pytest.raises(ConfigError, match=rf"{key}: expected a finite number, got"):
        C.load(None, [f"{key}={text}"])


def test_tilde_paths_are_expanded(tmp_path, monkeypatch):
    # out_dir=~/runs/x expands ~, not a directory literally named '~'
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = C.load(None, ["out_dir=~/runs/x", "jax_cache_dir=~/jax", "data.cache_dir=~/dc",
                        "data.tokenizer=~/tok.json", "data.sources=[~/a.txt, 'embedded:austen']",
                        "data.val_sources=~/v/*.txt"])
    home = str(tmp_path)
    assert str(cfg.out_path) == f"{home}/runs/x"
    assert (cfg.jax_cache_dir, cfg.data.cache_dir, cfg.data.tokenizer) == (
        f"{home}/jax", f"{home}/dc", f"{home}/tok.json")
    assert cfg.data.sources == (f"{home}/a.txt", "embedded:austen")
    assert cfg.data.val_sources == (f"{home}/v/*.txt",)
    assert C.load(None, []).data.tokenizer == "bpe"
    (tmp_path / "c.yaml").write_text("name: tilde\n")
    assert C.load("~/c.yaml").name == "tilde"


def test_policy_backend_that_cannot_run_here_is_a_config_error():
    # backend: triton on CPU fails --check, not at trace time
    from mxjax import policies

    d = policies.to_dict("mxfp4_all")
    d["wgrad"]["backend"] = "triton"
    with pytest.raises(ConfigError, match=r"policy\.wgrad\.backend: backend 'triton' cannot run "
                                          r"on 'cpu'"):
        plan_mod.resolve_policy(d)
    d = policies.to_dict("fp8")
    d["fprop"]["backend"] = "xla_fp8"
    with pytest.raises(ConfigError, match=r"policy\.fprop\.backend: .*MXFP4 x MXFP4 only"):
        plan_mod.resolve_policy(d)
    d = policies.to_dict("mxfp4_all")
    d["fprop"]["backend"] = "auto"  # picks what runs here
    assert plan_mod.resolve_policy(d)[0] is not None
