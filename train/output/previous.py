"""What an output directory already holds from an earlier run, and whether a run may reuse it.

With checkpoints on, the checkpoints decide (`train.compat`): the same setup
resumes, another is refused. With ``checkpoint.enabled: false`` nothing can be
resumed, so a run on a directory holding another run's outputs would silently
replace them; `check_reuse` refuses that, lets the same run (same config.yaml)
return at once when it finished or start over when it did not, and names
what differs otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from train.config import ConfigError
from train.output.summary import RunSummary, read_summary

__all__ = ["OUTPUT_FILES", "check_reuse", "config_changes", "relocated"]

# The files that make a directory another run's output (checkpoints are checked apart).
OUTPUT_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "mllog.txt")

# Settings that change where things go or how progress shows, never what a run computes.
_COSMETIC = ("out_dir", "jax_cache_dir", "data.cache_dir", "train.progress")


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and key != "policy" and key != "model.overrides":
            out.update(_flat(v, f"{key}."))
        else:
            out[key] = v
    return out


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` for every setting (but the cosmetic ones) that differs."""
    a, b = _flat(old), _flat(new)
    keys = sorted(k for k in set(a) | set(b) if k not in _COSMETIC and a.get(k) != b.get(k))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys]


def check_reuse(out: Path, config: Mapping[str, Any], *, steps: int) -> RunSummary | None:
    """For a run without checkpoints on `out`: the earlier identical run's summary when it
    finished (the caller returns it), None when the directory may be (re)written.

    Raises ConfigError when `out` holds the outputs of another run, or of one whose
    config.yaml is missing or unreadable.
    """
    present = [n for n in OUTPUT_FILES if (out / n).exists()]
    if not present:
        return None
    try:
        old = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        old = None
    if not isinstance(old, Mapping):
        raise ConfigError(
            f"{out} holds the outputs of an earlier run ({', '.join(present)}) whose "
            "config.yaml is missing or unreadable, and checkpoint.enabled is false, so this run "
            "would overwrite them. Use another output directory (--out) or delete them.")
    changes = config_changes(old, config)
    if changes:
        raise ConfigError(
            f"{out} holds the outputs of another run ({', '.join(present)}); checkpoint.enabled "
            "is false, so this run cannot resume it and would overwrite them. It differs in:\n  "
            + "\n  ".join(changes[:8]) + ("\n  ..." if len(changes) > 8 else "")
            + "\nUse another output directory (--out) or delete those files.")
    prev = read_summary(out / "summary.json")
    done = prev is not None and (prev.status == "target_reached" or (
        prev.status == "completed" and prev.steps >= steps))
    return prev if done else None


def relocated(summary: RunSummary, out: Path) -> RunSummary:
    """`summary` with its paths in `out` (a run directory copied or moved elsewhere keeps
    the paths it was written with in summary.json)."""
    def move(p: str | None) -> str | None:
        return None if p is None else str(out / Path(p).name)

    return dataclasses.replace(summary, out_dir=str(out), metrics_path=str(out / "metrics.jsonl"),
                               plot_path=move(summary.plot_path),
                               checkpoint_dir=move(summary.checkpoint_dir))
