"""Path rules for `mxjax.nn.wrap` and the report of what each dot_general got."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from mxjax import policies
from mxjax.policies import PrecisionPolicy

__all__ = ["Rule", "Site", "WrapReport", "as_rules"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """Apply `policy` to every dot_general whose module path fully matches `path`.

    Attributes:
      path: a regular expression matched with ``re.fullmatch`` against the module
        path, '/'-joined from the root (e.g. ``'layers/0/mlp/up'`` for NNX,
        ``'Block_0/Dense_1'`` for Linen; ``''`` is the root module's own code).
        ``'.*'`` matches everything.
      policy: a PrecisionPolicy, a preset name, or None to leave the matched
        dot_generals untouched (plain ``lax.dot_general``).
    Rules are tried in order; the first match wins.
    """

    path: str
    policy: PrecisionPolicy | str | None

    def __post_init__(self):
        if not isinstance(self.path, str):
            raise TypeError(f"Rule: path must be a regex string, got {self.path!r}")
        try:
            re.compile(self.path)
        except re.error as e:
            raise ValueError(f"Rule: path {self.path!r} is not a valid regular expression: {e}") from None
        if self.policy is not None:
            object.__setattr__(self, "policy", policies.get(self.policy))

    def matches(self, path: str) -> bool:
        return re.fullmatch(self.path, path) is not None

    def describe(self) -> str:
        name = "unchanged" if self.policy is None else (self.policy.name or "custom policy")
        return f"Rule({self.path!r} -> {name})"


def as_rules(policy_or_rules: Any) -> tuple[Rule, ...]:
    """A policy (object or preset name), a Rule, or a sequence of Rules -> tuple of Rules."""
    if isinstance(policy_or_rules, (PrecisionPolicy, str)):
        return (Rule(path=".*", policy=policy_or_rules),)
    if isinstance(policy_or_rules, Rule):
        return (policy_or_rules,)
    if isinstance(policy_or_rules, Sequence) and policy_or_rules and all(
            isinstance(r, Rule) for r in policy_or_rules):
        return tuple(policy_or_rules)
    raise TypeError(
        "policy_or_rules: expected a PrecisionPolicy, a preset name, a Rule or a non-empty "
        f"sequence of Rules, got {policy_or_rules!r}"
    )


@dataclasses.dataclass(frozen=True)
class Site:
    """One dot_general found while tracing.

    Attributes:
      path: module path ('' for the root module's own code).
      index: position among the dot_generals of that path, in trace order.
      rule: index of the rule that matched, or None.
      policy: the policy applied, or None (left as ``lax.dot_general``).
      lhs_shape, rhs_shape: operand shapes (per scan/vmap iteration).
      note: why a site was left alone although a rule matched (e.g. integer
        operands), else ''.
    """

    path: str
    index: int
    rule: int | None
    policy: PrecisionPolicy | None
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    note: str = ""


@dataclasses.dataclass(frozen=True)
class WrapReport:
    """Which modules got which policy, and which rules matched nothing.

    Attributes:
      sites: every dot_general traced, in order.
      rules: the rules, in order.
      skipped: dot_generals that could not be intercepted (inside a custom_vjp),
        with their paths.
    """

    sites: tuple[Site, ...]
    rules: tuple[Rule, ...]
    skipped: tuple[str, ...] = ()

    @property
    def modules(self) -> dict[str, str | None]:
        """{module path: policy name (None when left unchanged)} for every path with a dot."""
        out: dict[str, str | None] = {}
        for s in self.sites:
            name = None if s.policy is None else (s.policy.name or "custom")
            out.setdefault(s.path, name)
        return out

    @property
    def used_rules(self) -> tuple[Rule, ...]:
        used = {s.rule for s in self.sites if s.rule is not None}
        return tuple(r for i, r in enumerate(self.rules) if i in used)

    @property
    def unused_rules(self) -> tuple[Rule, ...]:
        """Rules that matched no dot_general."""
        used = {s.rule for s in self.sites if s.rule is not None}
        return tuple(r for i, r in enumerate(self.rules) if i not in used)

    def __str__(self) -> str:
        rows = {}
        for s in self.sites:
            name = "unchanged" if s.policy is None else (s.policy.name or "custom")
            key = (s.path or "(root)", name, "-" if s.rule is None else str(s.rule), s.note)
            rows[key] = rows.get(key, 0) + 1
        header = ("module", "policy", "rule", "dots", "note")
        table = [header] + [(p, n, r, str(c), note) for (p, n, r, note), c in rows.items()]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = ["mxjax.nn.wrap report"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
        for r in self.unused_rules:
            lines.append(f"unused: {r.describe()}")
        for s in self.skipped:
            lines.append(f"skipped: {s}")
        return "\n".join(lines)
