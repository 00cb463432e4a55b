"""A run's compiled pieces, built once from a validated `Plan`: `CompiledRun`.

`CompiledRun` owns the mesh, the optimizer and schedule, the train state's
layout and shardings (`train.state`), the jitted train and eval steps
(`train.step`, compiled on first call, one per precision policy) and the
run's data as this process reads it (the training sequences, the loader of a
seed, the fixed validation batches). The trainer (`train.trainer`) runs one
policy on it; the ladder study builds one per model width and runs every
policy's runs and branches on it, so they share the layout and the data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from models import sharding as shd
from mxjax import PrecisionPolicy
from train import data as datamod
from train.config import ConfigError
from train.data.loader import BatchLoader
from train.data.run_data import PreparedRunData, StreamRunData, run_data
from train.hooks import Hooks
from train.optimizer import make_optimizer
from train.plan import Plan, check_mesh_blocks, with_backend
from train.process import fetch
from train.state import StateLayout, make_state_layout, put_batch
from train.step import make_eval_step, make_train_step

__all__ = ["CompiledRun"]


class CompiledRun:
    """The compiled pieces of the run `plan` describes (see the module docstring).

    Attributes:
      plan, config: the validated plan and its config.
      mesh: the (data, fsdp, tensor) mesh of ``plan.mesh_axes``.
      tx, schedule: the optax transformation and the learning-rate schedule.
      layout: the `StateLayout` (abstract state, shardings, the jitted fresh init).
      data: the run's data as this process reads it (`train.data.run_data`: the prepared
        cache or the grain stream, one interface).
      train_sequences: the packed training split (token ids checked on read); None for a
        stream.
      eval_batches: this process's rows of every validation batch, int32[b, T+1].
    """

    def __init__(self, plan: Plan, *, hooks: Hooks | None = None):
        c = plan.config
        self.plan, self.config, self.hooks = plan, c, hooks or Hooks()
        d, f, t = plan.mesh_axes
        self.mesh = shd.make_mesh(data=d, fsdp=f, tensor=t)
        self.tx, self.schedule = make_optimizer(c)
        self.layout: StateLayout = make_state_layout(plan.model_config, self.mesh, self.tx,
                                                     c.seed)
        self._train: dict[PrecisionPolicy | None, Callable[..., Any]] = {}
        self._eval: dict[PrecisionPolicy | None, Callable[..., Any]] = {}
        pi, pc = jax.process_index(), jax.process_count()
        if plan.eval_batch % pc:
            raise ConfigError(f"the eval batch ({plan.eval_batch}) must be divisible by the "
                              f"number of processes ({pc})")
        self.data: PreparedRunData | StreamRunData = run_data(
            c.data, prepared=plan.prepared, stream=plan.stream,
            # batches with ids outside the model's vocabulary are refused on the host
            vocab_size=plan.model_config.vocab_size, global_batch=c.train.global_batch,
            process_index=pi, process_count=pc)
        self.train_sequences = self.data.train
        per = plan.eval_batch // pc
        self.eval_batches = [b[pi * per:(pi + 1) * per]
                             for b in datamod.eval_batches(self.data.val, c.train.eval_sequences,
                                                           plan.eval_batch)]

    @property
    def abstract(self) -> dict[str, Any]:
        """The state as ShapeDtypeStructs with their shardings (what a checkpoint restores)."""
        return self.layout.abstract

    @property
    def n_params(self) -> int:
        return self.layout.n_params

    @property
    def tokens_per_step(self) -> int:
        return self.config.train.global_batch * self.config.data.seq_len

    def policy_for(self, policy: PrecisionPolicy | None) -> PrecisionPolicy | None:
        """The policy this run compiles for `policy`: its quantized GEMMs on the config's
        ``backend`` when one is set (the ladder study's rungs and baseline too,
        `train.plan.with_backend`), else itself. The plan's own policy is returned as it is:
        `train.plan.resolve_policy` put it under the backend already, keeping the backends
        its config entry names (a dict GEMM's ``backend: xla`` included), which applying
        'auto' again would move."""
        if policy is not None and policy == self.plan.policy:
            return policy
        return with_backend(policy, self.config.backend)

    def has_train_step(self, policy: PrecisionPolicy | None) -> bool:
        """Whether `train_step` has built `policy`'s step already (its first call compiles)."""
        return self.policy_for(policy) in self._train

    def train_step(self, policy: PrecisionPolicy | None) -> Callable[..., Any]:
        """``step(state, batch, policy_base) -> (state, metrics)`` under `policy` (on the
        config's ``backend``: `policy_for`), jitted with the state's shardings (state
        donated); one compilation per policy."""
        policy = self.policy_for(policy)
        if policy not in self._train:
            # the plan's policy was checked by validate; a ladder rung's is checked here
            check_mesh_blocks(policy, self.config, self.plan.model_config, self.plan.mesh_axes)
            lay = self.layout
            fn = make_train_step(graphdef=lay.graphdef, policy=policy, tx=self.tx,
                                 schedule=self.schedule, accum_steps=self.config.accum_steps,
                                 hooks=self.hooks)
            self._train[policy] = jax.jit(
                fn, in_shardings=(lay.shardings, lay.batch, lay.replicated),
                out_shardings=(lay.shardings, lay.replicated), donate_argnums=(0,))
        return self._train[policy]

    def eval_step(self, policy: PrecisionPolicy | None) -> Callable[..., Any]:
        """``eval_step(params, batch, policy_base) -> f32`` summed token cross-entropy under
        `policy` (`policy_for`), jitted; one compilation per policy."""
        policy = self.policy_for(policy)
        if policy not in self._eval:
            lay = self.layout
            fn = make_eval_step(graphdef=lay.graphdef, policy=policy, hooks=self.hooks)
            self._eval[policy] = jax.jit(
                fn, in_shardings=(lay.param_shardings, lay.batch, lay.replicated),
                out_shardings=lay.replicated)
        return self._eval[policy]

    def init_state(self, seed: int) -> dict[str, Any]:
        """The fresh, sharded train state of `seed` (one compilation for every seed).

        With ``model.init_from`` the parameters are the HF checkpoint's
        (`train.hf.load_init_params`); the optimizer state is fresh either way.
        """
        with shd.use_mesh(self.mesh):
            state = self.layout.init(jax.random.key(seed))
        init_from = self.config.model.init_from
        if init_from is not None:
            from train.hf import load_init_params

            state["params"] = load_init_params(init_from, self.plan.model_config, self.mesh,
                                               self.layout.param_shardings)
        return state

    def put(self, local: np.ndarray) -> jax.Array:
        """The global batch from this process's rows int32[b_local, T+1], on the mesh."""
        return put_batch(local, self.layout.batch)

    def loader(self, seed: int) -> BatchLoader:
        """The deterministic batch stream of `seed` (this process's rows of each batch): a
        `train.data.loader.TrainLoader` (random access by step) for the prepared data, a
        `train.data.stream.StreamLoader` (consecutive steps, resumable state) for grain."""
        return self.data.loader(seed)

    @property
    def train_samples(self) -> int | None:
        """Training sequences (of the prepared data); None for a stream (not counted)."""
        return self.data.train_samples

    def data_summary(self) -> str:
        """One line on the training data, for the run's log."""
        return self.data.summary()

    def loader_record(self, loader: BatchLoader, step: int) -> dict[str, Any]:
        """What a checkpoint at `step` records of the loader: every process's stream state
        (``data_state``, a collective on several processes) for grain; nothing for the
        prepared data, whose position is the step."""
        return loader.checkpoint_record(step)

    def restore_loader(self, loader: BatchLoader, meta: dict[str, Any], step: int) -> None:
        """Put the loader where the checkpoint of `step` (its record `meta`) left it."""
        loader.resume(meta, step)

    def loader_metrics(self, loader: BatchLoader) -> dict[str, Any]:
        """Metrics of the loader for a record: the bad records skipped over every process
        (``data_bad_records``; a collective on several processes) for grain."""
        return loader.metrics()

    def evaluate(self, params: Any, policy: PrecisionPolicy | None,
                 policy_base: jax.Array) -> float:
        """Mean token cross-entropy of `params` on the fixed validation set, under `policy`'s
        forward (its key folded from `policy_base`)."""
        fn = self.eval_step(policy)
        total = 0.0
        with shd.use_mesh(self.mesh):
            for b in self.eval_batches:
                total += float(fetch(fn(params, self.put(b), policy_base)))
        return total / (self.config.train.eval_sequences * self.config.data.seq_len)
