"""The ladder's arithmetic, tables and plots (pure; no JAX, no training).

Definitions (all in tokens, per run = one policy and one seed):

* **Eval curve**: the run's evaluations ``(tokens, eval_loss)`` in token order
  (step 0 is the evaluation before training).
* **Tokens to target**: the first crossing of the target by the eval curve,
  linearly interpolated between the two evaluations around it. If the first
  evaluation ``i`` with ``loss_i <= target`` has a predecessor,
  ``t* = t_{i-1} + (loss_{i-1} - target) · (t_i - t_{i-1}) / (loss_{i-1} - loss_i)``;
  if it is the first evaluation, ``t* = t_i``. Scanning stops at the first
  non-finite loss.
* **Outcome** of a run, judged on the curve up to its first crossing:
  ``converged`` if the target is reached within ``max_tokens`` (the budget,
  ``budget_multiple ×`` the baseline's budget); otherwise ``diverged`` if an
  eval loss is non-finite or above ``diverge_loss``, or the run was stopped by
  the trainer's non-finite guard; otherwise ``not_converged``.
* **Overhead** of a run: ``t*_run / t*_baseline(same seed) − 1`` (paired by
  seed, since a seed fixes initialization and data order for every policy; the
  mean baseline over seeds is used when the seed has no baseline run that
  converged). Per policy: mean and sample standard deviation (ddof 1; 0 for a
  single seed) over the seeds that converged.
* A policy **does not converge** when none of its seeds converges; when some
  do, the cell gives their overhead and says how many did not.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

# Figures are drawn without pyplot (no global backend or figure registry to touch).
from matplotlib.figure import Figure

__all__ = [
    "EXTRA_POLICIES",
    "PAPER_COLUMNS",
    "PAPER_LAYOUT",
    "PAPER_ROWS",
    "Curve",
    "PolicyResult",
    "RunOutcome",
    "as_float",
    "classify_run",
    "details_table",
    "extra_table",
    "format_cell",
    "paper_table",
    "plot_curves",
    "plot_run_diagnostics",
    "summarize_policy",
    "tokens_to_target",
]

Curve = Sequence[tuple[float, float]]  # [(tokens, eval_loss)], sorted by tokens


def as_float(v: Any) -> float:
    """A metrics value as float; the JSONL writes NaN/Inf as 'nan'/'inf'/'-inf'; None is NaN."""
    if v is None:
        return math.nan
    if isinstance(v, str):
        return float(v)  # float('nan'), float('inf'), float('-inf') all parse
    return float(v)


def _check_curve(curve: Curve) -> list[tuple[float, float]]:
    pts = [(float(t), as_float(v)) for t, v in curve]
    for (t0, _), (t1, _) in itertools.pairwise(pts):
        if not t1 > t0:
            raise ValueError(f"curve: tokens must increase strictly, got {t0} then {t1}")
    return pts


def tokens_to_target(curve: Curve, target: float) -> float | None:
    """Tokens at which the eval curve first reaches ``target`` (interpolated), or None.

    Args:
      curve: [(tokens, eval_loss)], tokens strictly increasing.
      target: eval loss to reach (reached when ``loss <= target``).
    """
    if not math.isfinite(target):
        raise ValueError(f"target: must be finite, got {target}")
    pts = _check_curve(curve)
    prev = None
    for t, v in pts:
        if not math.isfinite(v):
            return None
        if v <= target:
            if prev is None:
                return t
            t0, v0 = prev
            return t0 + (v0 - target) * (t - t0) / (v0 - v)
        prev = (t, v)
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """One run's result. ``status``: 'converged', 'not_converged' or 'diverged'."""

    policy: str
    seed: int
    status: str
    tokens_to_target: float | None
    final_eval_loss: float | None
    tokens_trained: float
    reason: str = ""


def classify_run(curve: Curve, *, target: float, max_tokens: float,
                 diverge_loss: float | None = None, stopped_nonfinite: bool = False,
                 policy: str = "", seed: int = 0) -> RunOutcome:
    """Outcome of one run (see the module docstring for the rules)."""
    if not max_tokens > 0:
        raise ValueError(f"max_tokens: must be > 0, got {max_tokens}")
    pts = _check_curve(curve)
    t_star = tokens_to_target(pts, target)
    final = pts[-1][1] if pts else None
    trained = pts[-1][0] if pts else 0.0
    if t_star is not None and t_star <= max_tokens:
        return RunOutcome(policy=policy, seed=seed, status="converged", tokens_to_target=t_star,
                          final_eval_loss=final, tokens_trained=trained)
    upto = [v for t, v in pts if t_star is None or t <= t_star]
    bad = [v for v in upto if not math.isfinite(v)
           or (diverge_loss is not None and v > diverge_loss)]
    if bad or stopped_nonfinite:
        if stopped_nonfinite:
            why = "stopped by the non-finite loss/gradient guard"
        elif not math.isfinite(bad[0]):
            why = "eval loss became non-finite"
        else:
            why = f"eval loss {bad[0]:.4f} rose above {diverge_loss:.4f}"
        return RunOutcome(policy=policy, seed=seed, status="diverged", tokens_to_target=None,
                          final_eval_loss=final, tokens_trained=trained, reason=why)
    if t_star is None:
        why = f"target {target:.4f} not reached in {trained:.0f} tokens"
    else:
        why = f"target reached at {t_star:.0f} tokens, beyond the budget {max_tokens:.0f}"
    return RunOutcome(policy=policy, seed=seed, status="not_converged", tokens_to_target=None,
                      final_eval_loss=final, tokens_trained=trained, reason=why)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyResult:
    """Per-policy aggregate over seeds (overheads as fractions, e.g. 0.08 = +8%)."""

    policy: str
    n_seeds: int
    n_converged: int
    n_diverged: int
    tokens_mean: float | None
    tokens_std: float | None
    overhead_mean: float | None
    overhead_std: float | None
    overheads: tuple[float, ...]
    final_loss_mean: float | None

    @property
    def status(self) -> str:
        if self.n_converged == self.n_seeds:
            return "converged"
        if self.n_converged == 0:
            return "does not converge"
        return "partial"


def _mean_std(xs: Sequence[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    a = np.asarray(xs, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def summarize_policy(outcomes: Sequence[RunOutcome], baseline: Sequence[RunOutcome]
                     ) -> PolicyResult:
    """Aggregates one policy's runs against the baseline's runs (paired by seed)."""
    if not outcomes:
        raise ValueError("outcomes: no runs given")
    names = {o.policy for o in outcomes}
    if len(names) != 1:
        raise ValueError(f"outcomes: expected runs of one policy, got {sorted(names)}")
    base_by_seed = {b.seed: b.tokens_to_target for b in baseline if b.status == "converged"}
    base_mean = float(np.mean(list(base_by_seed.values()))) if base_by_seed else None
    conv = [o for o in outcomes if o.status == "converged"]
    toks = [o.tokens_to_target for o in conv]
    overheads = []
    for o in conv:
        ref = base_by_seed.get(o.seed, base_mean)
        if ref is not None and ref > 0:
            overheads.append(o.tokens_to_target / ref - 1.0)
    t_mean, t_std = _mean_std(toks)
    o_mean, o_std = _mean_std(overheads)
    finals = [o.final_eval_loss for o in outcomes
              if o.final_eval_loss is not None and math.isfinite(o.final_eval_loss)]
    return PolicyResult(
        policy=next(iter(names)), n_seeds=len(outcomes), n_converged=len(conv),
        n_diverged=sum(o.status == "diverged" for o in outcomes), tokens_mean=t_mean,
        tokens_std=t_std, overhead_mean=o_mean, overhead_std=o_std,
        overheads=tuple(overheads), final_loss_mean=float(np.mean(finals)) if finals else None)


def format_cell(r: PolicyResult | None) -> str:
    """Table cell: '+8.3% ± 1.2', 'does not converge', or the overhead with a note."""
    if r is None:
        return "—"
    if r.status == "does not converge" or r.overhead_mean is None:
        return "does not converge" + (" (diverged)" if r.n_diverged == r.n_seeds else "")
    cell = f"{100 * r.overhead_mean:+.1f}% ± {100 * r.overhead_std:.1f}"
    if r.status == "partial":
        cell += f" ({r.n_seeds - r.n_converged}/{r.n_seeds} seeds did not converge)"
    return cell


# --------------------------------------------------------------------------- tables
PAPER_ROWS = ("no stabilization", "stochastic rounding", "randomized Hadamard 16",
              "deterministic Hadamard 16 (32)")
PAPER_COLUMNS = ("Fprop", "+Dgrad", "+Wgrad")
# (row, column) -> presets measured there. The SR/RHT/H presets switch MXFP4 on in
# all three GEMMs, so only their +Wgrad cell is a run of its own.
PAPER_LAYOUT: dict[tuple[str, str], tuple[str, ...]] = {
    ("no stabilization", "Fprop"): ("mxfp4_fprop",),
    ("no stabilization", "+Dgrad"): ("mxfp4_fprop_dgrad",),
    ("no stabilization", "+Wgrad"): ("mxfp4_all",),
    ("stochastic rounding", "+Wgrad"): ("mxfp4_all_sr",),
    ("randomized Hadamard 16", "+Wgrad"): ("mxfp4_all_rht16",),
    ("deterministic Hadamard 16 (32)", "+Wgrad"): ("mxfp4_all_h16", "mxfp4_all_h32"),
}
PAPER_VALUES: dict[tuple[str, str], str] = {
    ("no stabilization", "Fprop"): "8–9%", ("no stabilization", "+Dgrad"): "10–11%",
    ("no stabilization", "+Wgrad"): "26–27%",
    ("stochastic rounding", "Fprop"): "8–9%", ("stochastic rounding", "+Dgrad"): "10–11%",
    ("stochastic rounding", "+Wgrad"): "does not converge",
    ("randomized Hadamard 16", "Fprop"): "8–9%", ("randomized Hadamard 16", "+Dgrad"): "10–11%",
    ("randomized Hadamard 16", "+Wgrad"): "does not converge",
    ("deterministic Hadamard 16 (32)", "+Wgrad"): "8–9%",
}
EXTRA_POLICIES = ("bf16", "mxfp4_wgrad_h16", "nvfp4", "tseng")
GEMMS = ("fprop", "dgrad", "wgrad")


def paper_table(results: Mapping[str, PolicyResult], *, with_paper: bool = True) -> str:
    """Markdown table in the paper's Table 1 layout (measured overhead vs the baseline).

    Cells without a preset of their own show '—'; the H16 (H32) cell shows both.
    With ``with_paper``, each measured cell is followed by the paper's value.
    """
    lines = ["| configuration | " + " | ".join(PAPER_COLUMNS) + " |",
             "|---|" + "---|" * len(PAPER_COLUMNS)]
    for row in PAPER_ROWS:
        cells = []
        for col in PAPER_COLUMNS:
            pols = PAPER_LAYOUT.get((row, col), ())
            got = [p for p in pols if p in results]
            if not got:
                cell = "—"
            elif len(got) == 1:
                cell = format_cell(results[got[0]])
            else:
                cell = " / ".join(f"H{p.rsplit('_h', 1)[-1]}: {format_cell(results[p])}"
                                  for p in got)
            if with_paper and (row, col) in PAPER_VALUES and got:
                cell += f" (paper: {PAPER_VALUES[(row, col)]})"
            cells.append(cell)
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def extra_table(results: Mapping[str, PolicyResult],
                policies: Sequence[str] = EXTRA_POLICIES) -> str:
    """Markdown table of the policies outside the paper's ladder."""
    lines = ["| policy | overhead vs baseline |", "|---|---|"]
    for p in policies:
        if p in results:
            lines.append(f"| {p} | {format_cell(results[p])} |")
    return "\n".join(lines)


def details_table(results: Mapping[str, PolicyResult], outcomes: Sequence[RunOutcome],
                  order: Sequence[str] | None = None) -> str:
    """Markdown table with every policy's per-seed numbers."""
    order = list(order) if order is not None else list(results)
    header = ("| policy | seeds converged | tokens to target (mean ± std) | overhead per seed | "
              "final eval loss (mean) | notes |")
    lines = [header, "|---|---|---|---|---|---|"]
    for p in order:
        if p not in results:
            continue
        r = results[p]
        toks = "—" if r.tokens_mean is None else f"{r.tokens_mean:,.0f} ± {r.tokens_std:,.0f}"
        per = ", ".join(f"{100 * o:+.1f}%" for o in r.overheads) or "—"
        fin = "—" if r.final_loss_mean is None else f"{r.final_loss_mean:.4f}"
        notes = "; ".join(f"seed {o.seed}: {o.status} ({o.reason})" for o in outcomes
                          if o.policy == p and o.status != "converged")
        lines.append(f"| {p} | {r.n_converged}/{r.n_seeds} | {toks} | {per} | {fin} | "
                     f"{notes or '—'} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots
def plot_curves(curves: Mapping[tuple[str, int], Curve], path: str | Path, *,
                target: float | None = None, title: str = "") -> Path:
    """PNG of every run's eval loss against tokens (colour per policy, style per seed)."""
    path = Path(path)
    policies = list(dict.fromkeys(p for p, _ in curves))
    seeds = sorted({s for _, s in curves})
    cmap = matplotlib.colormaps["tab20"]
    styles = ["-", "--", ":", "-."]
    fig = Figure(figsize=(10, 6))
    ax = fig.subplots()
    for (p, s), curve in curves.items():
        pts = [(t, as_float(v)) for t, v in curve]
        pts = [(t, v) for t, v in pts if math.isfinite(v)]
        if not pts:
            continue
        i = policies.index(p) % 20
        color = cmap(2 * i if i < 10 else 2 * (i - 10) + 1)  # the 10 dark tab20 colours first
        ax.plot([t for t, _ in pts], [v for _, v in pts], styles[seeds.index(s) % len(styles)],
                color=color, lw=1.3, label=p if seeds.index(s) == 0 else None)
    if target is not None:
        ax.axhline(target, color="k", lw=0.8, ls=":", label=f"target {target:.4f}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("eval loss (nats/token)")
    finite = [as_float(v) for c in curves.values() for _, v in c if math.isfinite(as_float(v))]
    if finite and target is not None:
        lo = min(finite)
        hi = np.percentile(finite, 90)
        ax.set_ylim(lo - 0.05 * (hi - lo), hi)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(title or "eval loss vs tokens (line style: seed)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


_OPERANDS = (("fprop", "lhs", "fprop X"), ("fprop", "rhs", "fprop W"), ("dgrad", "lhs", "dgrad dY"),
             ("dgrad", "rhs", "dgrad W"), ("wgrad", "lhs", "wgrad dY"), ("wgrad", "rhs", "wgrad X"))


def plot_run_diagnostics(records: Sequence[Mapping[str, Any]], path: str | Path, *,
                         title: str = "") -> Path | None:
    """PNG of one run's numerics diagnostics, from its metrics records.

    Top: relative quantization error and underflow fraction of each GEMM
    operand over training (``diag/<gemm>/<lhs|rhs>_<field>`` fields). Bottom:
    call site × operand heatmaps of the relative error at the first and the last
    evaluation that recorded ``diag_slots``. Returns None (and writes nothing)
    when the records hold no diagnostics.
    """
    rows = [r for r in records if any(str(k).startswith("diag/") for k in r)]
    if not rows:
        return None
    path = Path(path)
    heat = [r for r in records if r.get("diag_slots")]
    fig = Figure(figsize=(13, 9))
    axes = fig.subplots(2, 2)
    steps = [int(r["step"]) for r in rows]
    for ax, field, label in ((axes[0, 0], "rel_err", "relative error ‖Q(x)−x‖/‖x‖"),
                             (axes[0, 1], "underflow", "underflow (nonzero → 0)")):
        for gemm, side, name in _OPERANDS:
            key = f"diag/{gemm}/{side}_{field}"
            ys = [as_float(r.get(key)) for r in rows]
            if all(math.isnan(y) for y in ys):
                continue
            ax.plot(steps, ys, label=name, lw=1.2,
                    ls="-" if side == "lhs" else "--")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    picks = [heat[0], heat[-1]] if len(heat) >= 2 else heat[:1]
    for ax in axes[1][len(picks):]:
        ax.axis("off")
    for ax, rec in zip(axes[1], picks):
        slots = rec["diag_slots"]
        labels = list(slots)
        mat = np.full((len(labels), len(_OPERANDS)), np.nan)
        for i, lab in enumerate(labels):
            for j, (gemm, side, _) in enumerate(_OPERANDS):
                v = slots[lab].get(gemm, {}).get(f"{side}_rel_err")
                if v is not None:
                    mat[i, j] = as_float(v)
        im = ax.imshow(mat, aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(_OPERANDS)), [n for *_, n in _OPERANDS], rotation=30, fontsize=8)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(f"relative error per call site, step {rec['step']}", fontsize=9)
        fig.colorbar(im, ax=ax)
    fig.suptitle(title or "numerics diagnostics")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
