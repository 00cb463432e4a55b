"""The ladder study's units of work, run in-process: fixed-budget runs and branches.

One `train.run.CompiledRun` per model width (`make_run`) holds the compiled
pieces (train and eval steps per policy, the data, the fresh init), so the
hundreds of short runs of a study share compilations. Two kinds of unit, each a
pure function of the config and its arguments that returns a JSON-able record:

- `fixed_budget_run`: a policy trains ``steps`` steps from the seed's fresh
  init on the seed's batch stream, evaluated on the fixed held-out set every
  ``eval_every`` steps. The reference policy's runs also save their full state
  (parameters and optimizer) at the branch points (`study.states`).
- `branch`: from a saved reference state, a policy trains K steps on a batch
  stream and keys that every policy of that branch shares (the record holds
  their SHA-256, so pairing can be checked), and its held-out loss is
  evaluated; the exact (reference) branch runs longer and is evaluated on a
  grid, giving the curve the others are read against.

Held-out losses are computed with the exact forward (no policy), so a branch
measures what the weights learned, not how a quantized forward scores them;
the fixed-budget runs also record the final loss under their own forward.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from models import sharding as shd
from study import policies as study_policies
from study.states import save_state
from train.config import Config
from train.plan import validate
from train.process import fetch, use_compile_cache
from train.run import CompiledRun
from train.step import policy_base_key

# Batch set j > 0 of a branch draws its own shuffle: the seed's stream, offset by this.
BATCH_SET_STRIDE = 7919
EXACT_EVAL_BASE = 0  # the seed of the (unused) key of the exact forward's evaluations


def batch_stream_seed(seed: int, batch_set: int) -> int:
    """The loader seed of a branch's batch set (set 0 continues the reference run's stream)."""
    return seed if batch_set == 0 else seed + BATCH_SET_STRIDE * batch_set


def write_json(path: Path, obj: Any) -> None:
    """Writes `obj` as JSON atomically (a crash leaves the old file or none, never half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, allow_nan=True))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def make_run(config: Config) -> CompiledRun:
    """The compiled pieces of one width's runs (`config`'s policy is not used: every unit
    names its own)."""
    use_compile_cache(config.jax_cache_dir)
    return CompiledRun(validate(config, verbose=False))


def exact_eval(run: CompiledRun, params: Any) -> float:
    """Mean token cross-entropy on the held-out set under the exact forward (no policy)."""
    return run.evaluate(params, None, policy_base_key(EXACT_EVAL_BASE))


# --------------------------------------------------------------------------- units
def _digest_start(seed: int, first_step: int, count: int):
    """SHA-256 of what a branch consumes, fed batch by batch: the seed, its step indices and
    key, then its first `count` batches."""
    h = hashlib.sha256()
    h.update(np.asarray([seed, first_step, count], np.int64).tobytes())
    h.update(np.asarray(jax.random.key_data(policy_base_key(seed))).tobytes())
    return h


Log = Callable[[str], None]


def _train(run: CompiledRun, policy: str, state: Any, batch_at: Callable[[int], np.ndarray],
           steps: int, seed: int, eval_at: Callable[[int], bool], *, first_step: int = 0,
           digest_steps: int = 0, on_step: Callable[[int, Any], None] | None = None,
           custom_policies: Mapping[str, Any] | None = None, log: Log | None = None):
    """Trains `state` for `steps` steps on ``batch_at(k)`` (read one at a time, so a long run
    holds one batch on the host); returns (state, per-step losses, [(k, exact eval)], digest of
    the first `digest_steps` batches, seconds spent compiling the train step: nonzero only
    when this call compiled it, which `log` announces before and after). `policy` is a study
    policy name (`custom_policies`: the config's inline ones)."""
    pol = study_policies.get(policy, custom_policies)
    compiles = not run.has_train_step(pol)
    step_fn = run.train_step(pol)
    compile_s = 0.0
    base = policy_base_key(seed)
    digest = _digest_start(seed, first_step, digest_steps)
    losses, curve = [], []
    with shd.use_mesh(run.mesh):
        for k in range(steps):
            if eval_at(k):
                curve.append((k, exact_eval(run, state["params"])))
            if on_step is not None:
                on_step(k, state)
            b = batch_at(k)
            if k < digest_steps:
                digest.update(np.ascontiguousarray(b).tobytes())
            if compiles and k == 0:
                if log is not None:
                    log(f"compiling the train step (policy {policy}, {run.n_params / 1e6:.2f}M "
                        "params) ...")
                tc = time.time()
            state, m = step_fn(state, run.put(b), base)
            if compiles and k == 0:
                compile_s = time.time() - tc
                if log is not None:
                    log(f"train step (policy {policy}) compiled in {compile_s:.1f} s")
            losses.append(m["loss"])
    if eval_at(steps):
        curve.append((steps, exact_eval(run, state["params"])))
    losses = [float(x) for x in fetch(losses)]
    return state, losses, curve, digest.hexdigest(), compile_s


def fixed_budget_run(run: CompiledRun, policy: str, seed: int, steps: int, eval_every: int,
                     save: Callable[[int, Any], None] | None = None, *,
                     custom_policies: Mapping[str, Any] | None = None,
                     log: Log | None = None) -> dict[str, Any]:
    """One run of the fixed-budget ladder (see the module docstring); `log` announces a
    compilation of the train step (its seconds are the record's ``compile_s``)."""
    t0 = time.time()
    state = run.init_state(seed)
    loader = run.loader(seed)
    state, losses, curve, digest, compile_s = _train(
        run, policy, state, loader.batch, steps, seed,
        lambda k: k % eval_every == 0 or k == steps, digest_steps=steps, on_step=save,
        custom_policies=custom_policies, log=log)
    own = run.evaluate(state["params"], study_policies.get(policy, custom_policies),
                       policy_base_key(seed))
    return {"kind": "run", "policy": policy, "seed": seed, "steps": steps,
            "tokens_per_step": run.tokens_per_step,
            "curve": curve, "final_eval": curve[-1][1], "final_eval_own_forward": own,
            "train_loss": losses, "skipped": int(fetch(state["skipped"])),
            "batch_digest": digest, "wall_s": round(time.time() - t0, 2),
            "compile_s": round(compile_s, 2)}


def replay_state(run: CompiledRun, policy: str, seed: int, point: int, path: Path, *,
                 custom_policies: Mapping[str, Any] | None = None,
                 log: Log | None = None) -> None:
    """Re-creates a reference state missing from `path` by replaying the reference run's
    first `point` steps (the same init, batches and keys, so the same state) and saves it."""
    state = run.init_state(seed)
    state, _, _, _, _ = _train(run, policy, state, run.loader(seed).batch, point, seed,
                               lambda k: False, custom_policies=custom_policies, log=log)
    save_state(path, state, run, step=point)


def branch(run: CompiledRun, policy: str, start: Any, seed: int, point: int, batch_set: int,
           steps: int, pair_steps: int, eval_every: int | None = None, *,
           custom_policies: Mapping[str, Any] | None = None,
           log: Log | None = None) -> dict[str, Any]:
    """One branch: `steps` steps of `policy` from the reference state `start` at `point`.

    With `eval_every` (the exact branch) the held-out loss is evaluated every
    `eval_every` steps from 0; otherwise only after the last step. `start` is
    consumed (its buffers are donated). ``batch_digest`` covers the first
    `pair_steps` steps, the part every branch of the point shares.
    """
    t0 = time.time()
    loader = run.loader(batch_stream_seed(seed, batch_set))
    every = eval_every or steps
    state, losses, curve, digest, compile_s = _train(
        run, policy, start, lambda k: loader.batch(point + k), steps, seed,
        lambda k: k % every == 0 if eval_every else k == steps, first_step=point,
        digest_steps=pair_steps, custom_policies=custom_policies, log=log)
    return {"kind": "branch", "policy": policy, "seed": seed, "point": point,
            "batch_set": batch_set, "steps": steps, "curve": curve, "train_loss": losses,
            "skipped": int(fetch(state["skipped"])),
            "batch_digest": digest,
            "wall_s": round(time.time() - t0, 2), "compile_s": round(compile_s, 2)}
