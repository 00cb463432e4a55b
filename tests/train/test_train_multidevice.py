"""The train step under a (data=2, fsdp=4) mesh of 8 fake CPU devices equals one device.

Runs in a subprocess with 8 fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)
(this pytest process has already initialised JAX with one device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.train.train_testutil import ROOT, xla_flags

_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    assert jax.device_count() == 8, jax.devices()
    from train import loop
    from train.output.metrics import read_jsonl
    from tests.train.train_testutil import load

    tmp, cache = sys.argv[1], sys.argv[2]
    out = {}
    for name, mesh in (("one", (1, 1, 1)), ("dp2_fsdp4", (2, 4, 1))):
        cfg = load(f"{tmp}/{name}", cache, "train.steps=3", "train.eval_at_start=false",
                   f"mesh.data={mesh[0]}", f"mesh.fsdp={mesh[1]}", f"mesh.tensor={mesh[2]}",
                   "checkpoint.enabled=false", "train.plot=false")
        s = loop.run(cfg, verbose=False)
        recs = read_jsonl(f"{tmp}/{name}/metrics.jsonl")
        out[name] = {"losses": [r["loss"] for r in recs], "eval": s.final_eval_loss,
                     "grad_norms": [r["grad_norm"] for r in recs]}
    # the sharded run really was sharded: parameters split over fsdp
    tr = loop.Trainer(loop.validate(cfg, verbose=False), None, False)
    spec = tr.layout.param_shardings["layers"]["gate_proj"]["kernel"].spec
    out["gate_spec"] = [str(s) for s in spec]
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.long
def test_data2_fsdp4_matches_single_device(tmp_path, data_cache):
    env = dict(os.environ, XLA_FLAGS=xla_flags(8),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "train")]))
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path), str(data_cache)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    one, sh = res["one"], res["dp2_fsdp4"]
    assert len(one["losses"]) == len(sh["losses"]) == 3
    for a, b in zip(one["losses"], sh["losses"]):
        assert abs(a - b) <= 1e-5, (one["losses"], sh["losses"])
    for a, b in zip(one["grad_norms"], sh["grad_norms"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a))
    assert abs(one["eval"] - sh["eval"]) <= 1e-5
    assert res["gate_spec"][1] == "fsdp"  # the embed dim of the kernel is split 4 ways


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_device(tmp_path):
    """Real multi-host path: 2 processes x 4 CPU devices, jax.distributed via --distributed,
    each process feeding its half of every batch; losses equal a 1-device run."""
    from tests.train.train_testutil import fast_sets, run_cli
    from train.output.metrics import read_jsonl

    common = ["train.steps=3", "train.eval_at_start=false", "checkpoint.every=2"]
    r = run_cli(["--quiet", *[a for s in fast_sets(tmp_path / "one", tmp_path / "data", *common)
                              for a in ("--set", s)]], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    port = _free_port()
    sets = fast_sets(tmp_path / "two", tmp_path / "data", *common, "mesh.data=2", "mesh.fsdp=4",
                     f"mesh.coordinator_address=localhost:{port}", "mesh.num_processes=2")
    env = dict(os.environ, XLA_FLAGS=xla_flags(4),
               PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "train", "--quiet", "--distributed",
         *[a for s in [*sets, f"mesh.process_id={i}"] for a in ("--set", s)]],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-3000:]
    assert "status: completed" in outs[0][0]
    one = read_jsonl(tmp_path / "one" / "metrics.jsonl")
    two = read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert [x["step"] for x in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (one, two)
    assert abs(one[-1]["eval_loss"] - two[-1]["eval_loss"]) <= 1e-5
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()
                  if p.name.isdigit()) == ["2", "3"]
