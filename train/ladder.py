"""The paper's MXFP4 ladder in one command:
``python -m train.ladder --config configs/ladder_target_tiny.yaml``.

Trains the same model on the same data and seeds under every policy of the
ladder and reports the extra tokens each needs to reach the baseline's eval
loss (see ``train/ladder_report.py`` for the arithmetic). Protocol:

1. **Baseline budget.** The baseline policy (``fp8``) trains ``baseline_steps``
   steps per seed. Every run of the ladder uses the same learning-rate schedule,
   whose horizon is ``max_steps = ceil(budget_multiple · baseline_steps)``.
2. **Target.** Unless ``target_eval_loss`` is set, the target is the mean over
   seeds of the baseline's eval loss at step ``baseline_steps`` (the loss the
   baseline reaches at the end of its budget). Unless ``diverge_loss`` is set, a
   run counts as diverged when its eval loss rises above the baseline's mean
   eval loss before training (worse than the untrained model), becomes
   non-finite, or the trainer's non-finite guard stops it.
3. **Every run** (policy × seed, the baseline included) then trains up to
   ``max_steps`` steps and stops at the first evaluation at or below the target
   (a baseline seed that already reached it is not extended; one that did not
   resumes from its checkpoint). Tokens to target are interpolated between
   evaluations; a run that does not reach it within ``max_steps`` steps "does
   not converge".

Each run is an ordinary checkpointed ``train.loop.run`` under
``<out>/runs/<policy>/seed<k>/``: an interrupted ladder resumes where it
stopped, and finished runs (their stages are recorded in ``ladder_done.json``)
are skipped. With
``diagnostics.enabled``, the runs of ``diagnostics.seeds`` also record the
per-GEMM quantization statistics of every step (``mxjax.diagnostics``; this
does not change their losses), per-layer gradient norms and relative update
sizes into their ``metrics.jsonl`` and draw ``diagnostics.png``.

Modules: ``ladder_config`` (the config, parsed with train.config's typed
builder), ``ladder_diagnostics`` (the numerics hooks), ``ladder_store`` (runs
on disk), ``ladder_results`` (ladder.md/json), ``ladder_report`` (the
arithmetic, tables and plots); this module holds the orchestration and CLI.

Outputs in ``<out>``: ``ladder.md`` (the table in the paper's layout, the extra
policies, per-seed details, diagnostics summary), ``ladder.json`` (every
number), ``ladder_curves.png`` (all eval curves), ``target.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import yaml

from train import ladder_report as R
from train import ladder_store as store
from train import loop
from train.config import ConfigError
from train.ladder_config import (
    LADDER_POLICIES,
    DiagnosticsSection,
    LadderConfig,
    from_dict,
    load,
    run_config,
    run_dir,
    to_dict,
)
from train.ladder_diagnostics import RunDiagnostics, llama_slot_labels
from train.ladder_results import report

__all__ = [
    "LADDER_POLICIES",
    "DiagnosticsSection",
    "LadderConfig",
    "RunDiagnostics",
    "from_dict",
    "llama_slot_labels",
    "load",
    "main",
    "report",
    "run_ladder",
]


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[ladder] {msg}", file=sys.stderr, flush=True)


def _train_one(cfg: LadderConfig, policy: str, seed: int, steps: int, target: float | None,
               verbose: bool) -> dict[str, Any]:
    """Runs (or resumes, or skips) one run; returns its ladder_done record."""
    rdir = run_dir(cfg, policy, seed)
    done = store.stage_done(rdir, steps, target)
    if done is not None:
        return done
    tc = run_config(cfg, policy, seed, steps, target)
    hooks = None
    d = cfg.diagnostics
    diag = d.enabled and seed in d.seeds and (d.policies is None or policy in d.policies)
    if diag:
        plan = loop.validate(tc, verbose=False)
        rd = RunDiagnostics(labels=llama_slot_labels(plan.model_config),
                            cosine=cfg.diagnostics.cosine)
        hooks = rd.hooks()
    t0 = time.time()
    s = loop.run(tc, hooks=hooks, verbose=verbose)
    rec = {"policy": policy, "seed": seed, "steps": steps, "target": target,
           "status": s.status, "message": s.message, "steps_trained": s.steps,
           "tokens_trained": s.tokens, "wall_s": round(time.time() - t0, 1),
           "diagnostics": diag}
    if diag:
        title = f"{cfg.name}: {policy}, seed {seed}"
        R.plot_run_diagnostics(store.read_records(rdir), rdir / "diagnostics.png", title=title)
    store.mark_done(rdir, rec)
    return rec


def run_ladder(cfg: LadderConfig, *, verbose: bool = True) -> dict[str, Any]:
    """Trains every run of the ladder that is not done yet, then writes the report.

    Returns the report dict (also in ``<out>/ladder.json``).
    """
    out = cfg.out_path
    out.mkdir(parents=True, exist_ok=True)
    (out / "ladder_config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    t_start = time.time()
    n_runs = len(cfg.policies) * len(cfg.seeds)
    _log(verbose, f"{len(cfg.policies)} policies x {len(cfg.seeds)} seeds = {n_runs} runs in "
         f"{out}; baseline {cfg.baseline} for {cfg.baseline_steps} steps, budget "
         f"{cfg.max_steps} steps")
    # Phase 1: the baseline's budget.
    for seed in cfg.seeds:
        r = _train_one(cfg, cfg.baseline, seed, cfg.baseline_steps, None, verbose)
        _log(verbose, f"baseline {cfg.baseline} seed {seed}: {r['status']} "
             f"({time.time() - t_start:.0f} s so far)")
    target, diverge = _targets(cfg)
    (out / "target.json").write_text(json.dumps({"target_eval_loss": target,
                                                 "diverge_loss": diverge}, indent=1))
    _log(verbose, f"target eval loss {target:.4f}; diverged above {diverge:.4f}")
    # Phase 2: every run up to the budget, stopping at the target.
    i = 0
    for policy in cfg.policies:
        for seed in cfg.seeds:
            i += 1
            rdir = run_dir(cfg, policy, seed)
            if policy == cfg.baseline and R.tokens_to_target(
                    store.eval_curve(store.read_records(rdir)), target) is not None:
                continue  # reached the target within its budget: nothing to extend
            r = _train_one(cfg, policy, seed, cfg.max_steps, target, verbose)
            _log(verbose, f"({i}/{n_runs}) {policy} seed {seed}: {r['status']} after "
                 f"{r['steps_trained']} steps ({time.time() - t_start:.0f} s so far)")
    rep = report(cfg, verbose=verbose)
    _log(verbose, f"ladder done in {time.time() - t_start:.0f} s; report: {out / 'ladder.md'}")
    return rep


def _targets(cfg: LadderConfig) -> tuple[float, float]:
    """(target eval loss, divergence threshold) from the config or the baseline's runs."""
    finals, starts = [], []
    for seed in cfg.seeds:
        recs = store.read_records(run_dir(cfg, cfg.baseline, seed))
        fin = store.eval_at(recs, cfg.baseline_steps)
        if fin is None:
            raise RuntimeError(
                f"baseline {cfg.baseline} seed {seed} has no evaluation at step "
                f"{cfg.baseline_steps} (run.train.eval_every must divide baseline_steps, or "
                f"the run stopped early: see {run_dir(cfg, cfg.baseline, seed)})")
        finals.append(fin)
        st = store.eval_at(recs, 0)
        if st is not None:
            starts.append(st)
    target = cfg.target_eval_loss if cfg.target_eval_loss is not None else float(np.mean(finals))
    if cfg.diverge_loss is not None:
        diverge = cfg.diverge_loss
    elif starts:
        diverge = float(np.mean(starts))
    else:
        raise RuntimeError("diverge_loss: the baseline has no evaluation at step 0 "
                           "(run.train.eval_at_start: true), so set diverge_loss explicitly")
    if not math.isfinite(target):
        raise RuntimeError(f"the baseline's eval loss at step {cfg.baseline_steps} is not finite; "
                           "the ladder needs a baseline that trains (or set target_eval_loss)")
    return float(target), float(diverge)


# --------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m train.ladder",
        description="Train every policy of the MXFP4 ladder x seeds and report extra tokens "
                    "to reach the baseline's eval loss (see train/ladder.py).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="outputs in --out: ladder.md, ladder.json, ladder_curves.png, target.json, "
               "runs/<policy>/seed<k>/ (each an ordinary train run). Re-running resumes; "
               "finished runs are skipped.")
    p.add_argument("--config", required=True,
                   help="ladder YAML (e.g. configs/ladder_target_tiny.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a ladder key, e.g. seeds=[0] or run.train.eval_every=10")
    p.add_argument("--out", help="output directory (default: out_dir, else runs/<name>)")
    p.add_argument("--policies", help="comma-separated subset of the policies (baseline kept)")
    p.add_argument("--report-only", action="store_true",
                   help="do not train; rewrite the report from the runs on disk")
    p.add_argument("--quiet", action="store_true", help="less output")
    a = p.parse_args(argv)
    sets = list(a.set)
    if a.out:
        sets.append(f"out_dir={a.out}")
    try:
        cfg = load(a.config, sets)
        if a.policies:
            chosen = [x.strip() for x in a.policies.split(",") if x.strip()]
            if cfg.baseline not in chosen:
                chosen.insert(0, cfg.baseline)
            cfg = from_dict({**to_dict(cfg), "policies": chosen})
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if a.report_only:
        report(cfg, verbose=not a.quiet)
    else:
        run_ladder(cfg, verbose=not a.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
