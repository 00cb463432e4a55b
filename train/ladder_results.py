"""The ladder's report: read every run from disk, write ladder.md, ladder.json and
ladder_curves.png (the arithmetic, tables and plots are in `train.ladder_report`)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from train import ladder_report as R
from train import ladder_store as store
from train.ladder_config import LadderConfig, run_config, run_dir
from train.ladder_diagnostics import diag_summary, instability


def _tokens_per_step(cfg: LadderConfig) -> int:
    tc = run_config(cfg, cfg.baseline, cfg.seeds[0], cfg.baseline_steps, None)
    return tc.train.global_batch * tc.data.seq_len


def report(cfg: LadderConfig, *, verbose: bool = True) -> dict[str, Any]:
    """Reads every run's metrics and writes ladder.md, ladder.json and ladder_curves.png."""
    out = cfg.out_path
    tj = out / "target.json"
    if not tj.is_file():
        raise RuntimeError(f"{tj} is missing: the baseline phase has not finished")
    tgt = json.loads(tj.read_text())
    target, diverge = float(tgt["target_eval_loss"]), float(tgt["diverge_loss"])
    tps = _tokens_per_step(cfg)
    max_tokens = cfg.max_steps * tps
    outcomes: list[R.RunOutcome] = []
    curves: dict[tuple[str, int], list[tuple[float, float]]] = {}
    runs_json, diag_rows, instab = [], {}, {}
    for policy in cfg.policies:
        for seed in cfg.seeds:
            rdir = run_dir(cfg, policy, seed)
            recs = store.read_records(rdir)
            if not recs:
                continue
            curve = store.eval_curve(recs)
            curves[(policy, seed)] = curve
            status = store.last_stage(rdir).get("status")
            o = R.classify_run(curve, target=target, max_tokens=max_tokens,
                               diverge_loss=diverge, stopped_nonfinite=status == "nonfinite",
                               policy=policy, seed=seed)
            outcomes.append(o)
            st = instability(recs)
            instab[(policy, seed)] = st
            d = diag_summary(recs)
            if d:
                diag_rows[(policy, seed)] = d
            runs_json.append({**dataclasses.asdict(o), "curve": curve,
                              "instability_step": st.event_step,
                              "instability_kind": st.event_kind, "diagnostics": d})
    base = [o for o in outcomes if o.policy == cfg.baseline]
    results = {p: R.summarize_policy([o for o in outcomes if o.policy == p], base)
               for p in cfg.policies if any(o.policy == p for o in outcomes)}
    png = R.plot_curves(curves, out / "ladder_curves.png", target=target,
                        title=f"{cfg.name}: eval loss vs tokens (target {target:.4f})")
    md = _markdown(cfg, results, outcomes, target, diverge, tps, diag_rows, instab)
    (out / "ladder.md").write_text(md)
    rep = {"target_eval_loss": target, "diverge_loss": diverge, "tokens_per_step": tps,
           "baseline": cfg.baseline, "baseline_steps": cfg.baseline_steps,
           "max_steps": cfg.max_steps, "policies": {p: dataclasses.asdict(r)
                                                    for p, r in results.items()},
           "runs": runs_json, "curves_png": str(png)}
    (out / "ladder.json").write_text(json.dumps(rep, indent=1, default=str))
    if verbose:
        print(R.paper_table(results), flush=True)
    return rep


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None or not math.isfinite(x) else format(x, spec)


def _pair(d: Mapping[str, float], gemm: str, a: str = "lhs_rel_err", b: str = "rhs_rel_err"
          ) -> str:
    return f"{_fmt(d.get(f'diag/{gemm}/{a}'))} / {_fmt(d.get(f'diag/{gemm}/{b}'))}"


def _markdown(cfg, results, outcomes, target, diverge, tps, diag_rows, instab) -> str:
    how = ("set in the config" if cfg.target_eval_loss is not None
           else f"the baseline's mean eval loss after {cfg.baseline_steps} steps")
    intro = (f"Baseline `{cfg.baseline}`, {len(cfg.seeds)} seeds {list(cfg.seeds)}. Target eval "
             f"loss {target:.4f} ({how}); budget {cfg.max_steps} steps "
             f"({cfg.max_steps * tps:,} tokens, {cfg.budget_multiple}x the baseline's); "
             f"diverged: eval loss > {diverge:.4f} or non-finite. Overhead = extra tokens to "
             "reach the target vs the baseline, paired by seed, mean ± std over seeds.")
    note = ("SR, random H16 and H16/H32 are presets with MXFP4 in all three GEMMs, so only "
            "their +Wgrad cell is a run of its own.")
    diag_intro = ("Means over the last quarter of each diagnosed run: relative quantization "
                  "error of the operands (X/W in fprop, dY/W in dgrad, dY/X in wgrad), "
                  "underflow of dY, output cosine vs the exact GEMM, gradient-collapse rate "
                  "(max over the run), mean relative update size, and the instability point "
                  "(first of 5 steps with grad norm > 100x its running minimum, or 10 steps of "
                  "zero gradient; all seeds).")
    header = ("| policy | seed | fprop err X/W | dgrad err dY/W | wgrad err dY/X | "
              "dY underflow dgrad/wgrad | cosine f/d/w | collapse max | update ratio | "
              "instability |")
    lines = [f"# Ladder `{cfg.name}`", "", intro, "",
             "## Table 1 layout (overhead vs baseline; paper's value in brackets)", "",
             R.paper_table(results), "", note, "",
             "## Other policies", "", R.extra_table(results), "",
             "## Per policy", "", R.details_table(results, outcomes, cfg.policies), "",
             "## Diagnostics", "", diag_intro, "", header, "|---" * 10 + "|"]

    def instability_cell(key) -> str:
        st = instab.get(key)
        if st is None or st.event_step is None:
            return "—"
        return f"step {st.event_step} ({st.event_kind})"

    for (p, s), d in diag_rows.items():
        cos = " / ".join(_fmt(d.get(f"diag/{g}/cosine"), ".4f") for g in R.GEMMS)
        und_d, und_w = (_fmt(d.get(f"diag/{g}/lhs_underflow")) for g in ("dgrad", "wgrad"))
        und = f"{und_d} / {und_w}"
        lines.append(f"| {p} | {s} | {_pair(d, 'fprop')} | {_pair(d, 'dgrad')} | "
                     f"{_pair(d, 'wgrad')} | {und} | {cos} | "
                     f"{_fmt(d.get('grad_collapse_rate_max'))} | "
                     f"{_fmt(d.get('update_ratio_mean'), '.2e')} | {instability_cell((p, s))} |")
    for key, st in instab.items():
        if key not in diag_rows and st.event_step is not None:
            lines.append(f"| {key[0]} | {key[1]} | | | | | | | | {instability_cell(key)} |")
    lines += ["", "![eval curves](ladder_curves.png)", ""]
    return "\n".join(lines)
