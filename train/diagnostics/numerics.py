"""Numerics diagnostics of a run: the train-loop hooks and their per-run summaries.

`RunDiagnostics.hooks()` records, in the jitted step, the per-GEMM
quantization statistics (``mxjax.diagnostics``; losses are unchanged),
per-layer gradient norms and relative update sizes, and turns them into compact
fields of each metrics record; a run turns it on with ``diagnostics.enabled``
(`for_run`). `diag_summary` and `instability` read the records back for the
run's summary.json. `llama_slot_labels` names the model's quantized GEMM call
sites (also used by the study's probe).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from models.llama import LlamaConfig
from mxjax import diagnostics as D
from train.diagnostics import dynamics
from train.hooks import Hooks, StepContext

# Compact per-step diagnostics written into metrics.jsonl (means over GEMM call sites).
DIAG_FIELDS = ("lhs_rel_err", "rhs_rel_err", "lhs_underflow", "rhs_underflow",
               "lhs_saturation", "rhs_saturation", "lhs_scale_log2_std", "rhs_scale_log2_std",
               "cosine")
SLOT_FIELDS = ("lhs_rel_err", "rhs_rel_err", "lhs_underflow", "rhs_underflow")


def llama_slot_labels(model_config: LlamaConfig) -> list[str]:
    """Names of the quantized GEMM call sites of ``models.llama.Llama``, in trace order.

    Scanned layers share one call site per projection (``L*.q_proj``); unrolled
    layers get one each (``L0.q_proj``). Order: embedding (with
    ``quantize_embed_head``), per layer q, k, v, [attention scores, values with
    ``quantize_attention``], o, gate, up, down, then the LM head.
    """
    c = model_config
    per = ["q_proj", "k_proj", "v_proj"]
    if c.quantize_attention and c.attention_impl == "explicit":
        per += ["attn_scores", "attn_values"]
    per += ["o_proj", "gate_proj", "up_proj", "down_proj"]
    layers = ["L*"] if c.scan_layers else [f"L{i}" for i in range(c.n_layers)]
    labels = [f"{layer}.{p}" for layer in layers for p in per]
    if c.quantize_embed_head:
        labels = ["embed"] + labels + ["lm_head"]
    return labels


def as_float(v: Any) -> float:
    """A metrics value as float; the JSONL writes NaN/Inf as 'nan'/'inf'/'-inf'; None is NaN."""
    if v is None:
        return math.nan
    if isinstance(v, str):
        return float(v)  # float('nan'), float('inf'), float('-inf') all parse
    return float(v)


def _round(x: float, digits: int = 5) -> float | None:
    if x is None or not math.isfinite(x):
        return None if x is None else x
    return float(f"{x:.{digits}g}")


class RunDiagnostics:
    """Hooks for ``train.loop.run`` that record numerics diagnostics of one run
    (``diagnostics.enabled`` builds them with `for_run`).

    In the jitted step (``in_step``): the per-GEMM stats from
    ``mxjax.diagnostics`` (probes threaded through the quantized GEMMs; the
    loop's ``Hooks.diagnostics``), per-layer gradient norms and relative update
    sizes. On the host (``on_record``) they become compact fields of the
    metrics record — ``diag/<gemm>/<field>`` (means over call sites),
    ``grad_collapse_rate`` (share of layers with grad norm < 1e-6),
    ``grad_norm_layer_min``, ``update_ratio_mean``/``_std``/``_max`` — and, at
    evaluation steps, ``diag_slots`` (call site × GEMM stats, for heatmaps) and
    ``diag_layer_grad_norm``. The raw arrays are dropped from the record.
    """

    def __init__(self, *, labels: Sequence[str] | None = None, cosine: bool = True):
        self.labels = list(labels) if labels is not None else None
        self.cosine = cosine
        self.layout: list[tuple[str, int]] | None = None
        self._warned = False

    def hooks(self) -> Hooks:
        return Hooks(diagnostics=D.DiagnosticsConfig(cosine=self.cosine),
                     in_step=self.in_step, on_record=self.on_record)

    # traced
    def in_step(self, ctx: StepContext) -> dict[str, Any]:
        gn = dynamics.layer_norms(ctx.grads)
        ur = dynamics.relative_update(ctx.params, ctx.new_params)
        self.layout = [(k, int(np.prod(v.shape)) if v.ndim else 0) for k, v in gn.items()]
        return {"diag_gemm": ctx.aux["gemm_stats"],
                "diag_grad_norm": jnp.concatenate([jnp.ravel(v) for v in gn.values()]),
                "diag_update": jnp.concatenate([jnp.ravel(v) for v in ur.values()])}

    def _named(self, vec: Sequence[float]) -> dict[str, float]:
        out, i = {}, 0
        for name, n in self.layout or []:
            if n == 0:
                out[name] = float(vec[i])
                i += 1
            else:
                out[name] = [float(v) for v in vec[i:i + n]]
                i += n
        return dynamics.expand_layers(out)

    # host
    def on_record(self, rec: dict[str, Any]) -> dict[str, Any]:
        if rec.get("diag_gemm") is None:
            return {}
        stats = np.asarray(rec["diag_gemm"], dtype=np.float64)
        if stats.size == 0:  # a pass-through policy (bf16) has no quantized GEMM call site
            stats = stats.reshape(0, 3, D.N_GEMM_FIELDS)
        labels = self.labels
        if labels is None or len(labels) != stats.shape[0]:
            if labels is not None and stats.shape[0] and not self._warned:
                print(f"[train] warning: {stats.shape[0]} quantized GEMM call sites but "
                      f"{len(labels)} labels; using gemm0..gemm{stats.shape[0] - 1}",
                      file=sys.stderr)
                self._warned = True
            labels = [f"gemm{i}" for i in range(stats.shape[0])]
        s = D.summarize_probes(stats, labels, cosine=self.cosine)
        more: dict[str, Any] = {"diag_gemm": None, "diag_grad_norm": None, "diag_update": None}
        for g, row in s["per_gemm"].items():
            for f in DIAG_FIELDS:
                if f in row:
                    more[f"diag/{g}/{f}"] = _round(row[f])
        gn = self._named(rec["diag_grad_norm"])
        ur = self._named(rec["diag_update"])
        if gn:
            vals = np.asarray(list(gn.values()))
            more["grad_collapse_rate"] = _round(dynamics.collapse_rate(vals))
            more["grad_norm_layer_min"] = _round(float(np.nanmin(vals)))
        if ur:
            u = np.asarray(list(ur.values()))
            more["update_ratio_mean"] = _round(float(np.mean(u)))
            more["update_ratio_std"] = _round(float(np.std(u)))
            more["update_ratio_max"] = _round(float(np.max(u)))
        if rec.get("eval_loss") is not None:
            more["diag_slots"] = {
                lab: {g: {f: _round(row[f]) for f in SLOT_FIELDS} for g, row in gs.items()}
                for lab, gs in s["per_slot"].items()}
            more["diag_layer_grad_norm"] = {k: _round(v) for k, v in gn.items()}
        return more


def for_run(model_config: LlamaConfig, *, cosine: bool = True) -> Hooks:
    """The hooks of a run with ``diagnostics.enabled``: `RunDiagnostics` labelled with the
    model's call sites (`llama_slot_labels`)."""
    return RunDiagnostics(labels=llama_slot_labels(model_config), cosine=cosine).hooks()


def diag_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Means of the compact diag fields over the last quarter of a run's records."""
    rows = [r for r in records if r.get("grad_collapse_rate") is not None
            or any(k.startswith("diag/") for k in r)]
    if not rows:
        return {}
    tail = rows[-max(1, len(rows) // 4):]
    keys = sorted({k for r in tail for k in r if k.startswith("diag/")}
                  | {"grad_collapse_rate", "update_ratio_mean", "update_ratio_std"})
    out = {}
    for k in keys:
        vals = [as_float(r[k]) for r in tail if r.get(k) is not None]
        if vals:
            out[k] = float(np.mean(vals))
    coll = [as_float(r["grad_collapse_rate"]) for r in rows
            if r.get("grad_collapse_rate") is not None]
    if coll:
        out["grad_collapse_rate_max"] = float(np.max(coll))
    return out


def instability(records: Sequence[Mapping[str, Any]]):
    """The instability detector's final state over a run's logged grad norms."""
    det = dynamics.InstabilityDetector()
    state = det.init()
    for r in records:
        if r.get("grad_norm") is not None and int(r["step"]) > 0:
            state = det.update(state, int(r["step"]), as_float(r["grad_norm"]))
    return state
