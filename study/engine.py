"""The ladder study's units of work, run in-process: fixed-budget runs and branches.

A `Bench` holds one model width's compiled pieces (train and eval steps per
policy, the data, the fresh init), so the hundreds of short runs of a study
share compilations. Two kinds of unit, each a pure function of the config and
its arguments that returns a JSON-able record:

- `fixed_budget_run`: a policy trains ``steps`` steps from the seed's fresh
  init on the seed's batch stream, evaluated on the fixed held-out set every
  ``eval_every`` steps. The reference policy's runs also save their full state
  (parameters and optimizer) at the branch points.
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

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from models import sharding as shd
from study import policies as study_policies
from train import data as datamod
from train.config import Config
from train.optimizer import make_optimizer
from train.plan import validate
from train.process import fetch, use_compile_cache
from train.state import make_state_layout, put_batch
from train.step import make_eval_step, make_train_step, policy_base_key

# Batch set j > 0 of a branch draws its own shuffle: the seed's stream, offset by this.
BATCH_SET_STRIDE = 7919


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


@dataclasses.dataclass
class Bench:
    """One width's compiled pieces (see the module docstring). Built by `make_bench`."""

    config: Config
    n_params: int
    init: Callable[[jax.Array], Any]
    abstract: Any
    put: Callable[[np.ndarray], jax.Array]
    train_seqs: datamod.Sequences
    eval_data: list[np.ndarray]
    global_batch: int
    mesh: Any
    make_step: Callable[[str], Callable[..., Any]]
    make_eval: Callable[[str], Callable[..., Any]]
    _steps: dict[str, Any] = dataclasses.field(default_factory=dict)
    _evals: dict[str, Any] = dataclasses.field(default_factory=dict)

    def step(self, policy: str):
        if policy not in self._steps:
            self._steps[policy] = self.make_step(policy)
        return self._steps[policy]

    def evaluate(self, params: Any, policy: str = "none", base: jax.Array | None = None) -> float:
        """Mean token cross-entropy on the held-out set, under `policy`'s forward."""
        if policy not in self._evals:
            self._evals[policy] = self.make_eval(policy)
        fn = self._evals[policy]
        base = policy_base_key(0) if base is None else base
        total = 0.0
        with shd.use_mesh(self.mesh):
            for b in self.eval_data:
                total += float(fetch(fn(params, self.put(b), base)))
        n = sum(b.shape[0] * (b.shape[1] - 1) for b in self.eval_data)
        return total / n

    def loader(self, seed: int) -> datamod.TrainLoader:
        return datamod.TrainLoader(self.train_seqs, global_batch=self.global_batch, seed=seed)


def make_bench(config: Config) -> Bench:
    """Builds the compiled pieces for `config` (its policy is ignored: steps are per policy)."""
    use_compile_cache(config.jax_cache_dir)
    plan = validate(config, verbose=False)
    d, f, t = plan.mesh_axes
    mesh = shd.make_mesh(data=d, fsdp=f, tensor=t)
    tx, schedule = make_optimizer(config)
    lay = make_state_layout(plan.model_config, mesh, tx, config.seed)
    T = config.data.seq_len
    V = plan.model_config.vocab_size
    train_seqs = datamod.Sequences(plan.prepared.tokens("train"), T, vocab_size=V)
    val = datamod.Sequences(plan.prepared.tokens("val"), T, vocab_size=V)
    eval_data = datamod.eval_batches(val, config.train.eval_sequences, plan.eval_batch)

    def make_step(policy: str):
        fn = make_train_step(graphdef=lay.graphdef, policy=study_policies.get(policy), tx=tx,
                             schedule=schedule, accum_steps=config.accum_steps)
        return jax.jit(fn, in_shardings=(lay.shardings, lay.batch, lay.replicated),
                       out_shardings=(lay.shardings, lay.replicated), donate_argnums=(0,))

    def make_eval(policy: str):
        fn = make_eval_step(graphdef=lay.graphdef, policy=study_policies.get(policy))
        return jax.jit(fn, in_shardings=(lay.param_shardings, lay.batch, lay.replicated),
                       out_shardings=lay.replicated)

    return Bench(config=config, n_params=lay.n_params, init=lay.init, abstract=lay.abstract,
                 put=lambda b: put_batch(b, lay.batch), train_seqs=train_seqs,
                 eval_data=eval_data, global_batch=config.train.global_batch, mesh=mesh,
                 make_step=make_step, make_eval=make_eval)


# --------------------------------------------------------------------------- states
def save_state(path: Path, state: Any) -> None:
    """The full train state (parameters, optimizer, counters) as an .npz, atomically."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(fetch(state))]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **{f"leaf{i}": x for i, x in enumerate(leaves)})
    os.replace(tmp, path)


def load_state(path: Path, bench: Bench) -> Any:
    """A state saved by `save_state`, checked against the bench's layout and placed on it."""
    treedef = jax.tree.structure(bench.abstract)
    abstract = jax.tree.leaves(bench.abstract)
    with np.load(path) as z:
        leaves = [z[f"leaf{i}"] for i in range(len(z.files))]
    if len(leaves) != len(abstract) or any(
            x.shape != a.shape or x.dtype != a.dtype for x, a in zip(leaves, abstract)):
        raise ValueError(f"{path}: the saved state does not match this model's layout (another "
                         "width or optimizer?); delete it to re-run its reference run")
    return jax.tree.unflatten(treedef, [jax.device_put(x, a.sharding)
                                        for x, a in zip(leaves, abstract)])


def state_path(root: Path, width: int, seed: int, step: int) -> Path:
    return root / "states" / f"w{width}" / f"seed{seed}" / f"step{step}.npz"


# --------------------------------------------------------------------------- units
def _digest_start(seed: int, first_step: int, count: int):
    """SHA-256 of what a branch consumes, fed batch by batch: the seed, its step indices and
    key, then its first `count` batches."""
    h = hashlib.sha256()
    h.update(np.asarray([seed, first_step, count], np.int64).tobytes())
    h.update(np.asarray(jax.random.key_data(policy_base_key(seed))).tobytes())
    return h


def _train(bench: Bench, policy: str, state: Any, batch_at: Callable[[int], np.ndarray],
           steps: int, seed: int, eval_at: Callable[[int], bool], *, first_step: int = 0,
           digest_steps: int = 0, on_step: Callable[[int, Any], None] | None = None):
    """Trains `state` for `steps` steps on ``batch_at(k)`` (read one at a time, so a long run
    holds one batch on the host); returns (state, per-step losses, [(k, exact eval)], digest of
    the first `digest_steps` batches)."""
    step_fn = bench.step(policy)
    base = policy_base_key(seed)
    digest = _digest_start(seed, first_step, digest_steps)
    losses, curve = [], []
    with shd.use_mesh(bench.mesh):
        for k in range(steps):
            if eval_at(k):
                curve.append((k, bench.evaluate(state["params"])))
            if on_step is not None:
                on_step(k, state)
            b = batch_at(k)
            if k < digest_steps:
                digest.update(np.ascontiguousarray(b).tobytes())
            state, m = step_fn(state, bench.put(b), base)
            losses.append(m["loss"])
    if eval_at(steps):
        curve.append((steps, bench.evaluate(state["params"])))
    losses = [float(x) for x in fetch(losses)]
    return state, losses, curve, digest.hexdigest()


def fixed_budget_run(bench: Bench, policy: str, seed: int, steps: int, eval_every: int,
                     save: Callable[[int, Any], None] | None = None) -> dict[str, Any]:
    """One run of the fixed-budget ladder (see the module docstring)."""
    t0 = time.time()
    with shd.use_mesh(bench.mesh):
        state = bench.init(jax.random.key(seed))
    loader = bench.loader(seed)
    state, losses, curve, digest = _train(
        bench, policy, state, loader.batch, steps, seed,
        lambda k: k % eval_every == 0 or k == steps, digest_steps=steps, on_step=save)
    own = bench.evaluate(state["params"], policy, policy_base_key(seed))
    return {"kind": "run", "policy": policy, "seed": seed, "steps": steps,
            "tokens_per_step": bench.global_batch * bench.config.data.seq_len,
            "curve": curve, "final_eval": curve[-1][1], "final_eval_own_forward": own,
            "train_loss": losses, "skipped": int(fetch(state["skipped"])),
            "batch_digest": digest, "wall_s": round(time.time() - t0, 2)}


def replay_state(bench: Bench, policy: str, seed: int, point: int, path: Path) -> None:
    """Re-creates a reference state missing from `path` by replaying the reference run's
    first `point` steps (the same init, batches and keys, so the same state) and saves it."""
    with shd.use_mesh(bench.mesh):
        state = bench.init(jax.random.key(seed))
    state, _, _, _ = _train(bench, policy, state, bench.loader(seed).batch, point, seed,
                            lambda k: False)
    save_state(path, state)


def branch(bench: Bench, policy: str, start: Any, seed: int, point: int, batch_set: int,
           steps: int, pair_steps: int, eval_every: int | None = None) -> dict[str, Any]:
    """One branch: `steps` steps of `policy` from the reference state `start` at `point`.

    With `eval_every` (the exact branch) the held-out loss is evaluated every
    `eval_every` steps from 0; otherwise only after the last step. `start` is
    consumed (its buffers are donated). ``batch_digest`` covers the first
    `pair_steps` steps, the part every branch of the point shares.
    """
    t0 = time.time()
    loader = bench.loader(batch_stream_seed(seed, batch_set))
    every = eval_every or steps
    state, losses, curve, digest = _train(
        bench, policy, start, lambda k: loader.batch(point + k), steps, seed,
        lambda k: k % every == 0 if eval_every else k == steps, first_step=point,
        digest_steps=pair_steps)
    return {"kind": "branch", "policy": policy, "seed": seed, "point": point,
            "batch_set": batch_set, "steps": steps, "curve": curve, "train_loss": losses,
            "skipped": int(fetch(state["skipped"])),
            "batch_digest": digest,
            "wall_s": round(time.time() - t0, 2)}
