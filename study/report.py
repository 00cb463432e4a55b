"""The ladder study's report: the arithmetic on the unit records, tables and plots.

`analyze(cfg)` reads every record under the study's output directory and
returns a JSON-able dict; `write_report(cfg)` also writes ``ladder.md``,
``ladder.json`` and the plots there. Intervals are 95% t intervals
(`study.stats`); the unit of replication is stated with each table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from study import policies as study_policies
from study import stats as S
from study.config import StudyConfig, run_config
from study.engine import read_json, write_json

# The fewest seeds (fixed budget) or replicates (branches) whose interval widths the
# report compares: below it a 95% t interval's width is mostly its quantile's.
MIN_SAMPLES = 3

PAPER = {  # the paper's Table 1 (tokens over the FP8 baseline), for the side-by-side
    "mxfp4_fprop": "8–9%", "mxfp4_fprop_dgrad": "10–11%", "mxfp4_all": "26–27%",
    "mxfp4_all_sr": "does not converge", "mxfp4_all_rht16": "does not converge",
    "mxfp4_all_h16": "8–9%", "mxfp4_all_h32": "8–9% (H16 or 32)",
}


# --------------------------------------------------------------------------- loading
def load_runs(root: Path, width: int) -> dict[str, dict[int, dict[str, Any]]]:
    """{policy: {seed: record}} of the fixed-budget runs at `width`."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for f in sorted((root / f"w{width}" / "runs").glob("*/seed*.json")):
        r = read_json(f)
        out.setdefault(r["policy"], {})[r["seed"]] = r
    return out


def load_branches(root: Path, width: int) -> dict[tuple[int, int, int], dict[str, Any]]:
    """{(seed, point, batch_set): {policy: record}} of the branches at `width`."""
    out: dict[tuple[int, int, int], dict[str, Any]] = {}
    for f in sorted((root / f"w{width}" / "branches").glob("seed*/p*/b*/*.json")):
        r = read_json(f)
        out.setdefault((r["seed"], r["point"], r["batch_set"]), {})[r["policy"]] = r
    return out


# --------------------------------------------------------------------------- analysis
def _iv(iv: S.Interval) -> dict[str, float]:
    return {"mean": iv.mean, "low": iv.low, "high": iv.high, "n": iv.n, "sd": iv.sd}


def _oh(t: tuple[float, float, float]) -> dict[str, float]:
    return {"overhead": t[0], "low": t[1], "high": t[2]}


def branch_table(branches: Mapping[tuple[int, int, int], Mapping[str, Any]], reference: str,
                 baseline: str | None, late_from: int) -> dict[str, Any]:
    """Per policy: efficiency, overhead vs exact and vs `baseline`, by phase (all/early/late).

    One replicate = one (seed, branch point, batch set). Checks the pairing: every
    branch of a replicate must have consumed the same batches and keys.
    """
    reps = []
    for key, recs in sorted(branches.items()):
        if reference not in recs:
            continue
        ex = recs[reference]
        digests = {p: r["batch_digest"] for p, r in recs.items()}
        if len(set(digests.values())) != 1:
            raise ValueError(f"branch replicate {key}: the branches did not see the same "
                             f"batches and keys: {digests}")
        ks = [k for k, _ in ex["curve"]]
        ls = [v for _, v in ex["curve"]]
        l0 = ls[0]
        dec = [l0 - v for v in ls]
        row = {"seed": key[0], "point": key[1], "batch_set": key[2], "start_loss": l0,
               "exact": {"steps": ks, "decrease": dec}, "policies": {}}
        for p, r in recs.items():
            if p == reference:
                continue
            d = l0 - r["curve"][-1][1]
            eff, cens = S.efficiency(ks, dec, d, r["steps"])
            k_idx = ks.index(r["steps"]) if r["steps"] in ks else None
            row["policies"][p] = {
                "decrease": d, "efficiency": eff, "censored": cens,
                "loss_minus_exact": (r["curve"][-1][1] - ls[k_idx]) if k_idx is not None
                else math.nan, "skipped": r["skipped"]}
        reps.append(row)
    phases = {"all": lambda r: True, "early": lambda r: r["point"] < late_from,
              "late": lambda r: r["point"] >= late_from}
    for pt in sorted({r["point"] for r in reps}):
        phases[f"step{pt}"] = lambda r, pt=pt: r["point"] == pt
    policies = sorted({p for r in reps for p in r["policies"]})
    table: dict[str, Any] = {}
    for p in policies:
        table[p] = {}
        for ph, sel in phases.items():
            rows = [r for r in reps if sel(r) and p in r["policies"]]
            if not rows:
                continue
            eff = [r["policies"][p]["efficiency"] for r in rows]
            oh = S.log_overhead([1.0] * len(eff), eff)[1]
            entry = {"n": len(rows), "efficiency": _iv(S.mean_interval(eff)),
                     "vs_exact": _oh(oh),
                     "loss_minus_exact": _iv(S.mean_interval(
                         [r["policies"][p]["loss_minus_exact"] for r in rows])),
                     "censored": sum(bool(r["policies"][p]["censored"]) for r in rows)}
            if baseline is not None and all(baseline in r["policies"] for r in rows):
                base = [r["policies"][baseline]["efficiency"] for r in rows]
                entry["vs_baseline"] = _oh(S.log_overhead(base, eff)[1])
            # Seeds as the unit: the mean log overhead per seed, then a t interval over seeds.
            by_seed: dict[int, list[float]] = {}
            for r, e in zip(rows, eff):
                by_seed.setdefault(r["seed"], []).append(-math.log(e) if e > 0 else math.nan)
            if len(by_seed) >= 2:
                siv = S.mean_interval([float(np.mean(v)) for v in by_seed.values()])
                entry["vs_exact_by_seed"] = _oh((math.expm1(siv.mean), math.expm1(siv.low),
                                                 math.expm1(siv.high)))
            table[p][ph] = entry
    return {"replicates": reps, "table": table}


def fixed_budget_table(runs: Mapping[str, Mapping[int, Mapping[str, Any]]], reference: str,
                       baseline: str) -> dict[str, Any]:
    """Per policy: final loss, paired differences vs the reference and the baseline (pairs =
    seeds), and token overhead read off the baseline's and the reference's own curves."""
    out: dict[str, Any] = {}
    for p, seeds in runs.items():
        row: dict[str, Any] = {"final": _iv(S.mean_interval(
            [r["final_eval"] for r in seeds.values()])),
            "final_own_forward": _iv(S.mean_interval(
                [r["final_eval_own_forward"] for r in seeds.values()])),
            "skipped": sum(r["skipped"] for r in seeds.values())}
        for tag, other in (("vs_reference", reference), ("vs_baseline", baseline)):
            if other not in runs:
                continue
            common = sorted(set(seeds) & set(runs[other]))
            a = [seeds[s]["final_eval"] for s in common]
            b = [runs[other][s]["final_eval"] for s in common]
            diff = S.paired_interval(a, b)
            row[f"loss_{tag}"] = {**_iv(diff), "separated": diff.excludes(0.0)}
            # Tokens `other` needs to reach this policy's final loss, on its own curve.
            logs, cens = [], 0
            for s in common:
                cur = runs[other][s]["curve"]
                c = S.steps_to_reach([k for k, _ in cur], [v for _, v in cur],
                                     seeds[s]["final_eval"])
                cens += bool(c.censored)
                logs.append(math.log(seeds[s]["steps"] / c.step) if c.step > 0 else math.nan)
            iv = S.mean_interval(logs)
            row[f"tokens_{tag}"] = {**_oh((math.expm1(iv.mean), math.expm1(iv.low),
                                           math.expm1(iv.high))), "censored": cens}
        out[p] = row
    return out


def noise_comparison(fixed: Mapping[str, Any], branch: Mapping[str, Any],
                     policies: Sequence[str]) -> dict[str, Any]:
    """How much narrower the branch measure's interval is than the fixed-budget ladder's, and
    how many seeds the ladder would need for the branch measure's width (both in overhead
    against the reference, over all replicates)."""
    out = {}
    for p in policies:
        f = fixed.get(p, {}).get("tokens_vs_reference")
        b = branch.get(p, {}).get("all", {}).get("vs_exact")
        n_f = fixed.get(p, {}).get("final", {}).get("n", 0)
        n_b = branch.get(p, {}).get("all", {}).get("n", 0)
        if not f or not b:
            continue
        hw_f = (f["high"] - f["low"]) / 2
        hw_b = (b["high"] - b["low"]) / 2
        ratio = hw_f / hw_b if hw_b > 0 else math.nan
        # With fewer than MIN_SAMPLES seeds or replicates a half-width is mostly the t
        # quantile's (12.7 at n = 2), so n x ratio^2 says nothing about seeds.
        enough = min(n_f, n_b) >= MIN_SAMPLES and math.isfinite(ratio)
        out[p] = {"fixed_half_width": hw_f, "branch_half_width": hw_b, "ratio": ratio,
                  "fixed_n": n_f, "branch_n": n_b,
                  "seeds_needed": n_f * ratio ** 2 if enough else None}
    return out


def analyze(cfg: StudyConfig) -> dict[str, Any]:
    """Every number of the report (JSON-able)."""
    root = cfg.out_path
    runs = load_runs(root, cfg.width)
    main_branch = branch_table(load_branches(root, cfg.width), cfg.reference, cfg.baseline,
                               cfg.branch.late_from)
    fixed = fixed_budget_table(runs, cfg.reference, cfg.baseline)
    scale = {}
    for w in sorted((cfg.width,) + tuple(cfg.scale.widths)):
        # The same branch points at every width, so the widths compare like with like.
        branches = {k: v for k, v in load_branches(root, w).items()
                    if k[1] in cfg.scale_points}
        bt = branch_table(branches, cfg.reference, cfg.baseline, cfg.branch.late_from)
        n_params = next((r.get("n_params") for recs in branches.values()
                         for r in recs.values()), None)
        scale[str(w)] = {"n_params": n_params,
                         "table": {p: bt["table"].get(p, {}).get("all") for p in cfg.scale.policies
                                   if p in bt["table"]}}
    probe = read_json(root / "probe.json") if (root / "probe.json").exists() else None
    return {"name": cfg.name, "width": cfg.width, "reference": cfg.reference,
            "baseline": cfg.baseline, "rungs": list(cfg.rungs), "ablations": list(cfg.ablations),
            "branch": main_branch, "fixed_budget": fixed,
            "noise": noise_comparison(fixed, main_branch["table"], cfg.rungs),
            "scale": scale, "probe": probe}


# --------------------------------------------------------------------------- text
def pct(x: float | None, digits: int = 1) -> str:
    if x is None or not math.isfinite(x):
        return "n/a" if x is None or math.isnan(x) else ("+inf" if x > 0 else "-inf")
    return f"{100 * x:+.{digits}f}%"


def pct_iv(d: Mapping[str, float] | None) -> str:
    """'+12.3% [+8.1, +16.6]' from an overhead dict."""
    if not d:
        return "n/a"
    return f"{pct(d['overhead'])} [{pct(d['low'])[:-1]}, {pct(d['high'])[:-1]}]"


def _separated(d: Mapping[str, float] | None) -> str:
    if not d or not (math.isfinite(d["low"]) and math.isfinite(d["high"])):
        return "n/a"
    return "yes" if d["low"] > 0 or d["high"] < 0 else "no"


def _nothing(why: str) -> str:
    """The line a report section shows instead of a table it cannot fill: why not."""
    return f"_Nothing to conclude here: {why}._"


def render(rep: Mapping[str, Any], cfg: StudyConfig) -> str:
    t = rep["branch"]["table"]
    fx = rep["fixed_budget"]
    b = cfg.branch
    lines = [f"# Ladder study `{cfg.name}`", ""]
    n_params = rep["scale"].get(str(cfg.width), {}).get("n_params") or "?"
    backend = run_config(cfg, cfg.width).backend  # the train config's default included
    lines += [
        (f"Model width {cfg.width} ({n_params} "
        f"parameters); {cfg.steps} steps of "
        f"{cfg.run.get('train', {}).get('global_batch', '?')} x "
        f"{cfg.run.get('data', {}).get('seq_len', '?')} tokens; held-out set "
        f"{cfg.eval_sequences} sequences, evaluated with the exact forward. "
        f"Reference `{cfg.reference}`, baseline `{cfg.baseline}`; quantized GEMMs on "
        f"backend `{backend or 'xla'}`"
        f"{' (each chip its fastest exact route)' if backend == 'auto' else ''}."),
        "",
        "## Branch-and-compare (primary measure)", "",
        (f"From the reference runs' states at steps {list(b.points)} (seeds "
        f"{list(cfg.branch_seeds)}, {b.batch_sets} batch set(s)), every policy trains K = "
        f"{b.steps} steps on the same batches and keys; the exact branch trains {b.exact_steps} "
        f"steps, evaluated every {b.exact_eval_every}. Efficiency = exact steps giving the "
        "same held-out loss decrease / K; overhead = 1/efficiency - 1 (geometric mean over "
        "replicates; 95% t interval on the log). One replicate = one (seed, point, batch set); "
        f"early = points < {b.late_from}. 'by seed' averages each seed's replicates first and "
        "takes the interval over seeds (the conservative unit)."), "",
        (f"| policy | overhead vs exact, all | early | late | by seed | vs {cfg.baseline} | "
        "loss - exact after K | separated from exact |"),
        "|---|---|---|---|---|---|---|---|"]
    order = [p for p in list(cfg.rungs) + list(cfg.ablations) if p in t]
    if not order:
        lines.append(_nothing(f"no branch of a rung or ablation was paired with a branch of "
                              f"the reference `{cfg.reference}` (branch.points "
                              f"{list(b.points)}; units not run yet?)"))
    for p in order:
        e = t[p]
        lme = e["all"]["loss_minus_exact"]
        lines.append(
            f"| `{p}` | {pct_iv(e['all']['vs_exact'])} | "
            f"{pct_iv(e.get('early', {}).get('vs_exact'))} "
            f"| {pct_iv(e.get('late', {}).get('vs_exact'))} | "
            f"{pct_iv(e['all'].get('vs_exact_by_seed'))} | {pct_iv(e['all'].get('vs_baseline'))} "
            f"| {lme['mean']:+.4f} ± {(lme['high'] - lme['low']) / 2:.4f} | "
            f"{_separated(e['all']['vs_exact'])} |")
    points = sorted(cfg.branch.points)
    lines += ["", "By branch point (overhead vs exact, replicates = seeds):", "",
              "| policy | " + " | ".join(f"from step {pt}" for pt in points) + " |",
              "|---|" + "---|" * len(points)]
    for p in order:
        lines.append(f"| `{p}` | " + " | ".join(
            pct_iv(t[p].get(f"step{pt}", {}).get("vs_exact")) for pt in points) + " |")
    if cfg.ablations:
        lines += ["", "What each ablation changes:", ""]
    for p in cfg.ablations:
        lines.append(f"- `{p}`: {study_policies.describe(p, cfg.custom_policies)}")
    paper_rows = [p for p in PAPER if p in t and t[p].get("all", {}).get("vs_baseline")]
    lines += ["", "## The paper's Table 1 beside this study", ""]
    if not paper_rows:
        lines += [_nothing(f"this study branched none of the paper's configurations "
                           f"({', '.join(PAPER)}) together with its baseline `{cfg.baseline}`; "
                           "add them to rungs (and the baseline to the branches) to compare"),
                  ""]
    else:
        def cell(p: str) -> str:
            e = t.get(p, {}).get("all", {})
            return f"{pct_iv(e.get('vs_baseline'))} (paper {PAPER.get(p, '?')})"

        lines += [
            (f"Overhead vs `{cfg.baseline}` from branch-and-compare (all replicates) | the "
             "paper's figure:"), "",
            "| configuration | Fprop | +Dgrad | +Wgrad |", "|---|---|---|---|",
            (f"| no stabilization | {cell('mxfp4_fprop')} | {cell('mxfp4_fprop_dgrad')} | "
             f"{cell('mxfp4_all')} |"),
            f"| stochastic rounding | | | {cell('mxfp4_all_sr')} |",
            f"| randomized Hadamard 16 | | | {cell('mxfp4_all_rht16')} |",
            (f"| deterministic Hadamard 16 / 32 | | | {cell('mxfp4_all_h16')} / "
             f"{cell('mxfp4_all_h32')} |"), ""]
    lines += ["## Fixed-budget ladder (end-to-end check)", "",
              (f"Every policy trains {cfg.steps} steps from the same init per seed "
              f"({list(cfg.seeds)}), same batches. Loss differences paired by seed (95% t "
              "interval over seeds); token overhead = the steps the reference (or baseline) "
              "needs on its own curve to reach the policy's final loss; a seed whose policy "
              "ends below that curve's end is censored ('at <= 0': its overhead is negative "
              "by an unknown amount and counts as 0)."), "",
              (f"| policy | final loss | vs {cfg.reference} (paired) | separated | tokens vs "
              f"{cfg.reference} | vs {cfg.baseline} (paired) | separated | tokens vs "
              f"{cfg.baseline} | own-forward loss |"), "|---|---|---|---|---|---|---|---|---|"]
    if not any(p in fx for p in cfg.ladder_policies):
        lines.append(_nothing("no fixed-budget run has finished (units not run yet?)"))
    for p in cfg.ladder_policies:
        if p not in fx:
            continue
        r = fx[p]
        f = r["final"]

        def dl(k: str, r: Mapping[str, Any] = r) -> tuple[str, str]:
            d = r.get(f"loss_{k}")
            if not d or d["n"] < 2 or not math.isfinite(d["low"]):
                return "—", "—"
            return (f"{d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]",
                    "yes" if d["separated"] else "no")

        def tok(k: str, r: Mapping[str, Any] = r) -> str:
            d = r.get(f"tokens_{k}")
            if not d:
                return "—"
            c = f" ({d['censored']} at <= 0)" if d["censored"] else ""
            return pct_iv(d) + c

        a, sa = dl("vs_reference")
        bb, sb = dl("vs_baseline")
        lines.append(f"| `{p}` | {f['mean']:.4f} ± {(f['high'] - f['low']) / 2:.4f} | {a} | {sa} "
                     f"| {tok('vs_reference')} | {bb} | {sb} | {tok('vs_baseline')} | "
                     f"{r['final_own_forward']['mean']:.4f} |")
    nz = rep["noise"]
    if nz:
        lines += ["", "## How much less noisy the branch measure is", "",
                  ("Half-width of the 95% interval on overhead vs the reference: fixed-budget "
                  "(seeds) vs branch-and-compare (replicates); 'seeds needed' = seeds the "
                  "fixed-budget ladder would need for the branch measure's width "
                  "(n x ratio^2)."), "",
                  "| policy | fixed-budget ± | branch ± | ratio | seeds needed |",
                  "|---|---|---|---|---|"]
        for p, d in nz.items():
            needed = (f"{d['seeds_needed']:.0f}" if d.get("seeds_needed") is not None else
                      f"n/a ({d.get('fixed_n', '?')} seeds, {d.get('branch_n', '?')} "
                      "replicates)")
            lines.append(f"| `{p}` | {100 * d['fixed_half_width']:.1f} pp | "
                         f"{100 * d['branch_half_width']:.1f} pp | {d['ratio']:.1f} | "
                         f"{needed} |")
        if any(d.get("seeds_needed") is None for d in nz.values()):
            lines += ["", _nothing(f"'seeds needed' wants at least {MIN_SAMPLES} seeds and "
                                   f"{MIN_SAMPLES} branch replicates: with fewer, a 95% t "
                                   "interval's width is mostly its quantile's (12.7 at 2) and "
                                   "the ratio of two such widths says nothing about seeds")]
    lines += ["", "## Scale trend (branch-and-compare, overhead vs exact)", ""]
    if not cfg.scale.widths:
        lines.append(_nothing("scale.widths is empty: a single width shows no trend (set "
                              "scale.widths, e.g. [64, 256], to measure one)"))
    lines += [
              (f"Replicates: seeds {list(cfg.scale.seeds)} x points {list(cfg.scale_points)} at "
              f"the other widths; at width {cfg.width}, its branch seeds at the same points."),
              "",
              "| policy | " + " | ".join(f"d {w} ({rep['scale'][w]['n_params'] or '?'} params)"
                                         for w in rep["scale"]) + " |",
              "|---|" + "---|" * len(rep["scale"])]
    for p in cfg.scale.policies:
        cells = [pct_iv((rep["scale"][w]["table"].get(p) or {}).get("vs_exact"))
                 for w in rep["scale"]]
        lines.append(f"| `{p}` | " + " | ".join(cells) + " |")
    lines += render_probe(rep.get("probe"))
    lines += ["", "![overhead per policy, early vs late](ladder_overhead.png)", "",
              "![scale trend](ladder_scale.png)", "", "![fixed-budget curves](ladder_curves.png)",
              ""]
    return "\n".join(lines)


PROBE_COLUMNS = (("rel_err", "out err"), ("gain", "gain"), ("err_corr_batches", "err corr"),
                 ("lhs_rel_err", "dY err"), ("rhs_rel_err", "X err"),
                 ("rhs_common_share", "X common"), ("rhs_common_err", "X common err"),
                 ("rhs_noncommon_err", "X rest err"), ("rhs_flush", "X flushed"))


def render_probe(probe: Mapping[str, Any] | None) -> list[str]:
    """The mechanism probe's Wgrad rows (study.probe) as markdown."""
    if not probe:
        return []
    lines = ["", "## Mechanism probe (Wgrad GEMM at fixed reference states)", "",
             (f"Reference states of seed {probe['seed']}; two batches each. out err = "
             "|Q - exact|/|exact| of the Wgrad output; gain = <Q, exact>/|exact|^2; err corr = "
             "cosine of the output error between the two batches (an error that repeats "
             "step after step); X common = energy share of X's 16-token block means (the "
             "operand Wgrad sums over tokens); X common err / X rest err = X's quantization "
             "error inside / outside that subspace (rotation undone); X flushed = share of "
             "nonzero X entries quantized to 0. Energy-weighted over projections and layers."), ""]
    for point, pr in probe["points"].items():
        lines += [f"Step {point}:", "",
                  "| policy | fprop err | dgrad err | " + " | ".join(c[1] for c in PROBE_COLUMNS)
                  + " |", "|---|---|---|" + "---|" * len(PROBE_COLUMNS)]
        for name, p in pr["policies"].items():
            agg = p["aggregate"]

            def f(x: Any) -> str:
                return "—" if x is None else f"{x:.3f}"

            lines.append(f"| `{name}` | {f(agg.get('fprop', {}).get('rel_err'))} | "
                         f"{f(agg.get('dgrad', {}).get('rel_err'))} | "
                         + " | ".join(f(agg.get("wgrad", {}).get(c[0])) for c in PROBE_COLUMNS)
                         + " |")
        rot, agree, flips, n_sites = 0.0, 0.0, 0.0, 0
        for p in pr["policies"].values():
            for rows in p.get("per_gemm", {}).values():
                for row in rows.values():
                    devs = [row.get(k) for k in ("ref_dev", "ref32_dev")
                            if row.get(k) is not None]
                    if not devs:
                        continue
                    n_sites += 1
                    agree = max(agree, min(devs))
                    rot = max(rot, row.get("rot_only_dev") or 0.0)
                    flips = max(flips, row.get("ref_flips") or 0.0)
        if n_sites:
            lines += ["", (f"Implementation check at {n_sites} GEMM call sites (every "
                           "projection, layer, GEMM and policy): the rotation without "
                           f"quantization matches the exact product to {rot:.1e} (max relative "
                           "deviation); the policy's GEMM matches a reference assembled from "
                           "fake_quantize and a float64 product, with the rotation done in "
                           f"float64 or in fp32, to {agree:.1e} (the better of the two at each "
                           "site; the two rotations put at most "
                           f"{100 * flips:.4f}% of elements on opposite sides of a rounding "
                           "boundary).")]
        lines.append("")
    return lines


# --------------------------------------------------------------------------- plots
def plot(rep: Mapping[str, Any], cfg: StudyConfig, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = rep["branch"]["table"]
    order = [p for p in list(cfg.rungs) + list(cfg.ablations) if p in t]
    fig, ax = plt.subplots(figsize=(8, 0.38 * len(order) + 1.5))
    for j, (ph, color, dy) in enumerate((("early", "tab:blue", -0.15), ("late", "tab:red", 0.15))):
        for i, p in enumerate(order):
            d = t[p].get(ph, {}).get("vs_exact")
            if not d or not all(math.isfinite(d[k]) for k in ("overhead", "low", "high")):
                continue
            ax.errorbar(100 * d["overhead"], i + dy, xerr=[[100 * (d["overhead"] - d["low"])],
                                                           [100 * (d["high"] - d["overhead"])]],
                        fmt="o", color=color, ms=4, capsize=2, label=ph if i == 0 else None)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(order)), order)
    ax.invert_yaxis()
    ax.set_xlabel(f"token overhead vs exact (%), 95% CI; K = {cfg.branch.steps}")
    ax.legend(loc="lower right")
    ax.set_title(f"{cfg.name}: branch-and-compare, early vs late")
    fig.tight_layout()
    fig.savefig(out / "ladder_overhead.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    widths = sorted(int(w) for w in rep["scale"])
    for p in cfg.scale.policies:
        xs, ys, lo, hi = [], [], [], []
        for w in widths:
            d = (rep["scale"][str(w)]["table"].get(p) or {}).get("vs_exact")
            if d and all(math.isfinite(d[k]) for k in ("overhead", "low", "high")):
                xs.append(w)
                ys.append(100 * d["overhead"])
                lo.append(100 * (d["overhead"] - d["low"]))
                hi.append(100 * (d["high"] - d["overhead"]))
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=p)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("model width (dim)")
    ax.set_ylabel("token overhead vs exact (%)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.set_title("scale trend (branch-and-compare)")
    fig.tight_layout()
    fig.savefig(out / "ladder_scale.png", dpi=120)
    plt.close(fig)

    runs = load_runs(cfg.out_path, cfg.width)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in cfg.ladder_policies:
        if p not in runs:
            continue
        curves = [r["curve"] for r in runs[p].values()]
        ks = [k for k, _ in curves[0]]
        if any([k for k, _ in c] != ks for c in curves):
            continue
        mean = np.mean([[v for _, v in c] for c in curves], axis=0)
        ax.plot(ks[1:], mean[1:], marker=".", label=f"{p} ({len(curves)} seeds)")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (exact forward), mean over seeds")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.set_title(f"{cfg.name}: fixed-budget ladder")
    fig.tight_layout()
    fig.savefig(out / "ladder_curves.png", dpi=120)
    plt.close(fig)


def write_report(cfg: StudyConfig) -> dict[str, Any]:
    """Writes ladder.md, ladder.json and the plots into the study's directory; returns the
    report dict."""
    out = cfg.out_path
    rep = analyze(cfg)
    write_json(out / "ladder.json", rep)
    (out / "ladder.md").write_text(render(rep, cfg))
    plot(rep, cfg, out)
    return rep
