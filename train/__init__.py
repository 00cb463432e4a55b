"""Pretraining for mxjax: data pipeline, jitted optax loop, orbax checkpoints, metrics, CLI.

``python -m train --config configs/tiny.yaml`` (see ``--help``); from Python,
``train.loop.run(train.config.load(path, overrides))`` returns a ``RunSummary``.
Modules: ``config`` (YAML schema), ``data`` (readers, tokenization, packing,
loader; ``python -m train.data prepare``), ``tokenizer``, ``loop`` (``run``),
``plan``, ``optimizer``, ``step``, ``state``, ``trainer``, ``hooks``,
``compat``, ``summary``, ``mlperf``, ``process``, ``checkpoint``, ``metrics``,
``jsonsafe``; the ladder: ``ladder`` and its ``ladder_*`` modules.

Repository-level code: run it from a clone (the installed distribution ships
only ``mxjax``).
"""
