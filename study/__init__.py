"""The ladder study in one command: ``python -m study --config configs/ladder_tiny.yaml``.

Measures what each policy of the paper's ladder (and the ablations that locate
an effect) costs in training progress, with 95% intervals. Protocol:

1. **Fixed-budget ladder** (the end-to-end check). The reference (``none``,
   exact fp32) and every rung train ``steps`` steps from the same fresh init per
   seed, on the same batches, evaluated with the exact forward on the same
   held-out set (``eval_sequences`` sequences) every ``eval_every`` steps. Final
   losses are compared paired by seed; token overhead is read off the
   baseline's own curve (`study.report`).
2. **Branch-and-compare** (the primary measure). The reference runs of
   ``branch.seeds`` save their state at ``branch.points``. From each, every
   policy trains ``branch.steps`` (K) steps on the same batches and keys, and
   the exact branch ``branch.exact_steps`` steps with evaluations every
   ``branch.exact_eval_every``. A policy's efficiency is the exact steps that
   give its held-out loss decrease, over K (`study.stats`).
3. **Scale trend**: step 2 for ``scale.policies`` at ``scale.widths``.
4. **Mechanism probe** (``probe``): per-GEMM error structure at the saved
   reference states (`study.probe`).

Every unit (one run or one branch) writes its record to ``<out>`` when done;
re-running skips finished units, so an interrupted study resumes (a unit that
was cut short restarts; units are at most a minute or two each). With
``workers > 1`` units run in that many processes, each on one CPU thread
(CPU only). Outputs: ``<out>/ladder.md``, ``ladder.json`` and the plots.

Data flows one way: ``mxjax -> models -> train -> study``. The study builds its
runs with the training loop's pieces (`train`); nothing in `train` imports it.
Modules, lowest first: ``policies`` (the rungs and the ablations), ``stats``
(intervals, interpolation, efficiencies), ``config`` (the study YAML),
``engine`` (one width's compiled pieces; fixed-budget runs and branches,
in-process), ``probe/`` (the mechanism probe: ``capture`` of every GEMM,
``analysis`` on the host, ``mechanism`` over policies and branch points),
``report`` (ladder.md, ladder.json, plots), ``units`` (the units of work and
their grouping), ``runner`` (runs the units, in worker processes or not, then
the probe and the report), ``__main__`` (the CLI).
"""
