"""A ladder's configuration: the policies, seeds and budget, plus the shared train config.

Parsed with `train.config.build` (the typed builder of the train config), then
checked for the ladder's own value rules; every problem is a ConfigError that
names the key.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mxjax import policies
from train import config as C
from train.config import Config, ConfigError, require, require_unique
from train.jsonsafe import jsonable

LADDER_POLICIES = ("fp8", "mxfp4_fprop", "mxfp4_fprop_dgrad", "mxfp4_all", "mxfp4_all_sr",
                   "mxfp4_all_rht16", "mxfp4_all_h16", "mxfp4_all_h32", "bf16",
                   "mxfp4_wgrad_h16", "nvfp4", "tseng")


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


def _listed(raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    """`raw` with a scalar int at `key` (``seeds: 0``) read as a one-element list."""
    v = raw.get(key)
    if isinstance(v, int) and not isinstance(v, bool):
        return {**raw, key: [v]}
    return dict(raw)


def from_dict(raw: Mapping[str, Any]) -> LadderConfig:
    """Builds and validates a LadderConfig (unknown keys and bad values raise ConfigError)."""
    require(isinstance(raw, Mapping), f"ladder config must be a mapping, got {type(raw).__name__}")
    raw = _listed(copy.deepcopy(dict(raw)), "seeds")
    if isinstance(raw.get("diagnostics"), Mapping):
        raw["diagnostics"] = _listed(raw["diagnostics"], "seeds")
    cfg = C.build(LadderConfig, raw, what="ladder")
    check(cfg)
    return cfg


def check(cfg: LadderConfig) -> None:
    """The ladder's value rules (types are checked by the builder)."""
    for k in ("name", "baseline"):
        require(bool(getattr(cfg, k)), f"{k}: expected a non-empty string")
    require("/" not in cfg.name, f"name: must not contain '/', got {cfg.name!r}")
    require(cfg.out_dir is None or bool(cfg.out_dir),
          f"out_dir: expected a path or null, got {cfg.out_dir!r}")
    require_unique(cfg.policies, "policies")
    require_unique(cfg.seeds, "seeds")
    require_unique(cfg.diagnostics.seeds, "diagnostics.seeds")
    require(cfg.baseline_steps >= 1,
          f"baseline_steps: expected an integer >= 1, got {cfg.baseline_steps!r}")
    require(math.isfinite(cfg.budget_multiple) and cfg.budget_multiple >= 1.0,
          f"budget_multiple: must be >= 1, got {cfg.budget_multiple}")
    for k in ("target_eval_loss", "diverge_loss"):
        v = getattr(cfg, k)
        require(v is None or math.isfinite(v), f"{k}: expected a number, got {v!r}")
    known = set(policies.names())
    bad = [p for p in cfg.policies if p not in known]
    require(not bad, f"policies: unknown {bad}; known: {', '.join(policies.names())}")
    dp = cfg.diagnostics.policies
    require(dp is None or all(p in cfg.policies for p in dp),
          f"diagnostics.policies: {dp} must be among the ladder's policies")
    require(cfg.baseline in cfg.policies, f"baseline: {cfg.baseline!r} must be one of the "
          f"ladder's policies {list(cfg.policies)}")
    for k in ("name", "seed", "out_dir", "policy"):
        require(k not in cfg.run, f"run.{k}: set by the ladder for each run; remove it")
    for k in ("steps", "target_eval_loss"):
        require(k not in (cfg.run.get("train") or {}),
              f"run.train.{k}: set by the ladder (use baseline_steps / budget_multiple / "
              "target_eval_loss at the top level)")
    # The shared train config must itself be valid.
    run_config(cfg, cfg.baseline, cfg.seeds[0], cfg.baseline_steps, None)


def load(path: str | Path | None, overrides: Sequence[str] = ()) -> LadderConfig:
    """Reads a ladder YAML (``--set key=value`` overrides use train.config's syntax)."""
    raw = C.read_yaml(path) if path is not None else {}
    return from_dict(C.apply_overrides(raw, overrides))


def to_dict(cfg: LadderConfig) -> dict[str, Any]:
    """Plain nested dict (YAML-safe) of `cfg`; ``from_dict(to_dict(cfg)) == cfg``."""
    return jsonable(cfg)


def run_dir(cfg: LadderConfig, policy: str, seed: int) -> Path:
    """The output directory of one run of the ladder."""
    return cfg.out_path / "runs" / policy / f"seed{seed}"


def run_config(cfg: LadderConfig, policy: str, seed: int, steps: int,
               target: float | None) -> Config:
    """The train Config of one run."""
    raw = copy.deepcopy(cfg.run)
    raw.update(name=f"{cfg.name}-{policy}-s{seed}", seed=seed, policy=policy,
               out_dir=str(run_dir(cfg, policy, seed)))
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
