"""The ladder study in one command: ``python -m train.study --config configs/ladder_tiny.yaml``.

Measures what each policy of the paper's ladder (and the ablations that locate
an effect) costs in training progress, with 95% intervals. Protocol:

1. **Fixed-budget ladder** (the end-to-end check). The reference (``none``,
   exact fp32) and every rung train ``steps`` steps from the same fresh init per
   seed, on the same batches, evaluated with the exact forward on the same
   held-out set (``eval_sequences`` sequences) every ``eval_every`` steps. Final
   losses are compared paired by seed; token overhead is read off the
   baseline's own curve (`train.study_report`).
2. **Branch-and-compare** (the primary measure). The reference runs of
   ``branch.seeds`` save their state at ``branch.points``. From each, every
   policy trains ``branch.steps`` (K) steps on the same batches and keys, and
   the exact branch ``branch.exact_steps`` steps with evaluations every
   ``branch.exact_eval_every``. A policy's efficiency is the exact steps that
   give its held-out loss decrease, over K (`train.study_stats`).
3. **Scale trend**: step 2 for ``scale.policies`` at ``scale.widths``.
4. **Mechanism probe** (``probe``): per-GEMM error structure at the saved
   reference states (`train.study_probe`).

Every unit (one run or one branch) writes its record to ``<out>`` when done;
re-running skips finished units, so an interrupted study resumes (a unit that
was cut short restarts; units are at most a minute or two each). With
``workers > 1`` units run in that many processes, each on one CPU thread
(CPU only). Outputs: ``<out>/ladder.md``, ``ladder.json`` and the plots.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import yaml

from train import study_config as SC
from train import study_engine as E
from train import study_policies, study_probe
from train.config import ConfigError
from train.plan import validate
from train.process import fetch

__all__ = ["Unit", "chunks", "main", "plan_units", "run_study"]


@dataclasses.dataclass(frozen=True, kw_only=True, order=True)
class Unit:
    """One piece of work: a fixed-budget run, or a branch from a reference state."""

    phase: int  # 0: reference runs that save branch states; 1: everything else
    width: int
    kind: str  # "run" | "branch"
    seed: int
    point: int = -1
    batch_set: int = 0
    policy: str = ""

    def path(self, root: Path) -> Path:
        w = root / f"w{self.width}"
        if self.kind == "run":
            return w / "runs" / self.policy / f"seed{self.seed}.json"
        return (w / "branches" / f"seed{self.seed}" / f"p{self.point}" / f"b{self.batch_set}"
                / f"{self.policy}.json")

    def label(self) -> str:
        if self.kind == "run":
            return f"w{self.width} run {self.policy} seed {self.seed}"
        return (f"w{self.width} branch {self.policy} seed {self.seed} step {self.point} "
                f"set {self.batch_set}")


def plan_units(cfg: SC.StudyConfig) -> list[Unit]:
    """Every unit of the study, in the order they should run."""
    units: list[Unit] = []
    widths = {cfg.width: (cfg.branch_seeds, cfg.branch.points, cfg.branch_policies)}
    for w in cfg.scale.widths:
        widths[w] = (cfg.scale.seeds, cfg.scale_points, cfg.scale.policies)
    for w, (seeds, _, _) in widths.items():
        units += [Unit(phase=0, width=w, kind="run", seed=s, policy=cfg.reference) for s in seeds]
    for s in cfg.seeds:
        for p in cfg.ladder_policies:
            u = Unit(phase=0 if p == cfg.reference and s in cfg.branch_seeds else 1,
                     width=cfg.width, kind="run", seed=s, policy=p)
            if u not in units:
                units.append(u)
    for w, (seeds, points, pols) in widths.items():
        for s in seeds:
            for pt in points:
                for b in range(cfg.branch.batch_sets):
                    for p in (cfg.reference,) + tuple(pols):
                        units.append(Unit(phase=1, width=w, kind="branch", seed=s, point=pt,
                                          batch_set=b, policy=p))
    return sorted(units, key=lambda u: (u.phase, u.kind != "run", u.width != cfg.width))


def execute(cfg: SC.StudyConfig, bench: E.Bench, unit: Unit) -> float:
    """Runs one unit on `bench` (its width's compiled pieces) and writes its record; returns
    its wall seconds."""
    root = cfg.out_path
    t0 = time.time()
    if unit.kind == "run":
        points = set(cfg.branch.points if unit.width == cfg.width else cfg.scale_points)
        saving = unit.policy == cfg.reference and unit.phase == 0

        def save(k: int, state: Any) -> None:
            if k in points:
                E.save_state(E.state_path(root, unit.width, unit.seed, k), state)

        every = (cfg.eval_every if unit.policy in (cfg.reference, cfg.baseline)
                 else cfg.rung_eval_every)
        rec = E.fixed_budget_run(bench, unit.policy, unit.seed, cfg.steps, every,
                                 save if saving else None)
    else:
        spath = E.state_path(root, unit.width, unit.seed, unit.point)
        if not spath.exists():  # a branch point added after the reference run: replay it
            E.replay_state(bench, cfg.reference, unit.seed, unit.point, spath)
        start = E.load_state(spath, bench)
        exact = unit.policy == cfg.reference
        b = cfg.branch
        rec = E.branch(bench, unit.policy, start, unit.seed, unit.point, unit.batch_set,
                       b.exact_steps if exact else b.steps, b.steps,
                       b.exact_eval_every if exact else None)
    rec.update(width=unit.width, n_params=bench.n_params)
    E.write_json(unit.path(root), rec)
    return time.time() - t0


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[study] {msg}", file=sys.stderr, flush=True)


def execute_chunk(cfg_json: str, units: Sequence[Unit], verbose: bool,
                  benches: dict[int, E.Bench] | None = None) -> list[float]:
    """Runs `units` (one width and policy: one compilation) in order; their wall seconds.

    `benches` (width -> Bench) lets a sequential study share compiled pieces across chunks;
    a worker process builds its chunk's own (the persistent compilation cache serves what
    another chunk compiled).
    """
    cfg = SC.from_dict(json.loads(cfg_json))
    benches = {} if benches is None else benches
    walls = []
    for u in units:
        if u.width not in benches:
            benches[u.width] = E.make_bench(SC.run_config(cfg, u.width))
        wall = execute(cfg, benches[u.width], u)
        walls.append(wall)
        _log(verbose, f"  {u.label()}: {wall:.1f} s (pid {os.getpid()})")
    return walls


def chunks(units: Sequence[Unit]) -> list[list[Unit]]:
    """`units` grouped by (phase, width, kind, policy), largest first (longest-job-first
    balances the workers); each group compiles its train step once."""
    groups: dict[tuple, list[Unit]] = {}
    for u in units:
        groups.setdefault((u.phase, u.width, u.kind, u.policy), []).append(u)

    def cost(g: list[Unit]) -> float:
        return sum((200 if u.kind == "run" else 30) * (u.width / 128) ** 1.5 for u in g)

    return sorted(groups.values(), key=lambda g: (g[0].phase, -cost(g)))


def _worker_env() -> dict[str, str]:
    """One XLA:CPU thread per worker process: two small programs side by side beat one
    program on two threads for models this size."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": (flags + " --xla_cpu_multi_thread_eigen=false "
                          "intra_op_parallelism_threads=1").strip()}


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
    benches: dict[int, E.Bench] = {}  # this process's compiled pieces, per width
    t_start = time.time()
    n_done = 0

    def progress(n: int) -> None:
        nonlocal n_done
        n_done += n
        el = time.time() - t_start
        _log(verbose, f"{n_done}/{len(todo)} units done, {el / 60:.1f} min elapsed, "
             f"~{el / n_done * (len(todo) - n_done) / 60:.0f} min left")

    for phase in (0, 1):
        groups = chunks([u for u in todo if u.phase == phase])
        if cfg.workers == 1 or len(groups) <= 1:
            for g in groups:
                progress(len(execute_chunk(cfg_json, g, verbose, benches)))
            continue
        saved = {k: os.environ.get(k) for k in _worker_env()}
        os.environ.update(_worker_env())
        try:
            ctx = multiprocessing.get_context("spawn")
            with cf.ProcessPoolExecutor(max_workers=cfg.workers, mp_context=ctx) as pool:
                futures = [pool.submit(execute_chunk, cfg_json, g, verbose) for g in groups]
                for fut in cf.as_completed(futures):
                    progress(len(fut.result()))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    if cfg.probe:
        _probe(cfg, verbose)
    from train import study_report

    rep = study_report.write_report(cfg)
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


PROBE_POLICIES = ("mxfp4_all", "mxfp4_all_h16", "mxfp4_all_rht16", "mxfp4_all_h32",
                  "mxfp4_wgrad_h16", "wgrad_mx_h16")


def run_probe(cfg: SC.StudyConfig, out: Path) -> dict[str, Any]:
    """`train.study_probe.mechanism_probe` at the first and last branch points (reference
    states of the first branch seed; the two batches that follow each point); writes `out`.

    The implementation checks run at the last point only (they triple the host work).
    """
    run = SC.run_config(cfg, cfg.width)
    model_config = validate(run, verbose=False).model_config
    bench = E.make_bench(run)
    seed = cfg.branch_seeds[0]
    pols = {p: study_policies.get(p) for p in PROBE_POLICIES}
    result: dict[str, Any] = {"seed": seed, "policies": list(pols), "points": {}}
    points = sorted(cfg.branch.points)
    for point in (points[0], points[-1]):
        state = E.load_state(E.state_path(cfg.out_path, cfg.width, seed, point), bench)
        loader = bench.loader(seed)
        batches = [loader.batch(point), loader.batch(point + 1)]
        result["points"][str(point)] = study_probe.mechanism_probe(
            model_config, fetch(state["params"]), batches, pols, key_seed=seed,
            impl_check=point == points[-1])
    E.write_json(Path(out), result)
    return result


# --------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m train.study",
        description="The MXFP4 ladder study: fixed-budget runs, branch-and-compare "
                    "efficiency with 95%% intervals, ablations and scale trend (train/study.py).")
    p.add_argument("--config", required=True, help="study YAML (e.g. configs/ladder_tiny.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key, e.g. seeds=[0,1] or branch.steps=12")
    p.add_argument("--out", help="output directory (default: out_dir, else runs/<name>)")
    p.add_argument("--report-only", action="store_true",
                   help="do not train; rewrite the report from the records on disk")
    p.add_argument("--quiet", action="store_true", help="less output")
    a = p.parse_args(argv)
    sets = list(a.set) + ([f"out_dir={a.out}"] if a.out else [])
    try:
        cfg = SC.load(a.config, sets)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if a.report_only:
        from train import study_report

        study_report.write_report(cfg)
    else:
        run_study(cfg, verbose=not a.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
