"""Runs <-> Hugging Face: ``python -m train export-hf``,
``model.init_from`` and ``python -m train mlperf-check`` on a trained run.

One 2-layer run of one step (checkpointed) is shared by the module: it is exported; the
export is imported back (bitwise-equal parameters and logits) and starts a second run
whose step-0 eval loss equals the first run's final one; that run resumes from its own
checkpoint with the HF directory gone. The logits of transformers' ``LlamaForCausalLM``
on an export are compared when torch and transformers are importable (they are not in the
project's venv; tests/models/test_llama_hf.py holds the stored-reference parity).
"""

from __future__ import annotations

import json
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import hf as mhf
from models.llama import Llama
from tests.train.train_testutil import ROOT, load
from train import hf as thf
from train import loop
from train.__main__ import main
from train.checkpoint import Checkpointer, IncompatibleCheckpointError, flatten
from train.config import ConfigError
from train.run import CompiledRun

FIXTURE = ROOT / "tests" / "models" / "data" / "hf_tiny_llama"


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("hfrun") / "a"
    cfg = load(out, data_cache, "train.steps=1", "train.eval_at_start=false")
    summary = loop.run(cfg, verbose=False)
    assert summary.status == "completed" and summary.steps == 1
    return cfg, summary


@pytest.fixture(scope="module")
def exported(run_a, tmp_path_factory):
    cfg, _ = run_a
    out = tmp_path_factory.mktemp("hfexport") / "hf"
    assert main(["export-hf", str(cfg.out_path), str(out)]) == 0
    return out


def _checkpoint_params(run_dir, step):
    """{dotted param key: array} restored straight from the run's checkpoint."""
    with Checkpointer(run_dir / "checkpoints", keep=1, async_save=False, read_only=True) as ck:
        meta = ck.read_meta(step)
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        like = {k: jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d), sharding=dev)
                for k, (s, d) in meta["arrays"].items()}
        flat = ck.restore(step, like, meta)
    return meta, {k[len("params."):]: np.asarray(v) for k, v in flat.items()
                  if k.startswith("params.")}


def _params(model):
    flat, _ = flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {k: np.asarray(v) for k, v in flat.items()}


def test_export_files_and_bitwise_round_trip(run_a, exported):
    cfg, _ = run_a
    names = sorted(p.name for p in exported.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]
    meta, ck = _checkpoint_params(cfg.out_path, 1)
    model, layout = mhf.load_hf(str(exported))
    mc = thf.model_config_from_meta(meta)
    # the architecture is the run's (max_seq_len is a bound the HF config states above
    # the llama3 scaling's original context: see models.hf_config.hf_max_position_embeddings)
    for k in thf.ARCHITECTURE_FIELDS:
        assert getattr(model.config, k) == getattr(mc, k), k
    got = _params(model)
    assert sorted(got) == sorted(ck)
    for k in ck:
        assert got[k].dtype == np.float32 and got[k].tobytes() == ck[k].tobytes(), k
    # logits: the imported model against the run's model with the checkpoint's params
    ref = nnx.eval_shape(lambda: Llama(mc, rngs=nnx.Rngs(0)))
    st = nnx.state(ref, nnx.Param)
    nnx.replace_by_pure_dict(st, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    nnx.update(ref, st)
    toks = jnp.asarray(np.arange(40, dtype=np.int32)[None] * 7 % mc.vocab_size)
    fwd = nnx.jit(lambda m, t: m(t))
    assert np.asarray(fwd(model, toks)).tobytes() == np.asarray(fwd(ref, toks)).tobytes()
    hfc = json.loads((exported / "config.json").read_text())
    rs = hfc["rope_scaling"]
    assert rs["original_max_position_embeddings"] < hfc["max_position_embeddings"]
    assert hfc["eos_token_id"] == 0 and "bos_token_id" not in hfc  # the BPE's <|endoftext|>
    gen = json.loads((exported / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 0
    tc = json.loads((exported / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|endoftext|>"
    assert layout.generation_config == gen


def test_export_leaves_a_live_runs_save_alone(run_a, tmp_path):
    """The temporary directory of a save in progress (a live run's) survives an export;
    orbax's manager, opened to write, deletes it."""
    cfg, _ = run_a
    tmp = cfg.out_path / "checkpoints" / "5.orbax-checkpoint-tmp-1796000000"
    tmp.mkdir()
    (tmp / "partial").write_text("x")
    try:
        assert thf.export_run(cfg.out_path, tmp_path / "hf").step == 1
        assert (tmp / "partial").is_file()
        Checkpointer(cfg.out_path / "checkpoints", keep=3, async_save=False).close()
        # What a writing manager does (so the check above can fail); orbax may remove it
        # from a background thread, so give it a few seconds.
        deadline = time.monotonic() + 10
        while tmp.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not tmp.exists()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_export_without_the_prepared_data_says_so(tmp_path):
    """A BPE run whose prepared data is gone (or a run whose data record names no prepared
    directory) exports no tokenizer, and the note says how to get one."""
    for fp in ("ab" * 32, {"stream": "settings"}):
        meta = {"config": {"data": {"cache_dir": str(tmp_path), "tokenizer": "bpe"}},
                "compat": {"data": {"fingerprint": fp}}}
        why = thf._run_tokenizer(meta)
        assert isinstance(why, str) and why.startswith("not exported") and "prepare" in why


def test_transformers_logits_of_an_export(exported):
    """Only where torch and transformers are importable (not the project's venv)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, _ = mhf.load_hf(str(exported))
    ids = np.arange(40, dtype=np.int64)[None] * 7 % model.config.vocab_size
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(exported), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        theirs = m(torch.tensor(ids)).logits.numpy()
    assert float(np.abs(theirs - ours).max()) <= 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert tok.eos_token == "<|endoftext|>"


def test_export_errors_are_one_line(run_a, exported, tmp_path, capsys):
    cfg, _ = run_a
    capsys.readouterr()
    cases = [
        ([str(tmp_path / "nope"), str(tmp_path / "o1")], "no run directory"),
        ([str(cfg.out_path), str(tmp_path / "o2"), "--step", "7"],
         "has no checkpoint of step 7; it has steps 1"),
        ([str(cfg.out_path), str(exported)], ("is not empty; choose a new directory, or pass "
                                             "--force")),
        ([str(cfg.out_path), str(cfg.out_path / "config.yaml")], "is a file"),
        ([str(tmp_path), str(tmp_path / "o3")], "holds no checkpoints"),
    ]
    for args, want in cases:
        assert main(["export-hf", *args]) == 2, args
        err = capsys.readouterr().err
        assert want in err and "Traceback" not in err, (args, err)
        assert err.startswith("export-hf: ") and err.count("\n") == 1, err
    assert not (tmp_path / "o2").exists()
    # --force replaces the checkpoint in a non-empty directory (bf16 this time)
    again = tmp_path / "again"
    shutil.copytree(exported, again)
    assert main(["export-hf", str(cfg.out_path), str(again), "--force", "--dtype",
                 "bfloat16"]) == 0
    _, lay = mhf.load_hf(str(again))
    assert set(lay.dtypes.values()) == {"bfloat16"}


def test_init_from_checks_the_architecture(run_a, data_cache, tmp_path, capsys):
    """The fixture (vocab 128, FFN 160, theta 1e4, original context 64) against the run's
    model: every differing field is named, with both values."""
    cfg = load(tmp_path / "b", data_cache, f"model.init_from={FIXTURE}")
    with pytest.raises(ConfigError) as e:
        loop.validate(cfg, verbose=False)
    msg = str(e.value)
    for field, hf_value, run_value in (("vocab_size", 128, 512), ("ffn_dim", 160, 128),
                                       ("rope_theta", 10000.0, 500000.0)):
        assert f"{field}: checkpoint {hf_value!r}, run {run_value!r}" in msg, msg
    assert "rope_scaling: checkpoint" in msg and "original_max_position_embeddings" in msg
    for same in ("dim:", "n_layers:", "n_heads:", "n_kv_heads:", "head_dim:", "norm_eps:"):
        assert f"  {same}" not in msg, msg
    assert "model.overrides" in msg and "data.tokenizer" in msg
    # through the command line: a config error, exit 2, no traceback
    capsys.readouterr()
    rc = main(["--check", "--set", f"model.init_from={FIXTURE}", "--out", str(tmp_path / "b"),
               *[f"--set={s}" for s in _fast(tmp_path / "b", data_cache)]])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("config error: model.init_from") and "Traceback" not in err
    with pytest.raises(ConfigError, match="no config.json"):
        loop.validate(load(tmp_path / "c", data_cache, f"model.init_from={tmp_path}"),
                      verbose=False)


def _fast(out, cache):
    from tests.train.train_testutil import fast_sets

    return fast_sets(out, cache)


@pytest.mark.slow
def test_init_from_an_export_then_resume_without_it(run_a, exported, data_cache, tmp_path):
    cfg_a, sum_a = run_a
    hf_dir = tmp_path / "hf"
    shutil.copytree(exported, hf_dir)
    cfg = load(tmp_path / "b", data_cache, "train.steps=1", "optim.decay_steps=4",
               f"model.init_from={hf_dir}")
    # the fresh state: the export's parameters, bit for bit, and a fresh optimizer
    compiled = CompiledRun(loop.validate(cfg, verbose=False))
    state = compiled.init_state(cfg.seed)
    _, ck = _checkpoint_params(cfg_a.out_path, 1)
    got, _ = flatten(state["params"])
    assert all(np.asarray(got[k]).tobytes() == ck[k].tobytes() for k in ck)
    assert int(state["step"]) == 0
    moments = [np.asarray(x) for x in jax.tree.leaves(state["opt"]) if np.ndim(x) > 0]
    assert moments and all(not m.any() for m in moments)
    # bf16 weights on disk become exactly their fp32 values
    b16 = tmp_path / "b16"
    assert main(["export-hf", str(cfg_a.out_path), str(b16), "--dtype", "bfloat16"]) == 0
    p16, _ = flatten(thf.load_init_params(str(b16), compiled.plan.model_config, compiled.mesh,
                                          compiled.layout.param_shardings))
    for k in ck:
        want = ck[k].astype(jnp.bfloat16).astype(np.float32)
        assert np.asarray(p16[k]).dtype == np.float32
        assert np.asarray(p16[k]).tobytes() == want.tobytes(), k
    del compiled, state
    # the run: its eval before step 1 is run A's final eval (same weights, same data)
    s1 = loop.run(cfg, verbose=False)
    assert s1.status == "completed" and s1.resumed_from is None
    assert s1.eval_history[0][0] == 0 and s1.eval_history[0][2] == sum_a.eval_history[-1][2]
    # resumed from its own checkpoint: the HF directory is not read again
    shutil.rmtree(hf_dir)
    s2 = loop.run(load(tmp_path / "b", data_cache, "train.steps=2", "optim.decay_steps=4",
                       f"model.init_from={hf_dir}"), verbose=False)
    assert s2.status == "completed" and s2.resumed_from == 1 and s2.steps == 2
    # another init_from on that run directory is another run: refused
    with pytest.raises(IncompatibleCheckpointError, match="init_from"):
        loop.run(load(tmp_path / "b", data_cache, "train.steps=3", "optim.decay_steps=4",
                      f"model.init_from={exported}"), verbose=False)


def test_mlperf_check_on_a_trained_run(run_a, tmp_path, capsys):
    """The README's compliance command on a run that is no MLPerf benchmark: the log's
    structure passes, the llama31_8b rules it cannot meet are listed, exit 0. A log with a
    record missing fails (exit 3)."""
    cfg, _ = run_a
    capsys.readouterr()
    assert main(["mlperf-check", str(cfg.out_path)]) == 0
    out = capsys.readouterr().out
    assert "benchmark 'run' is no MLPerf benchmark: checked as llama31_8b" in out
    assert "max_sequence_length: logged 64; rule: v['value'] == 8192" in out
    assert "eval_samples: logged 16" in out
    assert out.rstrip().endswith("PASSED (log structure, record order and required records)")
    broken = tmp_path / "mllog.txt"
    broken.write_text("".join(line for line in (cfg.out_path / "mllog.txt").read_text()
                              .splitlines(keepends=True) if '"key": "run_start"' not in line))
    assert main(["mlperf-check", str(broken)]) == 3
    out = capsys.readouterr().out
    assert "FAILED" in out and out.rstrip().endswith("FAILED (log structure, record order and "
                                                     "required records)")
    assert main(["mlperf-check", str(tmp_path / "none")]) == 2
    assert "no MLPerf log at" in capsys.readouterr().err
