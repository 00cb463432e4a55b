"""Kill -9 mid-training, restart with the same command: bit-identical to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.train.train_testutil import ROOT, fast_sets, run_cli
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


@pytest.mark.parametrize("policy", [
    pytest.param("bf16", marks=pytest.mark.long),
    # a randomized policy: its per-step keys must resume too (slower to compile)
    pytest.param("mxfp4_all_sr", marks=pytest.mark.slow),
])
def test_sigkill_and_restart_is_bit_identical(tmp_path, data_cache, policy):
    cache, jcache = data_cache, data_cache / "jax"
    a, b = tmp_path / "a", tmp_path / "b"
    r = run_cli(_args(a, cache, jcache, policy), timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    for line in ("status: completed", "final eval loss: ", f"metrics: {a}/metrics.jsonl",
                 f"plot: {a}/plot.png", f"checkpoints: {a}/checkpoints"):
        assert line in r.stdout, r.stdout

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen([sys.executable, "-m", "train", *_args(b, cache, jcache, policy)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    killed_at = None
    while time.time() < deadline and proc.poll() is None:
        recs = read_jsonl(b / "metrics.jsonl") if (b / "metrics.jsonl").exists() else []
        ckpts = [p for p in (b / "checkpoints").glob("*") if p.name.isdigit()] if recs else []
        if recs and recs[-1]["step"] >= 10 and ckpts:
            # mid-training, after at least one committed checkpoint (others may be in flight)
            proc.send_signal(signal.SIGKILL)
            killed_at = recs[-1]["step"]
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert killed_at is not None and killed_at < STEPS, \
        f"run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    assert proc.returncode == -signal.SIGKILL
    with Checkpointer(b / "checkpoints", keep=2) as ck:
        assert ck.latest_step() in (4, 8, 12, 16, 20) and ck.latest_step() < killed_at

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
