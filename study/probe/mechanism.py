"""The mechanism probe over policies and batches (`mechanism_probe`), its text table,
and the study's call of it at the branch points (`run_probe`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from models.llama import LlamaConfig
from mxjax.policies import PrecisionPolicy
from mxjax.recipes import GEMMS
from study import config as SC
from study import engine as E
from study import policies as study_policies
from study.probe.analysis import COMMON_BLOCK, analyze_gemm
from study.probe.capture import Sink, capture_gemms, loss_and_grad, probe_config
from study.states import load_state, state_path
from train.process import fetch
from train.step import policy_base_key

__all__ = ["OPERANDS", "PROBE_POLICIES", "error_correlation_sums", "format_table",
           "mechanism_probe", "run_probe", "summarize_row"]

OPERANDS = {"fprop": ("X", "W"), "dgrad": ("dY", "W"), "wgrad": ("dY", "X")}


_CHECKS = ("rot_only_dev", "ref_dev", "ref32_dev", "ref_flips")


def _ratio(num: float, den: float) -> float | None:
    return None if den <= 0 else float(num / den)


def error_correlation_sums(errs: Sequence[np.ndarray]) -> tuple[float, float, float] | None:
    """``(sum <E_i, E_j>, sum |E_i|^2, sum |E_j|^2)`` over all pairs i < j of error
    matrices (None for fewer than two); their ratio is ``err_corr_batches``."""
    if len(errs) < 2:
        return None
    pairs = [(errs[i], errs[j]) for i in range(len(errs)) for j in range(i + 1, len(errs))]
    if any(x.shape != y.shape for x, y in pairs):
        return None
    return (sum(float(np.sum(x * y)) for x, y in pairs),
            sum(float(np.sum(x * x)) for x, _ in pairs),
            sum(float(np.sum(y * y)) for _, y in pairs))


def summarize_row(s: Mapping[str, float], corr: tuple[float, float, float] | None
                  ) -> dict[str, Any]:
    """One row of fields from the sums of :func:`analyze_gemm` (added over batches and/or
    call sites: energy-weighted) and :func:`error_correlation_sums` (or None)."""
    row = {
        "rel_err": _ratio(math.sqrt(s["s_err2"]), math.sqrt(s["s_exact2"])),
        "gain": _ratio(s["s_out_exact"], s["s_exact2"]),
        "err_cos": _ratio(s["s_err_exact"], math.sqrt(s["s_err2"] * s["s_exact2"])),
        "err_corr_batches": None if corr is None else _ratio(corr[0], math.sqrt(corr[1] * corr[2])),
    }
    for side in ("lhs", "rhs"):
        g = lambda n, side=side: s[f"s_{side}_{n}"]
        row.update({
            f"{side}_rel_err": _ratio(math.sqrt(g("err2")), math.sqrt(g("x2"))),
            f"{side}_common_share": _ratio(g("common2"), g("x2")),
            f"{side}_noncommon_err": _ratio(math.sqrt(g("err_noncommon2")),
                                            math.sqrt(g("noncommon2"))),
            f"{side}_common_err": _ratio(math.sqrt(g("err_common2")), math.sqrt(g("common2"))),
            f"{side}_flush": _ratio(g("flushed"), g("nz")),
            f"{side}_flushed_energy": _ratio(g("flushed2"), g("rot2")),
        })
    return row


def _add(acc: dict[str, float], s: Mapping[str, float]) -> None:
    for k, v in s.items():
        acc[k] = acc.get(k, 0.0) + v


def _max_opt(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


def mechanism_probe(model_config: LlamaConfig, params: dict, batches: Sequence[np.ndarray],
                    policies: Mapping[str, PrecisionPolicy], *, key_seed: int = 0,
                    impl_check: bool = True) -> dict[str, Any]:
    """Per policy, per GEMM kind and call site: bias, cross-batch error correlation,
    common-component measures and the implementation checks (module docstring).

    Args:
      model_config: the Llama config the parameters belong to.
      params: pure parameter dict (``train.state``'s ``params``), fixed.
      batches: int32[B, T+1] token batches (>= 2 for ``err_corr_batches``; all the
        same shape).
      policies: name -> PrecisionPolicy (quantizing; a pass-through policy has no
        quantized GEMM and gives empty tables).
      key_seed: randomized policies use ``fold_in(policy_base_key(key_seed), i)``
        on batch ``i`` (a different key per batch, as per step in training).
      impl_check: compute the implementation checks (three extra products per rotated
        GEMM, one per plain one); False saves about a third of the host time.
    Returns:
      JSON-able dict: ``{"policies": {name: {"loss": [per batch], "aggregate":
      {kind: row}, "per_gemm": {label: {kind: row}}, "impl_check": {...}}},
      "operands": {kind: [lhs, rhs] names}, "n_batches", "key_seed",
      "common_block"}``. A row holds ``rel_err``, ``gain``, ``err_cos``,
      ``err_corr_batches`` (mean over batch pairs, energy-weighted),
      ``{lhs,rhs}_{rel_err, common_share, noncommon_err, common_err, flush,
      flushed_energy}`` and, per call site, ``rot_only_dev``, ``ref_dev``,
      ``ref32_dev``, ``ref_flips`` (max over batches; ``impl_check`` holds their
      maxima per GEMM kind and overall). Aggregates pool the sums over call sites (energy-weighted
      means).
    """
    if not isinstance(model_config, LlamaConfig):
        raise TypeError(f"model_config: expected a LlamaConfig, got {type(model_config).__name__}")
    batches = [np.asarray(bt) for bt in batches]
    if not batches:
        raise ValueError("batches: expected at least one int32[B, T+1] batch")
    for i, bt in enumerate(batches):
        if bt.ndim != 2 or not np.issubdtype(bt.dtype, np.integer) or bt.shape[1] < 2:
            raise ValueError(f"batches[{i}]: expected int[B, T+1] with T >= 1, got "
                             f"{bt.dtype}{list(bt.shape)}")
        if bt.shape != batches[0].shape:
            raise ValueError(f"batches[{i}]: shape {bt.shape} differs from batches[0] "
                             f"{batches[0].shape}")
    if not isinstance(policies, Mapping) or not policies:
        raise ValueError("policies: expected a non-empty mapping name -> PrecisionPolicy")
    base = policy_base_key(key_seed)
    cfg = probe_config(model_config)
    result: dict[str, Any] = {}
    for name, policy in policies.items():
        if not isinstance(policy, PrecisionPolicy):
            raise TypeError(f"policies[{name!r}]: expected a PrecisionPolicy, got "
                            f"{type(policy).__name__}")
        sink = Sink()
        fn = loss_and_grad(cfg, policy, sink)
        losses = []
        sums: dict[tuple[str, str], dict[str, float]] = {}
        errs: dict[tuple[str, str], list[np.ndarray]] = {}
        checks: dict[tuple[str, str], dict[str, float | None]] = {}
        for i, bt in enumerate(batches):
            key = jax.random.fold_in(base, i)
            loss, caps = capture_gemms(model_config, params, bt, policy, key, _fn=fn,
                                       _sink=sink)
            losses.append(loss)
            for cap in caps:
                at = (cap.label, cap.kind)
                res = analyze_gemm(cap, impl_check=impl_check)
                _add(sums.setdefault(at, {}), res["sums"])
                errs.setdefault(at, []).append(res["err"])
                c = checks.setdefault(at, dict.fromkeys(_CHECKS))
                for f in _CHECKS:
                    c[f] = _max_opt(c[f], res[f])
        per_gemm: dict[str, dict[str, Any]] = {}
        agg_sums: dict[str, dict[str, float]] = {}
        agg_corr: dict[str, list[float]] = {}
        for (label, kind), s in sums.items():
            e = errs[(label, kind)]
            corr = error_correlation_sums(e)
            if corr is not None:
                ac = agg_corr.setdefault(kind, [0.0, 0.0, 0.0])
                for j in range(3):
                    ac[j] += corr[j]
            row = summarize_row(s, corr)
            row.update(checks[(label, kind)])
            per_gemm.setdefault(label, {})[kind] = row
            _add(agg_sums.setdefault(kind, {}), s)
        aggregate = {kind: summarize_row(agg_sums[kind], tuple(agg_corr[kind])
                                      if kind in agg_corr else None)
                     for kind in GEMMS if kind in agg_sums}
        impl = {f"{kind}_{c}": _max_of(per_gemm, kind, c) for kind in GEMMS for c in _CHECKS}
        impl.update({f"max_{c}": _max_of(per_gemm, None, c) for c in _CHECKS})
        result[name] = {"loss": losses, "aggregate": aggregate, "per_gemm": per_gemm,
                        "impl_check": impl}
    return {"policies": result, "operands": {k: list(v) for k, v in OPERANDS.items()},
            "n_batches": len(batches), "key_seed": key_seed, "common_block": COMMON_BLOCK}


def _max_of(per_gemm, kind, field):
    vals = [row[field] for rows in per_gemm.values() for k, row in rows.items()
            if (kind is None or k == kind) and row.get(field) is not None]
    return max(vals) if vals else None


def format_table(probe: Mapping[str, Any]) -> str:
    """The aggregate rows of :func:`mechanism_probe` as a text table (one line per
    policy and GEMM kind)."""
    cols = ("rel_err", "gain", "err_cos", "err_corr_batches", "lhs_rel_err", "rhs_rel_err",
            "lhs_common_share", "rhs_common_share", "lhs_common_err", "rhs_common_err",
            "lhs_noncommon_err", "rhs_noncommon_err", "lhs_flush", "rhs_flush")
    short = {"err_corr_batches": "err_corr", "lhs_common_share": "l_cshare",
             "rhs_common_share": "r_cshare", "lhs_common_err": "l_cerr", "rhs_common_err": "r_cerr",
             "lhs_noncommon_err": "l_ncerr", "rhs_noncommon_err": "r_ncerr",
             "lhs_rel_err": "l_rel", "rhs_rel_err": "r_rel", "lhs_flush": "l_flush",
             "rhs_flush": "r_flush"}
    width = max([16] + [len(n) for n in probe["policies"]])
    head = [f"{'policy':<{width}}", "gemm "] + [f"{short.get(c, c):>8}" for c in cols]
    lines = [" ".join(head)]
    for name, p in probe["policies"].items():
        for kind, row in p["aggregate"].items():
            vals = ["-" if row[c] is None else f"{row[c]:.4f}" for c in cols]
            lines.append(" ".join([f"{name:<{width}}", f"{kind:5}"] + [f"{v:>8}" for v in vals]))
    return "\n".join(lines)


PROBE_POLICIES = ("mxfp4_all", "mxfp4_all_h16", "mxfp4_all_rht16", "mxfp4_all_h32",
                  "mxfp4_all_h16_wgrad", "mxfp4_wgrad_only_h16")


def run_probe(cfg: SC.StudyConfig, out: Path) -> dict[str, Any]:
    """`mechanism_probe` at the first and last branch points (reference
    states of the first branch seed; the two batches that follow each point); writes `out`.

    The implementation checks run at the last point only (they triple the host work).
    """
    compiled = E.make_run(SC.run_config(cfg, cfg.width))
    model_config = compiled.plan.model_config
    seed = cfg.branch_seeds[0]
    pols = {p: study_policies.get(p) for p in PROBE_POLICIES}
    result: dict[str, Any] = {"seed": seed, "policies": list(pols), "points": {}}
    points = sorted(cfg.branch.points)
    for point in (points[0], points[-1]):
        state = load_state(state_path(cfg.out_path, cfg.width, seed, point), compiled)
        loader = compiled.loader(seed)
        batches = [loader.batch(point), loader.batch(point + 1)]
        result["points"][str(point)] = mechanism_probe(
            model_config, fetch(state["params"]), batches, pols, key_seed=seed,
            impl_check=point == points[-1])
    E.write_json(Path(out), result)
    return result
