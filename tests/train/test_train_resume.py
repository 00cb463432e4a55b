"""SIGTERM (preemption), then kill -9, mid-training; each time the same command resumes, and the
result is bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.train.train_testutil import ROOT, fast_sets, run_cli, xla_flags
from train.checkpoint import Checkpointer
from train.output.metrics import read_jsonl

STEPS = 24


def _args(out, cache, jcache, policy) -> list[str]:
    sets = fast_sets(out, cache, f"train.steps={STEPS}", "train.eval_every=8",
                     "checkpoint.every=4", "checkpoint.keep=2", f"jax_cache_dir={jcache}",
                     f"policy={policy}")
    args = ["--quiet"]
    for s in sets:
        args += ["--set", s]
    return args


def _final_state(out):
    with Checkpointer(out / "checkpoints", keep=2) as ck:
        step = ck.latest_step()
        meta = ck.read_meta(step)
        # restore without a template: read the arrays as saved
        from orbax import checkpoint as ocp
        state = ck.mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return step, meta, {k: np.asarray(v) for k, v in dict(state["state"]).items()}


def _spawn(out, cache, jcache, policy) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags())
    return subprocess.Popen([sys.executable, "-m", "train", *_args(out, cache, jcache, policy)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _signal_when(proc, out, sig, ready) -> int:
    """Send `sig` once ``ready(last metrics step, committed checkpoint steps)``; the step."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        recs = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
        ckpts = [int(p.name) for p in (out / "checkpoints").glob("*") if p.name.isdigit()] \
            if recs else []
        if recs and ready(recs[-1]["step"], ckpts):
            proc.send_signal(sig)
            return recs[-1]["step"]
        time.sleep(0.01)
    raise AssertionError(f"the run ended before it could be signalled: "
                         f"{proc.communicate()[1][-2000:]}")


# Both under `make test-slow` (five CLI runs, 60-95 s on 2 cores). The default run keeps a
# SIGTERM's joint checkpoint (tests/train/test_two_process_resume.py) and a mid-run stop,
# save and resume (tests/train/test_run_faults.py).
@pytest.mark.parametrize("policy", [
    pytest.param("passthrough", marks=pytest.mark.slow),
    # a randomized policy: its per-step keys must resume too (slower to compile)
    pytest.param("mxfp4_all_sr", marks=pytest.mark.slow),
])
def test_sigterm_sigkill_and_restart_are_bit_identical(tmp_path, data_cache, policy):
    cache, jcache = data_cache, data_cache / "jax"
    a, b = tmp_path / "a", tmp_path / "b"
    r = run_cli(_args(a, cache, jcache, policy), timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    for line in ("status: completed", "final eval loss: ", f"metrics: {a}/metrics.jsonl",
                 f"plot: {a}/plot.png", f"checkpoints: {a}/checkpoints"):
        assert line in r.stdout, r.stdout

    # 1. SIGTERM mid-run (a scheduler's preemption): the step finishes, a checkpoint of it is
    # saved although no checkpoint.every boundary is due, metrics and summary are written
    # (status preempted), exit code 75.
    proc = _spawn(b, cache, jcache, policy)
    stopped_at = _signal_when(proc, b, signal.SIGTERM, lambda step, ckpts: step >= 3)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "status: preempted (preempted by SIGTERM after step " in out, out
    recs = read_jsonl(b / "metrics.jsonl")
    k = recs[-1]["step"]
    assert stopped_at <= k < STEPS
    with Checkpointer(b / "checkpoints", keep=2) as ck:
        # saved at the stop, unless the step's regular checkpoint (every 4) already held it
        assert ck.latest_step() == k
        assert ck.read_meta(k)["status"] == ("running" if k % 4 == 0 else "preempted")
    summary = json.loads((b / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["steps"] == k

    # 2. the same command resumes from step k; SIGKILL it once a later checkpoint exists
    proc = _spawn(b, cache, jcache, policy)
    killed_at = _signal_when(proc, b, signal.SIGKILL,
                             lambda step, ckpts: step >= 10 and max(ckpts, default=0) > k)
    proc.wait(timeout=60)
    assert killed_at < STEPS
    assert proc.returncode == -signal.SIGKILL
    with Checkpointer(b / "checkpoints", keep=2) as ck:
        assert ck.latest_step() in (4, 8, 12, 16, 20) and k < ck.latest_step() < killed_at

    r = run_cli(_args(b, cache, jcache, policy), timeout=400)  # the same command again
    assert r.returncode == 0, r.stderr[-3000:]

    ra, rb = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert [x["step"] for x in rb] == list(range(STEPS + 1))
    for x, y in zip(ra, rb):
        assert (x["loss"], x["eval_loss"], x["grad_norm"], x["lr"]) == \
            (y["loss"], y["eval_loss"], y["grad_norm"], y["lr"]), x["step"]
    sa, ma, fa = _final_state(a)
    sb, mb, fb = _final_state(b)
    assert sa == sb == STEPS and ma["status"] == mb["status"] == "completed"
    assert set(fa) == set(fb)
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and np.array_equal(fa[k], fb[k]), k
    assert jax.tree.leaves(fa)  # something was compared
