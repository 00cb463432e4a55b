"""Pretraining for mxjax: the optax loop, its data, orbax checkpoints, what a run writes, CLI.

``python -m train --config configs/tiny.yaml`` (see ``--help``); from Python,
``train.loop.run(train.config.load(path, overrides))`` returns a ``RunSummary``.

What lives where, lower layers first (the exact order, which `tests/test_layering.py`
enforces, is its ``LAYERS["train"]``):

* ``config`` (the YAML schema, ``--set`` overrides), ``jsonsafe``, ``hooks``
  (the run's extension points);
* ``data/`` (sources and validation, tokenizer, the prepared-data cache, the
  loader; ``python -m train.data prepare``);
* ``diagnostics/`` (training dynamics: per-layer gradient norms, update sizes,
  the instability detector; the per-GEMM numerics hooks of ``diagnostics.enabled``);
* ``output/`` (what a run writes: metrics.jsonl, TensorBoard events, the MLPerf
  log, summary.json; whether a directory's earlier outputs may be reused);
* ``plan`` (the config resolved and validated before anything compiles),
  ``optimizer``, ``state`` (the train state's layout on the mesh), ``step``
  (the pure traced train/eval steps), ``process`` (multi-host setup, compile
  cache), ``checkpoint`` (orbax, digests), ``compat`` (which checkpoints a run
  may resume), ``run_lock`` (one live run per output directory), ``preemption``
  (SIGTERM/SIGINT: stop at a step boundary after a checkpoint, agreed by every process);
* ``run`` (``CompiledRun``: a run's mesh, optimizer, state layout, jitted steps and
  data, built once from a plan; the trainer and the study's units run on it);
* ``trainer`` (the host loop), ``loop`` (``run``), ``__main__`` (the CLI).

The ladder study, which builds its runs from these pieces, is the repository-level
package ``study`` (``python -m study``); nothing here imports it. Repository-level
code: run it from a clone (the installed distribution ships only ``mxjax``).
"""
