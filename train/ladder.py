"""The paper's MXFP4 ladder in one command: ``python -m train.ladder --config configs/ladder_tiny.yaml``.

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

Outputs in ``<out>``: ``ladder.md`` (the table in the paper's layout, the extra
policies, per-seed details, diagnostics summary), ``ladder.json`` (every
number), ``ladder_curves.png`` (all eval curves), ``target.json``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from train import dynamics
from train import ladder_report as R
from train.config import ConfigError

__all__ = [
    "LADDER_POLICIES",
    "DiagnosticsSection",
    "LadderConfig",
    "RunDiagnostics",
    "llama_slot_labels",
    "load",
    "main",
    "report",
    "run_ladder",
]

LADDER_POLICIES = ("fp8", "mxfp4_fprop", "mxfp4_fprop_dgrad", "mxfp4_all", "mxfp4_all_sr",
                   "mxfp4_all_rht16", "mxfp4_all_h16", "mxfp4_all_h32", "bf16",
                   "mxfp4_wgrad_h16", "nvfp4", "tseng")
_DONE = "ladder_done.json"
# Compact per-step diagnostics written into metrics.jsonl (means over GEMM call sites).
_DIAG_FIELDS = ("lhs_rel_err", "rhs_rel_err", "lhs_underflow", "rhs_underflow",
                "lhs_saturation", "rhs_saturation", "lhs_scale_log2_std", "rhs_scale_log2_std",
                "cosine")
_SLOT_FIELDS = ("lhs_rel_err", "rhs_rel_err", "lhs_underflow", "rhs_underflow")


# --------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True, kw_only=True)
class DiagnosticsSection:
    """Which runs record numerics diagnostics (they cost extra compute, not results)."""

    enabled: bool = True
    seeds: tuple[int, ...] = (0,)
    policies: tuple[str, ...] | None = None  # None: every policy of the ladder
    cosine: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class LadderConfig:
    """A ladder: the policies, seeds and budget, plus the train config every run shares.

    ``run`` is a mapping in the schema of ``train.config`` (``python -m train
    --help``); the ladder sets its ``name``, ``seed``, ``out_dir``, ``policy``,
    ``train.steps`` and ``train.target_eval_loss`` per run, and
    ``optim.decay_steps`` to ``max_steps`` unless given. ``run.jax_cache_dir``
    (the persistent compilation cache) saves most compilations of seeds after
    the first for policies without randomness, and of resumed stages.
    """

    name: str = "ladder"
    out_dir: str | None = None
    baseline: str = "fp8"
    policies: tuple[str, ...] = LADDER_POLICIES
    seeds: tuple[int, ...] = (0, 1)
    baseline_steps: int = 300
    budget_multiple: float = 1.5
    target_eval_loss: float | None = None
    diverge_loss: float | None = None
    diagnostics: DiagnosticsSection = dataclasses.field(default_factory=DiagnosticsSection)
    run: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def out_path(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("runs") / self.name

    @property
    def max_steps(self) -> int:
        return math.ceil(self.budget_multiple * self.baseline_steps - 1e-9)


def _check_keys(raw: Mapping[str, Any], section: type, what: str) -> None:
    """Raises ConfigError naming unknown keys of `raw` (fields of dataclass `section`)."""
    fields = {f.name for f in dataclasses.fields(section)}
    unknown = sorted(set(map(str, raw)) - fields)
    _need(not unknown, f"unknown {what}: {', '.join(unknown)}; valid: {', '.join(sorted(fields))}")


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _ints(v: Any, key: str) -> tuple[int, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v]
    _need(isinstance(v, (list, tuple)) and len(v) > 0
          and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
          f"{key}: expected a non-empty list of integers, got {v!r}")
    _need(len(set(v)) == len(v), f"{key}: repeated entries in {v!r}")
    return tuple(v)


def _num(v: Any, key: str, *, allow_none: bool = False) -> float | None:
    if v is None and allow_none:
        return None
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            pass
    _need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          f"{key}: expected a number, got {v!r}")
    return float(v)


def from_dict(raw: Mapping[str, Any]) -> LadderConfig:
    """Builds and validates a LadderConfig (unknown keys and bad values raise ConfigError)."""
    _need(isinstance(raw, Mapping), f"ladder config must be a mapping, got {type(raw).__name__}")
    _check_keys(raw, LadderConfig, "ladder key(s)")
    kw: dict[str, Any] = {}
    for k in ("name", "baseline"):
        if k in raw:
            _need(isinstance(raw[k], str) and raw[k], f"{k}: expected a non-empty string")
            kw[k] = raw[k]
    if "name" in kw:
        _need("/" not in kw["name"], f"name: must not contain '/', got {kw['name']!r}")
    for k in ("out_dir",):
        if k in raw:
            _need(raw[k] is None or (isinstance(raw[k], str) and raw[k]),
                  f"{k}: expected a path or null, got {raw[k]!r}")
            kw[k] = raw[k]
    if "policies" in raw:
        v = raw["policies"]
        v = [v] if isinstance(v, str) else v
        _need(isinstance(v, (list, tuple)) and v and all(isinstance(p, str) for p in v),
              f"policies: expected a non-empty list of policy names, got {v!r}")
        _need(len(set(v)) == len(v), f"policies: repeated entries in {v!r}")
        kw["policies"] = tuple(v)
    if "seeds" in raw:
        kw["seeds"] = _ints(raw["seeds"], "seeds")
    if "baseline_steps" in raw:
        v = raw["baseline_steps"]
        _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
              f"baseline_steps: expected an integer >= 1, got {v!r}")
        kw["baseline_steps"] = v
    if "budget_multiple" in raw:
        kw["budget_multiple"] = _num(raw["budget_multiple"], "budget_multiple")
        _need(kw["budget_multiple"] >= 1.0,
              f"budget_multiple: must be >= 1, got {kw['budget_multiple']}")
    for k in ("target_eval_loss", "diverge_loss"):
        if k in raw:
            kw[k] = _num(raw[k], k, allow_none=True)
    if "diagnostics" in raw:
        d = raw["diagnostics"]
        _need(isinstance(d, Mapping), f"diagnostics: expected a mapping, got {d!r}")
        _check_keys(d, DiagnosticsSection, "key(s) in diagnostics")
        dkw: dict[str, Any] = {}
        for k in ("enabled", "cosine"):
            if k in d:
                _need(isinstance(d[k], bool), f"diagnostics.{k}: expected true/false")
                dkw[k] = d[k]
        if "seeds" in d:
            dkw["seeds"] = _ints(d["seeds"], "diagnostics.seeds")
        if d.get("policies") is not None:
            v = d["policies"]
            v = [v] if isinstance(v, str) else v
            _need(isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
                  f"diagnostics.policies: expected a list of policy names or null, got {v!r}")
            dkw["policies"] = tuple(v)
        kw["diagnostics"] = DiagnosticsSection(**dkw)
    if "run" in raw:
        _need(isinstance(raw["run"], Mapping), "run: expected a train config mapping")
        kw["run"] = copy.deepcopy(dict(raw["run"]))
    cfg = LadderConfig(**kw)
    _check(cfg)
    return cfg


def _check(cfg: LadderConfig) -> None:
    from mxjax import policies

    known = set(policies.names())
    bad = [p for p in cfg.policies if p not in known]
    _need(not bad, f"policies: unknown {bad}; known: {', '.join(policies.names())}")
    dp = cfg.diagnostics.policies
    _need(dp is None or all(p in cfg.policies for p in dp),
          f"diagnostics.policies: {dp} must be among the ladder's policies")
    _need(cfg.baseline in cfg.policies, f"baseline: {cfg.baseline!r} must be one of the "
          f"ladder's policies {list(cfg.policies)}")
    for k in ("name", "seed", "out_dir", "policy"):
        _need(k not in cfg.run, f"run.{k}: set by the ladder for each run; remove it")
    for k in ("steps", "target_eval_loss"):
        _need(k not in cfg.run.get("train", {}),
              f"run.train.{k}: set by the ladder (use baseline_steps / budget_multiple / "
              "target_eval_loss at the top level)")
    # The shared train config must itself be valid.
    _run_config(cfg, cfg.baseline, cfg.seeds[0], cfg.baseline_steps, None)


def load(path: str | Path | None, overrides: Sequence[str] = ()) -> LadderConfig:
    """Reads a ladder YAML (``--set key=value`` overrides use train.config's syntax)."""
    from train import config as C

    raw = C.read_yaml(path) if path is not None else {}
    return from_dict(C.apply_overrides(raw, overrides))


def _run_config(cfg: LadderConfig, policy: str, seed: int, steps: int, target: float | None):
    """The train Config of one run."""
    from train import config as C

    raw = copy.deepcopy(cfg.run)
    raw.update(name=f"{cfg.name}-{policy}-s{seed}", seed=seed, policy=policy,
               out_dir=str(_run_dir(cfg, policy, seed)))
    train = dict(raw.get("train") or {})
    train.update(steps=steps, target_eval_loss=target)
    raw["train"] = train
    optim = dict(raw.get("optim") or {})
    optim.setdefault("decay_steps", cfg.max_steps)
    raw["optim"] = optim
    try:
        return C.from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"run: {e}") from None


def _run_dir(cfg: LadderConfig, policy: str, seed: int) -> Path:
    return cfg.out_path / "runs" / policy / f"seed{seed}"


# --------------------------------------------------------------------------- diagnostics hooks
def llama_slot_labels(model_config: Any) -> list[str]:
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


def _round(x: float, digits: int = 5) -> float | None:
    if x is None or not math.isfinite(x):
        return None if x is None else x
    return float(f"{x:.{digits}g}")


class RunDiagnostics:
    """Hooks for ``train.loop.run`` that record numerics diagnostics of one run.

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
        from mxjax import diagnostics as D

        self.D = D
        self.labels = list(labels) if labels is not None else None
        self.cosine = cosine
        self.layout: list[tuple[str, int]] | None = None
        self._warned = False

    def hooks(self):
        from train import loop

        return loop.Hooks(diagnostics=self.D.DiagnosticsConfig(cosine=self.cosine),
                          in_step=self.in_step, on_record=self.on_record)

    # traced
    def in_step(self, ctx) -> dict[str, Any]:
        import jax.numpy as jnp

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
            stats = stats.reshape(0, 3, self.D.N_GEMM_FIELDS)
        labels = self.labels
        if labels is None or len(labels) != stats.shape[0]:
            if labels is not None and stats.shape[0] and not self._warned:
                print(f"[ladder] warning: {stats.shape[0]} quantized GEMM call sites but "
                      f"{len(labels)} labels; using gemm0..gemm{stats.shape[0] - 1}",
                      file=sys.stderr)
                self._warned = True
            labels = [f"gemm{i}" for i in range(stats.shape[0])]
        s = self.D.summarize_probes(stats, labels, cosine=self.cosine)
        more: dict[str, Any] = {"diag_gemm": None, "diag_grad_norm": None, "diag_update": None}
        for g, row in s["per_gemm"].items():
            for f in _DIAG_FIELDS:
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
                lab: {g: {f: _round(row[f]) for f in _SLOT_FIELDS} for g, row in gs.items()}
                for lab, gs in s["per_slot"].items()}
            more["diag_layer_grad_norm"] = {k: _round(v) for k, v in gn.items()}
        return more


# --------------------------------------------------------------------------- running
def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[ladder] {msg}", file=sys.stderr, flush=True)


def _read_records(run_dir: Path) -> list[dict[str, Any]]:
    from train.metrics import read_jsonl

    return read_jsonl(run_dir / "metrics.jsonl")


def _curve(records: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    pts: dict[int, float] = {}
    for r in records:
        if r.get("eval_loss") is not None:
            pts[int(r["tokens"])] = R.as_float(r["eval_loss"])
    return sorted(pts.items())


def _eval_at(records, step: int) -> float | None:
    for r in records:
        if int(r["step"]) == step and r.get("eval_loss") is not None:
            return R.as_float(r["eval_loss"])
    return None


def _stage_key(steps: int, target: float | None) -> str:
    return f"steps={steps} target={target!r}"


def _done(run_dir: Path, steps: int, target: float | None) -> dict[str, Any] | None:
    """The record of a finished stage (steps, target) of a run, or None."""
    p = run_dir / _DONE
    if not p.is_file():
        return None
    return json.loads(p.read_text()).get("stages", {}).get(_stage_key(steps, target))


def _mark_done(run_dir: Path, rec: dict[str, Any]) -> None:
    p = run_dir / _DONE
    d = json.loads(p.read_text()) if p.is_file() else {"stages": {}}
    d["stages"][_stage_key(rec["steps"], rec["target"])] = rec
    d["last"] = rec
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(d, indent=1))
    tmp.replace(p)


def _train_one(cfg: LadderConfig, policy: str, seed: int, steps: int, target: float | None,
               verbose: bool) -> dict[str, Any]:
    """Runs (or resumes, or skips) one run; returns its ladder_done record."""
    from train import loop

    run_dir = _run_dir(cfg, policy, seed)
    done = _done(run_dir, steps, target)
    if done is not None:
        return done
    tc = _run_config(cfg, policy, seed, steps, target)
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
        R.plot_run_diagnostics(_read_records(run_dir), run_dir / "diagnostics.png", title=title)
    _mark_done(run_dir, rec)
    return rec


def run_ladder(cfg: LadderConfig, *, verbose: bool = True) -> dict[str, Any]:
    """Trains every run of the ladder that is not done yet, then writes the report.

    Returns the report dict (also in ``<out>/ladder.json``).
    """
    out = cfg.out_path
    out.mkdir(parents=True, exist_ok=True)
    (out / "ladder_config.yaml").write_text(
        yaml.safe_dump(_plain(dataclasses.asdict(cfg)), sort_keys=False))
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
            run_dir = _run_dir(cfg, policy, seed)
            if policy == cfg.baseline and \
                    R.tokens_to_target(_curve(_read_records(run_dir)), target) is not None:
                continue  # reached the target within its budget: nothing to extend
            r = _train_one(cfg, policy, seed, cfg.max_steps, target, verbose)
            _log(verbose, f"({i}/{n_runs}) {policy} seed {seed}: {r['status']} after "
                 f"{r['steps_trained']} steps ({time.time() - t_start:.0f} s so far)")
    rep = report(cfg, verbose=verbose)
    _log(verbose, f"ladder done in {time.time() - t_start:.0f} s; report: {out / 'ladder.md'}")
    return rep


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _targets(cfg: LadderConfig) -> tuple[float, float]:
    """(target eval loss, divergence threshold) from the config or the baseline's runs."""
    finals, starts = [], []
    for seed in cfg.seeds:
        recs = _read_records(_run_dir(cfg, cfg.baseline, seed))
        fin = _eval_at(recs, cfg.baseline_steps)
        if fin is None:
            raise RuntimeError(
                f"baseline {cfg.baseline} seed {seed} has no evaluation at step "
                f"{cfg.baseline_steps} (run.train.eval_every must divide baseline_steps, or "
                f"the run stopped early: see {_run_dir(cfg, cfg.baseline, seed)})")
        finals.append(fin)
        st = _eval_at(recs, 0)
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


# --------------------------------------------------------------------------- report
def _tokens_per_step(cfg: LadderConfig) -> int:
    tc = _run_config(cfg, cfg.baseline, cfg.seeds[0], cfg.baseline_steps, None)
    return tc.train.global_batch * tc.data.seq_len


def _diag_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
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
        vals = [R.as_float(r[k]) for r in tail if r.get(k) is not None]
        if vals:
            out[k] = float(np.mean(vals))
    coll = [R.as_float(r["grad_collapse_rate"]) for r in rows
            if r.get("grad_collapse_rate") is not None]
    if coll:
        out["grad_collapse_rate_max"] = float(np.max(coll))
    return out


def _instability(records: Sequence[Mapping[str, Any]]):
    det = dynamics.InstabilityDetector()
    state = det.init()
    for r in records:
        if r.get("grad_norm") is not None and int(r["step"]) > 0:
            state = det.update(state, int(r["step"]), R.as_float(r["grad_norm"]))
    return state


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
            run_dir = _run_dir(cfg, policy, seed)
            recs = _read_records(run_dir)
            if not recs:
                continue
            curve = _curve(recs)
            curves[(policy, seed)] = curve
            marker = run_dir / _DONE
            last = json.loads(marker.read_text()).get("last", {}) if marker.is_file() else {}
            status = last.get("status")
            o = R.classify_run(curve, target=target, max_tokens=max_tokens,
                               diverge_loss=diverge, stopped_nonfinite=status == "nonfinite",
                               policy=policy, seed=seed)
            outcomes.append(o)
            st = _instability(recs)
            instab[(policy, seed)] = st
            d = _diag_summary(recs)
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

    def instability(key) -> str:
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
                     f"{_fmt(d.get('update_ratio_mean'), '.2e')} | {instability((p, s))} |")
    for key, st in instab.items():
        if key not in diag_rows and st.event_step is not None:
            lines.append(f"| {key[0]} | {key[1]} | | | | | | | | {instability(key)} |")
    lines += ["", "![eval curves](ladder_curves.png)", ""]
    return "\n".join(lines)


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
    p.add_argument("--config", required=True, help="ladder YAML (e.g. configs/ladder_tiny.yaml)")
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
            cfg = from_dict({**_plain(dataclasses.asdict(cfg)), "policies": chosen})
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
