"""``python -m train --check`` (train/check.py): the memory estimate from the config alone,
for hardware the host lacks, with the smallest fitting fsdp; the data as a finding of its
own; and what the run would refuse in --out's checkpoints, with the run's message and exit
code."""

from __future__ import annotations

import dataclasses
import json

import pytest

import mxjax
from models.llama import LlamaConfig
from tests.train.data.stream_testutil import grain_sets, write_shards
from tests.train.train_testutil import ROOT, fast_sets
from train import memory
from train.__main__ import main
from train.devices import CHIPS

# The schedule of test_train_loop's base run: the same train step, served by the compile cache.
SCHEDULE = "optim.decay_steps=12"
MLPERF = str(ROOT / "configs/llama3_8b_mlperf.yaml")


def _args(out, cache, *extra):
    return [a for s in fast_sets(out, cache, SCHEDULE, *extra) for a in ("--set", s)]


def _check(capsys, argv) -> tuple[int, dict, list[str]]:
    code = main(["--check", "--quiet", *argv])
    cap = capsys.readouterr()
    return code, json.loads(cap.out), [ln for ln in cap.err.splitlines() if ln.strip()]


# --------------------------------------------------------------------------- memory
def test_8b_check_without_c4_prints_the_estimate_for_8_h100s(tmp_path, capsys):
    """A fresh clone has no C4 and no Llama tokenizer: the estimate comes first, the missing
    data is a finding of its own (exit 2), and 8 H100s are asked about from a CPU host."""
    code, out, err = _check(capsys, ["--config", MLPERF, "--devices", "8", "--chip", "h100",
                                     "--out", str(tmp_path / "run")])
    assert code == 2
    assert out["devices"] == {"count": 8, "chip": "h100", "platform": "gpu"}
    assert out["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    m = out["memory_per_device"]
    assert m["n_params"] == 8_030_261_248 and m["attention"] == "fused" and m["remat"]
    assert m["sequences_per_device"] == 2 and 30 < m["total_gib"] < 59
    assert out["device_memory"].startswith("NVIDIA H100 80GB HBM3: 79.65 GiB")
    assert out["fits"] is True
    assert out["smallest_fsdp"].startswith("the smallest mesh.fsdp that fits is 8 ")
    # what backend auto becomes on an H100, without the data
    assert [out["routes"][g] for g in ("fprop", "dgrad", "wgrad")] == ["xla_fp8"] * 3
    assert err == [("config error: data.sources: no file matches "
                   "'c4/en/3.0.1/c4-train.*-of-01024.json.gz'")]
    assert out["problems"] == err and out["ok"] is False


def test_fused_attention_stores_no_scores_on_a_gpu():
    mc = LlamaConfig.llama3_8b(attention_impl="fused", dtype="bfloat16", param_dtype="float32")
    kw = {"seq_len": 8192, "micro_batch": 8, "accum_steps": 1, "mesh": (1, 8, 1)}
    fused = memory.estimate(mc, platform="gpu", **kw)
    on_cpu = memory.estimate(mc, platform="cpu", **kw)  # the explicit form runs there
    explicit = memory.estimate(LlamaConfig.llama3_8b(dtype="bfloat16", param_dtype="float32"),
                               platform="gpu", **kw)
    assert fused.fused_attention and not on_cpu.fused_attention
    assert on_cpu.activations == explicit.activations
    # per token and layer: fp32 scores + bf16 probabilities of 32 heads x 8192 keys, against
    # one fp32 softmax statistic per head
    saved = 8192 * 32 * 32 * (8192 * (4 + 2) - 4)
    assert explicit.activations_no_remat - fused.activations_no_remat == saved
    assert fused.describe().count("fused attention") == 1


def test_the_smallest_fitting_fsdp_is_a_number_at_any_sequence_length():
    mc = LlamaConfig.llama3_8b(attention_impl="fused", remat=True, dtype="bfloat16",
                               param_dtype="float32")
    h100 = int(CHIPS["h100"].bytes * 0.75)
    shape = memory.StepShape(model=mc, seq_len=8192, global_batch=16, micro_batch=16,
                             mesh=(1, 1, 1), platform="gpu")
    ans = memory.smallest_fsdp(shape, h100)
    assert ans is not None and ans.fsdp == 8 and ans.micro_batch == 16
    smaller = memory.smallest_fsdp(shape, ans.estimate.total - 1)
    assert smaller.fsdp == 16  # just under that estimate, 8 no longer fits
    # long sequences: one per device, past the micro-batch (which must grow with it)
    long = memory.StepShape(model=dataclasses.replace(mc, max_seq_len=32768), seq_len=32768,
                            global_batch=1, micro_batch=1, mesh=(1, 1, 1), platform="gpu")
    ans = memory.smallest_fsdp(long, int(CHIPS["b200"].bytes * 0.75))  # 181 GiB on one B200
    assert ans is not None and ans.fsdp == ans.micro_batch == 2
    assert ans.settings(long) == ("--set mesh.fsdp=2 --set mesh.data=1 --set "
                                  "train.micro_batch=2 --set train.global_batch=2")
    # when one sequence alone is too much, the answer names the longest that fits
    tiny_budget = 40 * 2**30
    assert memory.smallest_fsdp(long, tiny_budget) is None
    text = memory.fsdp_sentence(long, tiny_budget)
    longest = memory.longest_sequence(long, tiny_budget)
    assert 128 <= longest < 32768 and longest % 128 == 0
    assert text.startswith("no mesh.fsdp fits") and f"data.seq_len that fits is {longest}" in text
    # a step that fits one device says so in the singular (it said '1 devices')
    assert memory.fsdp_sentence(long, 2**50).startswith(
        "the smallest mesh.fsdp that fits is 1 (1 device: --set mesh.fsdp=1 ")


def test_a_config_that_does_not_fit_names_the_fsdp_that_would(tmp_path, capsys):
    code, out, err = _check(capsys, ["--config", MLPERF, "--devices", "2", "--chip", "h100",
                                     "--out", str(tmp_path / "run")])
    assert code == 2 and out["fits"] is False
    assert len(err) == 2 and err[0].startswith("config error: data.sources")
    assert err[1].startswith("config error: memory: the train step needs about ")
    assert "the smallest mesh.fsdp that fits is 8 (8 devices: --set mesh.fsdp=8" in err[1]


@pytest.mark.parametrize(("argv", "message"), [
    (["--check", "--chip", "h999"], "config error: --chip 'h999': unknown chip; known: h100, "),
    (["--check", "--devices", "0"], "config error: --devices 0: give a device count of 1"),
    (["--devices", "8"], "config error: --devices and --chip ask --check about other "),
    # --print-config once printed the config, --chip ignored, and exited 0
    (["--print-config", "--chip", "h100"], "config error: --devices and --chip ask --check "),
])
def test_bad_devices_or_chip_is_one_line(tmp_path, capsys, argv, message):
    assert main([*argv, "--config", MLPERF, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1


def test_fits_is_null_when_the_devices_memory_is_unknown(tmp_path, capsys, monkeypatch):
    """A device whose memory JAX does not report (no memory_stats) gives no budget: the
    report said "fits": true all the same."""
    from train import devices

    monkeypatch.setattr(devices, "device_memory", lambda: (None, "unknown: no memory_stats"))
    code, out, _ = _check(capsys, ["--config", MLPERF, "--out", str(tmp_path / "run")])
    assert code == 2  # the missing C4, nothing about memory
    assert out["fits"] is None and out["device_memory"] == "unknown: no memory_stats"
    assert "smallest_fsdp" not in out


@pytest.mark.parametrize("fraction", ["0", "1.5", "nan", "-0.5"])
def test_a_memory_fraction_outside_0_1_is_one_line(tmp_path, capsys, monkeypatch, fraction):
    """A GPU chip's budget is its memory times XLA_PYTHON_CLIENT_MEM_FRACTION: one outside
    (0, 1] once gave a budget of 0 bytes, 1.5x the chip's or NaN, without a word."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
    argv = ["--check", "--chip", "h100", "--config", MLPERF, "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"config error: XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r} is not a "
                   "fraction of the GPU's memory in (0, 1]; unset it or give one such as 0.9")


def test_a_tokenizer_larger_than_the_model_is_named_as_such(tmp_path, data_cache, capsys):
    """The stream's check compares the tokenizer's size with the model's vocabulary; the
    message says so (it once said 'token id N occurs', N being the tokenizer's size)."""
    data = write_shards(tmp_path / "c4")
    sets = [*fast_sets(tmp_path / "run", data_cache), *grain_sets(data),
            ("model.overrides={dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 128, "
            "max_seq_len: 128, vocab_size: 300}")]
    code, _, err = _check(capsys, [a for s in sets for a in ("--set", s)])
    assert code == 2
    assert err == [(f"config error: data.tokenizer {data['tokenizer']} has 512 token ids (0 to "
                   "511), more than the model's vocab_size=300: use a tokenizer of at most 300 "
                   "ids, or set model.overrides.vocab_size=512")]


def test_a_mesh_that_cuts_quantization_blocks_is_refused(tmp_path, data_cache, capsys):
    """fsdp=4 leaves 16 of the model's 64 embedding rows per device, half an MXFP4 block:
    the check names each weight, its axis and the GEMM that blocks along it (exit 2): the
    run's own validation (`train.plan.validate`), before anything compiles; FP8 (one scale
    per tensor) takes the same mesh."""
    sets = fast_sets(tmp_path / "run", data_cache, "mesh.fsdp=4", "policy=mxfp4_all_h16")
    argv = [a for s in sets for a in ("--set", s)] + ["--devices", "4", "--chip", "h100"]
    code, out, err = _check(capsys, argv)
    assert code == 2 and out["ok"] is False
    assert err[0] == ("config error: mesh (data=1, fsdp=4, tensor=1) under policy "
                      "'mxfp4_all_h16': shards would cut quantization blocks, so operands "
                      "would be gathered in bf16 before quantizing:")
    err = [line.strip() for line in err]
    assert ("layers.gate_proj.kernel: axis 1 (64 over mesh axes ('fsdp',): 16 per device) is "
            "fprop's contraction, quantized in blocks of 32; 16 is not a multiple of 32") in err
    assert ("layers.down_proj.kernel: axis 2 (64 over mesh axes ('fsdp',): 16 per device) is "
            "dgrad's contraction, quantized in blocks of 32; 16 is not a multiple of 32") in err
    assert not any("lm_head" in line for line in err)  # the head stays in bf16
    code, out, err = _check(capsys, [*argv[:-4], "--set", "policy=fp8", *argv[-4:]])
    assert code == 0 and err == [], err


# --------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
    """A finished two-step run (make train's config, made small), its directory and args."""
    out = tmp_path_factory.mktemp("trained") / "run"
    args = ["--config", str(ROOT / "configs/tiny.yaml"),
            *_args(out, data_cache, "train.steps=2", "checkpoint.every=2")]
    assert main(["--quiet", *args]) == 0
    return out, args


@pytest.mark.parametrize("change", [
    ["--set", "train.steps=300", "--set", "optim.lr=1e-3"],  # the README's command
    ["--policy", "fp8"],
])
def test_check_refuses_what_the_run_refuses(trained, capsys, change):
    _out, args = trained
    code, report, err = _check(capsys, [*args, *change])
    assert code == 4 and report["ok"] is False and report["fits"] is True
    assert err[0].startswith("checkpoint error: the checkpoints in ")
    assert main(["--quiet", *args, *change]) == 4  # the run: the same lines, the same code
    run_err = [ln for ln in capsys.readouterr().err.splitlines()
               if ln.strip() and not ln.startswith("[train] note:")]
    assert run_err == err
    assert report["problems"] == ["\n".join(err)]


def test_check_names_the_step_a_compatible_run_resumes(trained, capsys):
    _out, args = trained
    code, report, err = _check(capsys, [*args, "--set", "train.steps=4"])
    assert (code, err, report["ok"], report["resumes_from_step"]) == (0, [], True, 2)


def test_check_names_each_gemms_route_here_and_on_the_chip_asked_about(trained, capsys,
                                                                        tmp_path):
    """`backend: auto` is the emulation on this CPU and the FP4 units on a B200: --check says
    which, per GEMM, for the chip it is asked about."""
    _out, args = trained
    args = [*args, "--set", "policy=mxfp4_all_h16", "--set", f"out_dir={tmp_path / 'new'}"]
    _, here, _ = _check(capsys, args)
    _, b200, _ = _check(capsys, [*args, "--chip", "b200"])
    gemms = ("fprop", "dgrad", "wgrad")
    assert here["routes"]["backend"] == b200["routes"]["backend"] == "auto"
    assert [here["routes"][g] for g in gemms] == ["xla"] * 3
    assert "B200" in b200["routes"]["chip"]
    assert [b200["routes"][g] for g in gemms] == ["xla_fp4"] * 3


def test_an_explicit_backend_is_judged_on_the_chip_asked_about(trained, capsys, tmp_path):
    """`backend: xla_fp4` gives no speed-up on this CPU (the run refuses it, exit 2) but is
    the FP4 units of a B200: --check --chip b200 judges it there, not on the host."""
    _out, args = trained
    args = [*args, "--set", "policy=mxfp4_all", "--set", "backend=xla_fp4",
            "--set", f"out_dir={tmp_path / 'new'}"]
    code, here, err = _check(capsys, args)
    assert code == 2 and here["ok"] is False and "gives no speed-up on 'cpu'" in err[0]
    code, b200, err = _check(capsys, [*args, "--chip", "b200"])
    assert (code, err, b200["ok"]) == (0, [], True)
    assert [b200["routes"][g] for g in ("fprop", "dgrad", "wgrad")] == ["xla_fp4"] * 3


# --------------------------------------------------------------------------- the run dir
def _foreign_files(out):
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")  # a run's file name, no .run.lock beside it


def _checkpoints_file(out):
    out.mkdir()
    (out / "checkpoints").write_text("not a directory")


def _out_is_a_file(out):
    out.write_text("not a directory")


@pytest.mark.parametrize(("setup", "code", "start"), [
    (_foreign_files, 5, "output directory error: output directory {out} holds metrics.jsonl"),
    (_checkpoints_file, 5, "output directory error: {out}/checkpoints is a file, where "),
    # the run said 'output directory ... cannot be created (File exists)', exit 5
    (_out_is_a_file, 2, "config error: out_dir (--out) {out} is a file, not a directory"),
])
def test_check_refuses_the_output_directory_the_run_refuses(tmp_path, data_cache, capsys,
                                                            setup, code, start):
    """--check said "ok": true for an --out the run refuses at once."""
    out = tmp_path / "run"
    setup(out)
    args = _args(out, data_cache, "train.steps=2")
    got, report, err = _check(capsys, args)
    assert got == code and report["ok"] is False, err
    assert err[0].startswith(start.format(out=out)), err
    assert main(["--quiet", *args]) == code  # the run: the same first line, the same code
    run_err = [ln for ln in capsys.readouterr().err.splitlines()
               if ln.strip() and not ln.startswith("[train] note:")]
    assert run_err == err[:1]
    assert not (out / ".run.lock").exists()  # neither created anything


def test_check_of_a_directory_it_cannot_write(trained, monkeypatch):
    """Not writable: the run's message (exit 5); unless the run there has nothing left to
    do, which the run then only reports."""
    from train import check as check_mod
    from train import run_lock
    from train.config import load

    out, args = trained
    assert args[0] == "--config" and set(args[2::2]) == {"--set"}
    cfg = load(args[1], args[3::2])
    monkeypatch.setattr(run_lock.os, "access", lambda *a, **k: False)
    assert check_mod._run_dir(cfg) is None  # finished: two steps of two
    more = load(args[1], [*args[3::2], "train.steps=3"])
    finding = check_mod._run_dir(more)
    assert finding.exit_code == 5 and finding.line.startswith(
        f"output directory error: output directory {out} is not writable by this user")


def test_a_quantized_head_and_its_tied_table_are_held_to_the_blocks_too(tmp_path):
    """Under ``quantize_embed_head`` the embedding table is a GEMM's [V, D] weight and, tied,
    the head's [D, V] one: 400 vocabulary rows over tensor=8 leave 50 per device."""
    from train import config as config_mod
    from train.config import ConfigError
    from train.plan import check_mesh_blocks

    cfg = config_mod.load(None, fast_sets(tmp_path / "run", tmp_path / "data"))
    policy = mxjax.policies.get("mxfp4_all")
    mc = LlamaConfig.tiny(vocab_size=400, quantize_embed_head=True, tie_embeddings=True)
    with pytest.raises(ConfigError) as err:
        check_mesh_blocks(policy, cfg, mc, (1, 1, 8))
    lines = [line.strip() for line in str(err.value).splitlines()]
    assert ("embed_tokens.embedding: axis 0 (400 over mesh axes ('tensor',): 50 per device) "
            "is fprop's contraction, quantized in blocks of 32; 50 is not a multiple of 32"
            ) in lines
    assert any(line.startswith("embed_tokens.embedding (as the head): axis 1 (400 over mesh "
                               "axes ('tensor',): 50 per device) is dgrad's") for line in lines)
    assert any(line.startswith("layers.k_proj.kernel: axis 2 (64 over") for line in lines)
    with pytest.raises(ConfigError) as err:  # the head unquantized: only the layers' kernel
        check_mesh_blocks(policy, cfg, mc.replace(quantize_embed_head=False), (1, 1, 8))
    assert "embed_tokens" not in str(err.value) and "k_proj" in str(err.value)
    check_mesh_blocks(None, cfg, mc, (1, 1, 8))  # nothing quantized: any mesh
