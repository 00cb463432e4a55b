"""The study's units of work: one fixed-budget run or one branch, where its record lives,
and their grouping into chunks that share one compilation."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from study import config as SC

__all__ = ["Unit", "chunks", "plan_units"]


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


def chunks(units: Sequence[Unit]) -> list[list[Unit]]:
    """`units` grouped by (phase, width, kind, policy), largest first (longest-job-first
    balances the workers); each group compiles its train step once."""
    groups: dict[tuple, list[Unit]] = {}
    for u in units:
        groups.setdefault((u.phase, u.width, u.kind, u.policy), []).append(u)

    def cost(g: list[Unit]) -> float:
        return sum((200 if u.kind == "run" else 30) * (u.width / 128) ** 1.5 for u in g)

    return sorted(groups.values(), key=lambda g: (g[0].phase, -cost(g)))

