"""The ladder study's configuration (``configs/ladder_tiny.yaml``), parsed and checked.

Parsed with `train.config.build` (the train config's typed builder); every
problem is a ConfigError naming the key. See the ``study`` package docstring for the protocol.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import inspect
import json
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mxjax import PrecisionPolicy, policies
from study import policies as study_policies
from train import config as C
from train.config import Config, ConfigError, require, require_unique
from train.jsonsafe import jsonable


@dataclasses.dataclass(frozen=True, kw_only=True)
class BranchSection:
    """Branch-and-compare: where to branch from the reference runs and for how long.

    points: reference steps to branch from, split into ``early`` (< ``late_from``)
    and late; steps: K, each policy's branch length; exact_steps: the exact
    branch's length (>= steps, so a policy better than exact still lands on its
    curve); exact_eval_every: the exact branch's evaluation grid; batch_sets:
    independent batch streams per point (set 0 continues the reference run's own
    stream, set j > 0 draws a fresh shuffle).
    """

    points: tuple[int, ...] = (50, 150)
    late_from: int = 100
    steps: int = 24
    exact_steps: int = 48
    exact_eval_every: int = 6
    batch_sets: int = 1
    seeds: tuple[int, ...] | None = None  # None: the study's seeds
    policies: tuple[str, ...] | None = None  # None: rungs + ablations


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleSection:
    """The scale trend: the branch measure at other model widths (dim; ffn_multiple x dim)."""

    widths: tuple[int, ...] = ()
    policies: tuple[str, ...] = ("mxfp4_all", "mxfp4_all_h16", "mxfp4_all_rht16",
                                 "mxfp4_all_h16_wgrad")
    seeds: tuple[int, ...] = (0, 1)
    points: tuple[int, ...] | None = None  # None: branch.points


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyConfig:
    """A ladder study: fixed-budget runs, branches, ablations, scale trend.

    The reference and the baseline are evaluated every ``eval_every`` steps (their
    curves are what overheads are read off), the other rungs every
    ``rung_eval_every`` steps and at the end.

    Policies (``reference``, ``baseline``, ``rungs``, ``ablations``,
    ``branch.policies``, ``scale.policies``) are named; where a name goes, a
    policy may also be given as anything ``mxjax.policies.resolve`` takes (a
    policy dict, a PrecisionPolicy, null for ``none``): `from_dict` files it under
    its ``name`` (or ``custom-<digest>`` without one) in ``custom_policies``
    (name -> policy dict), which a config may also fill directly.

    ``run`` is a train config mapping (``python -m train --help``); the study
    sets ``seed``, ``policy``, ``out_dir`` and ``train.steps`` (= ``steps``, the
    learning-rate horizon every run and branch shares). ``width`` is the main
    model's ``dim`` (its ``ffn_dim`` is ``ffn_multiple`` x ``dim``; other fields
    from ``run``).
    """

    name: str = "ladder"
    out_dir: str | None = None
    reference: str = "none"
    baseline: str = "fp8"
    rungs: tuple[str, ...] = study_policies.RUNGS
    ablations: tuple[str, ...] = ()
    seeds: tuple[int, ...] = (0, 1, 2, 3)
    steps: int = 200
    eval_every: int = 25
    rung_eval_every: int = 50
    eval_sequences: int = 512
    width: int = 128
    ffn_multiple: int = 3
    workers: int = 1
    probe: bool = True
    branch: BranchSection = dataclasses.field(default_factory=BranchSection)
    scale: ScaleSection = dataclasses.field(default_factory=ScaleSection)
    custom_policies: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    run: dict[str, Any] = dataclasses.field(default_factory=dict)

    def policy(self, name: str) -> PrecisionPolicy | None:
        """The policy a name of this config stands for (None for ``none``)."""
        return study_policies.get(name, self.custom_policies)

    @property
    def out_path(self) -> Path:
        return Path(self.out_dir).expanduser() if self.out_dir else Path("runs") / self.name

    @property
    def ladder_policies(self) -> tuple[str, ...]:
        """The fixed-budget runs' policies: the reference, then the rungs."""
        return (self.reference,) + tuple(p for p in self.rungs if p != self.reference)

    @property
    def branch_policies(self) -> tuple[str, ...]:
        """The policies branched from every reference point (the reference excluded)."""
        chosen = self.branch.policies or (tuple(self.rungs) + tuple(self.ablations))
        return tuple(p for p in dict.fromkeys(chosen) if p != self.reference)

    @property
    def branch_seeds(self) -> tuple[int, ...]:
        return self.branch.seeds if self.branch.seeds is not None else self.seeds

    @property
    def scale_points(self) -> tuple[int, ...]:
        return self.scale.points if self.scale.points is not None else self.branch.points


# The keys that hold policies: one (a str) or several (a list).
POLICY_KEYS = ("reference", "baseline", "rungs", "ablations", "branch.policies", "scale.policies")


def _policy_record(policy: PrecisionPolicy, name: str) -> dict[str, Any]:
    return jsonable(policies.to_dict(policy.replace(name=name)))


def _file_policy(spec: Any, where: str, custom: dict[str, dict[str, Any]]) -> str:
    """The name under which `spec` (anything `mxjax.policies.resolve` takes) is run;
    a policy given by value is filed in `custom`."""
    if isinstance(spec, str):
        name = study_policies.canonical_name(spec, stacklevel=4)
        require(bool(name), f"{where}: empty policy name (use none for no policy)")
        return name
    try:
        policy = policies.resolve(spec)
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if policy is None:
        return "none"
    record = _policy_record(policy, "")
    if policy.name:
        name = policy.name
    elif (same := next((n for n, build in study_policies.PRESETS.items() if build() == policy),
                       None)) is not None:
        return same  # an unnamed policy that is a preset runs under the preset's name
    else:
        digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:8]
        name = f"custom-{digest}"
    require("/" not in name and name != "none", f"{where}: a policy name without '/' and other "
            f"than 'none' is needed (it names the runs' files), got {name!r}")
    if name in study_policies.PRESETS or name in study_policies.LEGACY or name in policies.ALIASES:
        preset = study_policies.get(study_policies.canonical_name(name, stacklevel=4))
        require(preset == policy, f"{where}: the policy named {name!r} differs from the preset "
                f"of that name; give it another name")
        return preset.name
    record = _policy_record(policy, name)
    require(custom.get(name, record) == record,
            f"{where}: two different policies are both named {name!r}")
    custom[name] = record
    return name


def _file_policies(raw: dict[str, Any]) -> None:
    """Replaces the policies given by value under POLICY_KEYS with names, filed in
    ``raw['custom_policies']`` (checked there too)."""
    given = raw.get("custom_policies") or {}
    require(isinstance(given, Mapping), f"custom_policies: expected a mapping of name -> "
            f"policy dict, got {type(given).__name__}")
    custom: dict[str, dict[str, Any]] = {}
    for name, spec in given.items():
        require(isinstance(name, str) and isinstance(spec, (Mapping, PrecisionPolicy)),
                f"custom_policies.{name}: expected a policy dict, got {type(spec).__name__}")
        try:
            policy = policies.resolve(spec)
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"custom_policies.{name}: {e}") from None
        filed = _file_policy(policy.replace(name=name), f"custom_policies.{name}", custom)
        require(filed == name, f"custom_policies.{name}: the preset {filed!r}; use that name")
    for key in POLICY_KEYS:
        head, _, tail = key.partition(".")
        section = raw if not tail else raw.get(head)
        field = tail or head
        if not isinstance(section, Mapping) or section.get(field) is None:
            continue
        value = section[field]
        if key in ("reference", "baseline"):
            section[field] = _file_policy(value, key, custom)
        elif isinstance(value, (list, tuple)):
            section[field] = [_file_policy(v, f"{key}[{i}]", custom) for i, v in enumerate(value)]
    if custom:
        raw["custom_policies"] = custom


def from_dict(raw: Mapping[str, Any]) -> StudyConfig:
    """Builds and validates a StudyConfig (unknown keys and bad values raise ConfigError).

    Policies may be given by value where a name goes (see `StudyConfig`).
    """
    require(isinstance(raw, Mapping), f"study config must be a mapping, got {type(raw).__name__}")
    raw = copy.deepcopy(dict(raw))
    _file_policies(raw)
    cfg = C.build(StudyConfig, raw, what="study")
    check(cfg)
    return cfg


def _unknown(key: str, bad: Sequence[str], known: set[str]) -> str:
    """The error for policy names the study does not know: the closest known names of each
    ("did you mean"), the whole list only where one has none."""
    parts, hopeless = [], False
    for name in bad:
        close = difflib.get_close_matches(str(name), sorted(known), n=2, cutoff=0.6)
        hopeless |= not close
        parts.append(f"{name!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)"
                                    if close else ""))
    every = (f"known: {', '.join(sorted(known))}" if hopeless else
             "every name: study.policies.names() and custom_policies")
    return f"{key}: unknown {', '.join(parts)}; {every}"


def check(cfg: StudyConfig) -> None:
    """The study's value rules (types are checked by the builder)."""
    require(bool(cfg.name) and "/" not in cfg.name, f"name: a non-empty name without '/', got "
          f"{cfg.name!r}")
    known = set(study_policies.names()) | set(cfg.custom_policies)
    for key in ("rungs", "ablations", "branch.policies", "scale.policies"):
        obj: Any = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        if obj is None:
            continue
        require_unique(obj, key, allow_empty=key != "rungs")
        bad = [p for p in obj if p not in known]
        require(not bad, _unknown(key, bad, known))
    require(cfg.reference in known, _unknown("reference", [cfg.reference], known))
    require(cfg.baseline in cfg.rungs, f"baseline: {cfg.baseline!r} must be one of rungs")
    require_unique(cfg.seeds, "seeds")
    require(len(cfg.seeds) >= 2, "seeds: at least 2 (the confidence intervals need them; the "
            "study's protocol uses 4)")
    for k in ("steps", "eval_every", "rung_eval_every", "eval_sequences", "width", "ffn_multiple",
              "workers"):
        require(getattr(cfg, k) >= 1, f"{k}: expected an integer >= 1, got {getattr(cfg, k)!r}")
    b = cfg.branch
    require_unique(b.points, "branch.points")
    require(all(0 < p and p + b.steps <= cfg.steps for p in b.points),
          f"branch.points: each point p needs 0 < p and p + branch.steps <= steps ({cfg.steps}), "
          f"got {list(b.points)}")
    require(b.steps >= 1 and b.exact_steps >= b.steps,
          f"branch.steps / exact_steps: need 1 <= steps <= exact_steps, got {b.steps}, "
          f"{b.exact_steps}")
    require(b.exact_eval_every >= 1 and b.steps % b.exact_eval_every == 0
          and b.exact_steps % b.exact_eval_every == 0,
          "branch.exact_eval_every must divide branch.steps and branch.exact_steps")
    require(b.batch_sets >= 1, f"branch.batch_sets: expected >= 1, got {b.batch_sets}")
    require(set(cfg.branch_seeds) <= set(cfg.seeds), "branch.seeds: must be among seeds")
    require_unique(cfg.scale.widths, "scale.widths", allow_empty=True)
    require(cfg.width not in cfg.scale.widths, "scale.widths: must not repeat the main width")
    require(all(w >= 16 and w % 16 == 0 for w in cfg.scale.widths),
          f"scale.widths: multiples of 16 expected, got {list(cfg.scale.widths)}")
    require(all(0 < p and p + b.steps <= cfg.steps for p in cfg.scale_points),
          "scale.points: each point p needs 0 < p and p + branch.steps <= steps")
    for k in ("name", "seed", "out_dir", "policy"):
        require(k not in cfg.run, f"run.{k}: set by the study for each run; remove it")
    require("steps" not in (cfg.run.get("train") or {}),
          "run.train.steps: set by the study (use the top-level steps)")
    run_config(cfg, cfg.width)  # the shared run must be valid


def load(path: str | Path | None, overrides: Sequence[str] = ()) -> StudyConfig:
    """Reads a study YAML (``--set key=value`` overrides use train.config's syntax)."""
    raw = C.read_yaml(path) if path is not None else {}
    return from_dict(C.apply_overrides(raw, overrides))


def describe(width: int = 100) -> str:
    """The study config's keys with their defaults, and what they mean, for ``--help``."""
    lines = ["config keys (set in the YAML file or with --set key=value):"]

    def entry(indent: str, name: str, default: Any) -> None:
        lines.extend(textwrap.wrap(f"{indent}{name} (default {default!r})", width,
                                   subsequent_indent=indent + "    "))

    for f in dataclasses.fields(StudyConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            summary = inspect.getdoc(type(default)).split("\n\n")[0].replace("\n", " ")
            lines.extend(textwrap.wrap(f"{f.name}: {summary}", width, subsequent_indent="    "))
            for g in dataclasses.fields(default):
                entry("  ", g.name, getattr(default, g.name))
        else:
            entry("", f.name, default)
    lines += ["", *inspect.getdoc(StudyConfig).splitlines()[2:]]
    lines += ["", "branch:", *inspect.getdoc(BranchSection).splitlines()[2:]]
    return "\n".join(lines)


def to_dict(cfg: StudyConfig) -> dict[str, Any]:
    """Plain nested dict (YAML-safe) of `cfg`; ``from_dict(to_dict(cfg)) == cfg``."""
    return jsonable(cfg)


def run_config(cfg: StudyConfig, width: int) -> Config:
    """The train Config shared by every run and branch at `width` (seeds and policies are
    chosen per unit)."""
    raw = copy.deepcopy(cfg.run)
    raw.update(name=f"{cfg.name}-w{width}", seed=cfg.seeds[0], policy=None,
               out_dir=str(cfg.out_path / f"w{width}"))
    model = dict(raw.get("model") or {})
    over = dict(model.get("overrides") or {})
    over.update(dim=width, ffn_dim=cfg.ffn_multiple * width)
    model["overrides"] = over
    raw["model"] = model
    train = dict(raw.get("train") or {})
    train.update(steps=cfg.steps, eval_sequences=cfg.eval_sequences)
    raw["train"] = train
    try:
        return C.from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"run: {e}") from None
