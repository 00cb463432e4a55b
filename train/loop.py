"""The pretraining entry point: `run(config) -> RunSummary`.

``run`` sets up the process (multi-host init, compile cache), validates the
config into a `Plan` (`train.plan`) and trains it with a `Trainer`
(`train.trainer`). The pieces live in modules of one job each:

* `train.plan`: config resolution and validation (`validate`, `Plan`);
* `train.optimizer`: the optax chain and learning-rate schedule;
* `train.step`: the pure traced train/eval steps (`make_train_step`);
* `train.state`: the train state's shapes and shardings on the mesh;
* `train.trainer`: the host loop (checkpoints, evaluation, metrics);
* `train.compat`, `train.output.summary`, `train.output.mlperf`, `train.process`: resume
  compatibility, the run summary, MLPerf events, process setup;
* `train.run_lock`: one live run per output directory.

The names below are re-exported so ``from train import loop; loop.run(...)``
and ``loop.Hooks`` keep working.
"""

from __future__ import annotations

import sys

import jax

from train.config import Config
from train.hooks import Hooks, StepContext
from train.output.summary import RunSummary, finished
from train.plan import Plan, check_out_dir, validate
from train.process import init_distributed, use_compile_cache
from train.run_lock import RunDirNotWritable, acquire_for_run
from train.trainer import Trainer

__all__ = ["Hooks", "Plan", "RunSummary", "StepContext", "Trainer", "init_distributed", "run",
           "use_compile_cache", "validate"]


def run(config: Config, *, hooks: Hooks | None = None, verbose: bool = True) -> RunSummary:
    """Train per `config`; resume from its output directory's checkpoints if any.

    Returns a `RunSummary` (also written to ``<out>/summary.json``). Raises
    ConfigError for configuration problems (before compiling),
    train.checkpoint.CheckpointError for unreadable/incompatible checkpoints and
    train.run_lock.RunLockError when another live run holds the output directory
    or it cannot be written. A complete run in a read-only directory is
    reported (nothing to write) rather than refused.
    """
    if config.mesh.distributed:
        init_distributed(config.mesh)
    use_compile_cache(config.jax_cache_dir)
    check_out_dir(config.out_path)  # a file there: the config error --check reports
    lock, read_only = None, False
    try:
        lock, stale = acquire_for_run(config.out_path)
    except RunDirNotWritable:
        if not finished(config.out_path, config.train.steps):
            raise
        read_only = True  # the Trainer checks the checkpoints agree, and writes nothing
    else:
        if stale is not None and verbose and jax.process_index() == 0:
            print(f"[train] taking over {config.out_path}: the run that held it "
                  f"({stale.describe()}) is no longer running", file=sys.stderr, flush=True)
    try:
        plan = validate(config, verbose=verbose)
        return Trainer(plan, hooks, verbose, read_only=read_only).run()
    finally:
        if lock is not None:
            lock.release()
