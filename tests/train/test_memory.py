"""The memory estimate (train/memory.py): against XLA's buffer assignment
on CPU, in --check (parameter count, estimate, exit 2 with what would fit), and an out of
memory at run time (exit 9, one message, the last checkpoint intact and resumable)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from tests.train.train_testutil import MODEL, fast_sets, load, run_cli
from train import memory
from train import plan as planmod
from train.__main__ import main
from train.checkpoint import Checkpointer
from train.hooks import Hooks
from train.process import use_compile_cache
from train.run import CompiledRun
from train.step import policy_base_key

# The estimate against compiled.memory_analysis() stays within this factor either way
# (measured on the runs below: 0.87 without remat, 1.26 with remat; 0.83-0.92 for a longer
# sequence, a larger batch or gradient accumulation).
FACTOR = 1.5

# The schedule of test_train_loop's base run: the same train step, served by the compile cache.
SCHEDULE = "optim.decay_steps=12"


def _xla_bytes(plan, run: CompiledRun) -> int:
    c = plan.config
    batch = jax.ShapeDtypeStruct((c.train.global_batch, c.data.seq_len + 1), jnp.int32,
                                 sharding=run.layout.batch)
    compiled = run.train_step(plan.policy).lower(run.abstract, batch,
                                                 policy_base_key(0)).compile()
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


@pytest.mark.parametrize("remat", [False, True])
def test_estimate_is_within_a_factor_of_xla(tmp_path, data_cache, remat):
    model = MODEL[:-1] + ", remat: true}" if remat else MODEL
    cfg = load(tmp_path / "run", data_cache, SCHEDULE, f"model.overrides={model}")
    use_compile_cache(cfg.jax_cache_dir)  # as a run does: the no-remat step is the base run's
    plan = planmod.validate(cfg, verbose=False)
    est = memory.for_plan(plan)
    assert est.remat is remat
    run = CompiledRun(plan)
    assert est.n_params == run.n_params  # the exact count
    xla = _xla_bytes(plan, run)
    assert xla / FACTOR <= est.total <= xla * FACTOR, (est.as_dict(), xla)


def test_estimate_follows_the_mesh_and_the_micro_batch():
    from models.llama import LlamaConfig

    mc = LlamaConfig.tiny(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_dim=128, max_seq_len=128)
    one = memory.estimate(mc, seq_len=64, micro_batch=8, accum_steps=1, mesh=(1, 1, 1))
    fsdp = memory.estimate(mc, seq_len=64, micro_batch=8, accum_steps=1, mesh=(1, 4, 1))
    data = memory.estimate(mc, seq_len=64, micro_batch=8, accum_steps=1, mesh=(4, 1, 1))
    norms = (2 * mc.n_layers + 1) * mc.dim * 4  # replicated
    assert fsdp.params - norms == (one.params - norms) // 4
    assert fsdp.optimizer == 2 * fsdp.params and data.params == one.params
    assert fsdp.activations == data.activations == one.activations // 4
    accum = memory.estimate(mc, seq_len=64, micro_batch=4, accum_steps=2, mesh=(1, 1, 1))
    assert accum.gradients == 2 * one.gradients and accum.activations == one.activations // 2
    assert one.activations_remat < one.activations_no_remat == one.activations


def test_what_fits_names_settings_that_fit():
    from models.llama import LlamaConfig

    mc = LlamaConfig.tiny(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_dim=128, max_seq_len=128)
    full = memory.estimate(mc, seq_len=64, micro_batch=16, accum_steps=1, mesh=(2, 1, 1))
    fits = memory.what_fits(mc, seq_len=64, global_batch=16, micro_batch=16, mesh=(2, 1, 1),
                            budget=int(full.total * 0.8))
    assert "model.overrides.remat=true" in fits
    micro = [f for f in fits if f.startswith("train.micro_batch=")]
    assert micro and int(micro[0].split("=")[1].split()[0]) < 16
    for f in fits:  # each one does fit
        sets = dict(x.split("=") for x in f.split())
        m = memory.estimate(
            LlamaConfig.tiny(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=128, max_seq_len=128,
                             remat=sets.get("model.overrides.remat") == "true"),
            seq_len=64, micro_batch=int(sets.get("train.micro_batch", 16)),
            accum_steps=16 // int(sets.get("train.micro_batch", 16)),
            mesh=(int(sets.get("mesh.data", 2)), int(sets.get("mesh.fsdp", 1)), 1))
        assert m.total <= full.total * 0.8, f


def _args(out, cache, *extra):
    return [a for s in fast_sets(out, cache, SCHEDULE, *extra) for a in ("--set", s)]


def test_check_prints_the_estimate(tmp_path, data_cache, capsys):
    assert main(["--check", "--quiet", *_args(tmp_path / "run", data_cache)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["fits"] and out["n_params"] == 139584
    m = out["memory_per_device"]
    assert m["params_bytes"] == 4 * 139584 and m["optimizer_bytes"] == 8 * 139584
    assert m["total_bytes"] > m["params_bytes"] + m["optimizer_bytes"] + m["gradients_bytes"]
    assert out["device_memory"].startswith("CPU: ")


def test_check_refuses_a_model_that_does_not_fit(tmp_path, data_cache, capsys):
    args = _args(tmp_path / "run", data_cache, f"model.overrides={HUGE}")
    assert main(["--check", "--quiet", *args]) == 2
    cap = capsys.readouterr()
    assert json.loads(cap.out)["ok"] is False
    err = cap.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("config error: memory: the train step needs about ")
    assert "more than a device has (CPU: " in err
    assert "nothing fits" in err or "would fit: --set " in err


def test_out_of_memory_is_exit_9_and_the_checkpoint_survives(tmp_path, data_cache, capsys):
    """An out of memory (XLA's error, injected after the checkpoint of step 2) ends the run
    with one message and exit 9; the same command resumes from that checkpoint."""
    from train import loop

    out = tmp_path / "run"
    cfg = load(out, data_cache, SCHEDULE, "train.steps=4", "checkpoint.every=2",
               "checkpoint.async_save=true")

    def oom_at_3(rec):
        if rec["step"] == 3:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory allocating 3221225472 bytes.")

    with pytest.raises(memory.RunOutOfMemory) as e:
        loop.run(cfg, hooks=Hooks(on_record=oom_at_3), verbose=False)
    msg = str(e.value)
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert msg.startswith("out of device memory (RESOURCE_EXHAUSTED: Out of memory allocating")
    assert "Estimate: about " in msg and "per device" in msg
    assert msg.endswith(f"The checkpoint of step 2 in {out}/checkpoints is intact: the same "
                        "command resumes from it once the settings fit.")
    with Checkpointer(out / "checkpoints", keep=3) as ck:
        assert ck.steps() == [2]
    s = loop.run(cfg, verbose=False)
    assert s.status == "completed" and s.resumed_from == 2 and s.steps == 4


# Every stacked weight of this model is over 200 GB: allocating any fails at once (a CPU
# host's allocator refuses it; nothing is written), so the run ends in XLA's real
# RESOURCE_EXHAUSTED when the fresh state is allocated.
HUGE = "{dim: 16384, n_layers: 200, n_heads: 128, n_kv_heads: 128, ffn_dim: 53248}"


@pytest.mark.slow  # ~16 s: a fresh process compiles the init and the step of a huge model
def test_cli_out_of_memory_is_one_line_and_exit_9(tmp_path, data_cache):
    """XLA's real out of memory in the CLI: one line, exit 9, no traceback (neither the
    error's nor, at exit, tensorboardX's)."""
    out = tmp_path / "run"
    r = run_cli(["--quiet", "--set", "train.eval_at_start=false",
                 *_args(out, data_cache, f"model.overrides={HUGE}", "train.steps=2")])
    assert r.returncode == 9, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("out of memory: out of device memory (")
    assert "Out of memory allocating" in lines[0]
    assert "Estimate: about " in lines[0] and "device: CPU: " in lines[0]
    assert lines[0].endswith("No checkpoint was written before it: the same command starts over.")


def _fake_cgroup(tmp_path, proc_line, files):
    """A /proc/self/cgroup holding `proc_line` and a cgroup mount holding `files`
    ({relative path: text})."""
    from train.memory import CgroupFiles

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc_cgroup").write_text(proc_line + "\n")
    for rel, text in files.items():
        (tmp_path / "fs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / rel).write_text(text)
    return CgroupFiles(proc_self=tmp_path / "proc_cgroup", root=tmp_path / "fs")


def test_a_memory_cgroup_below_the_hosts_memory_is_the_budget(tmp_path):
    """Issue 45 (UNCLEAR): in a 3 GiB cgroup (v2 memory.max), --check's device memory is what
    the cgroup still allows (its reclaimable page cache counted as free), not the host's."""
    gb = 2**30
    cg = _fake_cgroup(tmp_path, "0::/user.slice/run.scope", {
        "cgroup.controllers": "memory",
        "user.slice/memory.max": "max",
        "user.slice/run.scope/memory.max": str(3 * gb),
        "user.slice/run.scope/memory.current": str(gb + gb // 2),
        "user.slice/run.scope/memory.stat": f"anon 1\ninactive_file {gb // 2}\n"})
    lim = memory.cgroup_limit(cg)
    assert lim is not None and lim.available == 2 * gb and lim.limit == 3 * gb
    assert lim.file == tmp_path / "fs" / "user.slice/run.scope/memory.max"
    n = len(jax.local_devices(backend="cpu"))
    budget, source = memory.device_memory(cgroup=cg)
    assert budget == 2 * gb // n
    assert source.startswith("CPU: 2.00 GiB available under the memory cgroup limit of 3.00 GiB")
    assert str(lim.file) in source


def test_cgroup_v1_limit_and_no_limit(tmp_path):
    """cgroup v1 (memory.limit_in_bytes, a parent's limit the tighter) and an unlimited
    cgroup (the host's memory stays the budget)."""
    gb = 2**30
    cg = _fake_cgroup(tmp_path / "v1", "4:memory:/jobs/42", {
        "memory/memory.limit_in_bytes": "9223372036854771712",
        "memory/jobs/memory.limit_in_bytes": str(4 * gb),
        "memory/jobs/memory.usage_in_bytes": str(3 * gb),
        "memory/jobs/42/memory.limit_in_bytes": str(8 * gb),
        "memory/jobs/42/memory.usage_in_bytes": str(gb)})
    lim = memory.cgroup_limit(cg)
    assert lim.available == gb and lim.limit == 4 * gb and lim.file.parent.name == "jobs"
    free = _fake_cgroup(tmp_path / "free", "0::/", {"cgroup.controllers": "memory"})
    assert memory.cgroup_limit(free) is None
    assert memory.device_memory(cgroup=free)[1].startswith("CPU: ")
    assert "cgroup" not in memory.device_memory(cgroup=free)[1]
