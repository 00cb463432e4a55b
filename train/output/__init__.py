"""What a run writes into its output directory, one module per file kind.

``metrics`` (``metrics.jsonl``: one JSON record per logged step, the console
progress line, ``plot.png``), ``tensorboard_log`` (``events.out.tfevents.*``),
``mlperf`` (``mllog.txt``, the MLPerf Training log) and ``summary``
(``summary.json``: the run's `RunSummary`); ``previous`` decides whether a
directory holding another run's outputs may be written (without checkpoints it
is refused). The trainer (`train.trainer`) drives them; none of them imports the loop.
"""
