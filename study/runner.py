"""Runs a study: every unit not done yet (in worker processes or not), the probe, the report.

See the package docstring for the protocol.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import yaml

from study import config as SC
from study import engine as E
from study.probe.mechanism import run_probe
from study.states import load_state, save_state, state_path
from study.units import Unit, chunks, plan_units
from train.config import ConfigError
from train.plan import check_backends as plan_check_backends
from train.plan import with_backend
from train.run import CompiledRun

__all__ = ["execute", "execute_chunk", "run_study"]


def execute(cfg: SC.StudyConfig, run: CompiledRun, unit: Unit,
            log: E.Log | None = None) -> tuple[float, float]:
    """Runs one unit on `run` (its width's compiled pieces) and writes its record; returns
    its wall seconds and the seconds of them spent compiling the train step (announced
    through `log`)."""
    root = cfg.out_path
    t0 = time.time()
    if unit.kind == "run":
        points = set(cfg.branch.points if unit.width == cfg.width else cfg.scale_points)
        saving = unit.policy == cfg.reference and unit.phase == 0

        def save(k: int, state: Any) -> None:
            if k in points:
                save_state(state_path(root, unit.width, unit.seed, k), state, run, step=k)

        every = (cfg.eval_every if unit.policy in (cfg.reference, cfg.baseline)
                 else cfg.rung_eval_every)
        rec = E.fixed_budget_run(run, unit.policy, unit.seed, cfg.steps, every,
                                 save if saving else None, custom_policies=cfg.custom_policies,
                                 log=log)
    else:
        spath = state_path(root, unit.width, unit.seed, unit.point)
        if not spath.exists():  # a branch point added after the reference run: replay it
            E.replay_state(run, cfg.reference, unit.seed, unit.point, spath,
                           custom_policies=cfg.custom_policies, log=log)
        start = load_state(spath, run)
        exact = unit.policy == cfg.reference
        b = cfg.branch
        rec = E.branch(run, unit.policy, start, unit.seed, unit.point, unit.batch_set,
                       b.exact_steps if exact else b.steps, b.steps,
                       b.exact_eval_every if exact else None,
                       custom_policies=cfg.custom_policies, log=log)
    rec.update(width=unit.width, n_params=run.n_params)
    E.write_json(unit.path(root), rec)
    return time.time() - t0, float(rec.get("compile_s", 0.0))


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[study] {msg}", file=sys.stderr, flush=True)


def execute_chunk(cfg_json: str, units: Sequence[Unit], verbose: bool,
                  runs: dict[int, CompiledRun] | None = None) -> list[tuple[float, float]]:
    """Runs `units` (one width and policy: one compilation) in order; for each, its wall
    seconds and the seconds of them spent compiling.

    `runs` (width -> CompiledRun) lets a sequential study share compiled pieces across chunks;
    a worker process builds its chunk's own (the persistent compilation cache serves what
    another chunk compiled).
    """
    cfg = SC.from_dict(json.loads(cfg_json))
    runs = {} if runs is None else runs
    walls = []
    for u in units:
        if u.width not in runs:
            runs[u.width] = E.make_run(SC.run_config(cfg, u.width))
        wall, compile_s = execute(cfg, runs[u.width], u, lambda m: _log(verbose, f"  {m}"))
        walls.append((wall, compile_s))
        _log(verbose, f"  {u.label()}: {wall:.1f} s (pid {os.getpid()})")
    return walls


def _worker_env() -> dict[str, str]:
    """One XLA:CPU thread per worker process: two small programs side by side beat one
    program on two threads for models this size."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": (flags + " --xla_cpu_multi_thread_eigen=false "
                          "intra_op_parallelism_threads=1").strip()}


def check_backends(cfg: SC.StudyConfig) -> None:
    """Every policy the study trains, on its ``run: backend`` (`train.plan.with_backend`, as
    each unit compiles it), runs on this chip, implements the policy's formats and gives a
    speed-up there (`train.plan.check_backends`, a run's own check): a ConfigError naming
    the policy before anything trains (it was a traceback when the first such unit
    compiled, after the units before it had trained)."""
    backend = SC.run_config(cfg, cfg.width).backend
    for name in sorted({u.policy for u in plan_units(cfg)}):
        policy = with_backend(cfg.policy(name), backend)
        if policy is None:
            continue
        try:
            plan_check_backends(policy)
        except ConfigError as e:
            raise ConfigError(f"policy {name!r} on run.backend {backend!r}: {e}") from None


def run_study(cfg: SC.StudyConfig, *, verbose: bool = True) -> dict[str, Any]:
    """Runs every unit not done yet, then the probe and the report; returns the report dict."""
    root = cfg.out_path
    root.mkdir(parents=True, exist_ok=True)
    (root / "study_config.yaml").write_text(yaml.safe_dump(SC.to_dict(cfg), sort_keys=False))
    units = plan_units(cfg)
    todo = [u for u in units if not u.path(root).exists()]
    _log(verbose, f"{len(units)} units in {root} ({len(units) - len(todo)} already done), "
         f"{cfg.workers} worker(s)")
    if cfg.workers > 1 and jax.default_backend() != "cpu":
        raise ConfigError(f"workers: {cfg.workers} worker processes are for CPU hosts; on "
                          f"{jax.default_backend()} use workers: 1 (one process per device set)")
    cfg_json = json.dumps(SC.to_dict(cfg), sort_keys=True)
    runs: dict[int, CompiledRun] = {}  # this process's compiled pieces, per width
    t_start = time.time()
    n_done, unit_s, compile_s = 0, 0.0, 0.0

    def progress(done: list[tuple[float, float]]) -> None:
        # The estimate counts training only: the share of the units' time spent compiling
        # (each width and policy once per process) is taken out of the elapsed time.
        nonlocal n_done, unit_s, compile_s
        n_done += len(done)
        unit_s += sum(w for w, _ in done)
        compile_s += sum(c for _, c in done)
        el = time.time() - t_start
        steps_only = el * (1 - compile_s / unit_s) if unit_s > 0 else el
        left = steps_only / n_done * (len(todo) - n_done)
        when = f"{left:.0f} s" if left < 90 else f"{left / 60:.0f} min"
        _log(verbose, f"{n_done}/{len(todo)} units done, {el / 60:.1f} min elapsed "
             f"({compile_s:.0f} s compiling)" + (
                 f", ~{when} of training left (plus compiling the policies not run yet)"
                 if n_done < len(todo) else ""))

    for phase in (0, 1):
        groups = chunks([u for u in todo if u.phase == phase])
        if cfg.workers == 1 or len(groups) <= 1:
            for g in groups:
                progress(execute_chunk(cfg_json, g, verbose, runs))
            continue
        saved = {k: os.environ.get(k) for k in _worker_env()}
        os.environ.update(_worker_env())
        try:
            ctx = multiprocessing.get_context("spawn")
            with cf.ProcessPoolExecutor(max_workers=cfg.workers, mp_context=ctx) as pool:
                futures = [pool.submit(execute_chunk, cfg_json, g, verbose) for g in groups]
                for fut in cf.as_completed(futures):
                    progress(fut.result())
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    if cfg.probe:
        _probe(cfg, verbose)
    from study import report

    rep = report.write_report(cfg)
    _log(verbose, f"study done in {time.time() - t_start:.0f} s; report: {root / 'ladder.md'}")
    return rep


def _probe(cfg: SC.StudyConfig, verbose: bool) -> None:
    """The mechanism probe at the first and last branch point of the first branch seed."""
    out = cfg.out_path / "probe.json"
    if out.exists():
        return
    t0 = time.time()
    run_probe(cfg, out)
    _log(verbose, f"probe done in {time.time() - t0:.0f} s")
