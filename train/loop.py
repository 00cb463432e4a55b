"""The pretraining entry point: `run(config) -> RunSummary`.

``run`` sets up the process (multi-host init, compile cache), validates the
config into a `Plan` (`train.plan`) and trains it with a `Trainer`
(`train.trainer`). The pieces live in modules of one job each:

* `train.plan`: config resolution and validation (`validate`, `Plan`);
* `train.optimizer`: the optax chain and learning-rate schedule;
* `train.step`: the pure traced train/eval steps (`make_train_step`);
* `train.state`: the train state's shapes and shardings on the mesh;
* `train.trainer`: the host loop (checkpoints, evaluation, metrics);
* `train.compat`, `train.summary`, `train.mlperf`, `train.process`: resume
  compatibility, the run summary, MLPerf events, process setup.

The names below are re-exported so ``from train import loop; loop.run(...)``
and ``loop.Hooks`` keep working.
"""

from __future__ import annotations

from train.config import Config
from train.hooks import Hooks, StepContext
from train.plan import Plan, validate
from train.process import init_distributed, use_compile_cache
from train.summary import RunSummary
from train.trainer import Trainer

__all__ = ["Hooks", "Plan", "RunSummary", "StepContext", "Trainer", "init_distributed", "run",
           "use_compile_cache", "validate"]


def run(config: Config, *, hooks: Hooks | None = None, verbose: bool = True) -> RunSummary:
    """Train per `config`; resume from its output directory's checkpoints if any.

    Returns a `RunSummary` (also written to ``<out>/summary.json``). Raises
    ConfigError for configuration problems (before compiling) and
    train.checkpoint.CheckpointError for unreadable/incompatible checkpoints.
    """
    if config.mesh.distributed:
        init_distributed(config.mesh)
    use_compile_cache(config.jax_cache_dir)
    plan = validate(config, verbose=verbose)
    return Trainer(plan, hooks, verbose).run()
