"""Pretraining for mxjax: data pipeline, jitted optax loop, orbax checkpoints, metrics, CLI.

``python -m train --config configs/tiny.yaml`` (see ``--help``); from Python,
``train.loop.run(train.config.load(path, overrides))`` returns a ``RunSummary``.
Modules: ``config`` (YAML schema), ``data`` (readers, tokenization, packing,
loader; ``python -m train.data prepare``), ``tokenizer``, ``loop``,
``checkpoint``, ``metrics``.
"""
