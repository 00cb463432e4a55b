"""Path rules for `mxjax.nn.wrap` and the report of what each dot_general got."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mxjax import policies
from mxjax.policies import PrecisionPolicy

__all__ = ["HEAD_NAMES", "KINDS", "NOT_GEMM", "Rule", "Site", "WrapReport", "as_rules"]

# What a GEMM's operands are (see `Site.kind`); the kinds a Rule selects.
KINDS = ("weight", "head", "activation")
# The kind of a dot_general that is no GEMM (nothing summed): no rule selects it.
NOT_GEMM = "not_gemm"
# The name fallback for output heads (mxjax.nn.kinds): a weight matmul whose weight
# comes from a parameter with a path component (e.g. 'params/lm_head/kernel') fully
# matching this, or that sits in a module whose last path component does.
HEAD_NAMES = r"lm_head|head|output_head|unembed|unembedding"


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class Rule:
    """Apply `policy` to every dot_general whose module path fully matches `path`.

    Attributes:
      path: a regular expression matched with ``re.fullmatch`` against the module
        path, '/'-joined from the root (e.g. ``'layers/0/mlp/up'`` for NNX,
        ``'Block_0/Dense_1'`` for Linen; ``''`` is the root module's own code;
        the format and where it comes from: ``mxjax.nn.paths``). ``'.*'``
        matches everything. To see the paths of a model:
        ``print(mxjax.nn.wrap(model, rules).report(*call_args))``.
      policy: anything ``mxjax.policies.resolve`` takes: a PrecisionPolicy, a
        preset name, a policy dict, or None / ``'none'`` to leave the matched
        dot_generals untouched (plain ``lax.dot_general``).
      operands: which dot_generals the rule selects by what their operands are
        (``Site.kind``): ``'weight'`` (default: one operand is computed from
        parameters alone; the linear layers), ``'head'`` (an output head: a
        weight matmul whose weight is the embedding table, i.e. a tied head;
        or whose result is the model's output with the vocabulary's width; or,
        as a fallback, a parameter or module named like ``lm_head``; see
        ``mxjax.nn.kinds``), ``'activation'`` (both operands depend on the
        inputs: attention scores and values), ``'any'`` (all three), or a
        tuple of kinds. A dot_general that is no GEMM (``Site.kind ==
        'not_gemm'``) is never selected.
    Rules are tried in order; the first rule whose path and operands both match
    wins. So by default (a bare policy or preset name is ``Rule(path='.*',
    policy=...)``) only the linear layers are quantized: attention and the
    output head stay at the model's precision, like the paper's recipe and
    ``models.llama`` (``quantize_attention`` / ``quantize_embed_head`` off).
    """

    path: str
    policy: PrecisionPolicy | str | None
    operands: str | tuple[str, ...] = "weight"

    def __post_init__(self):
        if not isinstance(self.path, str):
            raise TypeError(f"Rule: path must be a regex string, got {self.path!r}")
        try:
            re.compile(self.path)
        except re.error as e:
            raise ValueError(
                f"Rule: path {self.path!r} is not a valid regular expression: {e}") from None
        try:
            object.__setattr__(self, "policy", policies.resolve(self.policy))
        except (TypeError, ValueError) as e:
            raise type(e)(f"Rule: policy: {str(e).removeprefix('policy:').lstrip()}") from None
        kinds = (self.operands,) if isinstance(self.operands, str) else self.operands
        if not isinstance(kinds, tuple) or not kinds or not all(
                isinstance(k, str) and k in (*KINDS, "any") for k in kinds):
            raise ValueError(
                f"Rule: operands must be one of {(*KINDS, 'any')} or a non-empty tuple of them, "
                f"got {self.operands!r}"
            )
        object.__setattr__(self, "operands", KINDS if "any" in kinds else
                           tuple(k for k in KINDS if k in kinds))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The operand kinds this rule selects (normalized, in ``KINDS`` order)."""
        return self.operands

    def matches(self, path: str, kind: str | None = None) -> bool:
        """Whether the rule selects a dot_general at `path` whose operands are `kind`."""
        return re.fullmatch(self.path, path) is not None and (kind is None or kind in self.kinds)

    def describe(self) -> str:
        """One line: ``Rule('path' -> policy name, operands=kinds)``."""
        name = "unchanged" if self.policy is None else (self.policy.name or "custom policy")
        kinds = "any" if self.kinds == KINDS else ",".join(self.kinds)
        return f"Rule({self.path!r} -> {name}, operands={kinds})"

    def __repr__(self) -> str:
        if self.policy is None:
            pol = "None"
        elif self.policy.name:
            pol = repr(self.policy.name)
        else:
            pol = "<custom PrecisionPolicy>"
        kinds = "'any'" if self.kinds == KINDS else repr(
            self.kinds[0] if len(self.kinds) == 1 else self.kinds)
        return f"Rule(path={self.path!r}, policy={pol}, operands={kinds})"


def as_rules(policy_or_rules: Any) -> tuple[Rule, ...]:
    """A policy spec (what ``mxjax.policies.resolve`` takes: a PrecisionPolicy, a preset
    name, a policy dict, None or ``'none'``), a Rule, or a sequence of Rules -> tuple of
    Rules (a policy spec becomes ``Rule(path='.*', policy=spec)``)."""
    if policy_or_rules is None or isinstance(policy_or_rules, (PrecisionPolicy, str, Mapping)):
        try:
            return (Rule(path=".*", policy=policy_or_rules),)
        except (TypeError, ValueError) as e:
            raise type(e)(f"policy_or_rules: {str(e).removeprefix('Rule: ')}") from None
    if isinstance(policy_or_rules, Rule):
        return (policy_or_rules,)
    if isinstance(policy_or_rules, Sequence) and policy_or_rules and all(
            isinstance(r, Rule) for r in policy_or_rules):
        return tuple(policy_or_rules)
    raise TypeError(
        "policy_or_rules: expected a PrecisionPolicy, a preset name, a policy dict, None or "
        f"'none', a Rule or a non-empty sequence of Rules, got {policy_or_rules!r}"
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
      kind: what the operands are: ``'weight'`` (at least one operand is
        computed from parameters alone, e.g. a parameter cast, reshaped or
        transposed), ``'head'`` (a weight matmul that is an output head),
        ``'activation'`` (both operands depend on the inputs), or
        ``'not_gemm'`` (no contracting dimension, or contracting dimensions of
        total size 1: an elementwise or outer product; always left exact).
      why: how the kind was found and why the site was or was not quantized.
      head_rule: for heads, the rule that decided: ``'tied'`` (the embedding
        table), ``'structure'`` (the model's output, the vocabulary's width) or
        ``'name'`` (``HEAD_NAMES``); else ''.
    """

    path: str
    index: int
    rule: int | None
    policy: PrecisionPolicy | None
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    note: str = ""
    kind: str = "weight"
    why: str = ""
    head_rule: str = ""


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
        """{module path: policy name (None when left unchanged)} for every path with a GEMM."""
        out: dict[str, str | None] = {}
        for s in self.sites:
            if s.kind == NOT_GEMM:
                continue
            name = None if s.policy is None else (s.policy.name or "custom")
            out.setdefault(s.path, name)
        return out

    def sites_of(self, kind: str) -> tuple[Site, ...]:
        """The sites whose operands are `kind` ('weight', 'head', 'activation', 'not_gemm')."""
        if kind not in (*KINDS, NOT_GEMM):
            raise ValueError(f"kind: expected one of {(*KINDS, NOT_GEMM)}, got {kind!r}")
        return tuple(s for s in self.sites if s.kind == kind)

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
            key = (s.path or "(root)", s.kind, name, "-" if s.rule is None else str(s.rule),
                   s.why or s.note)
            rows[key] = rows.get(key, 0) + 1
        header = ("module", "kind", "policy", "rule", "dots", "why")
        table = [header] + [(p, k, n, r, str(c), why) for (p, k, n, r, why), c in rows.items()]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = ["mxjax.nn.wrap report"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
        for r in self.unused_rules:
            lines.append(f"unused: {r.describe()}")
        for s in self.skipped:
            lines.append(f"skipped: {s}")
        return "\n".join(lines)
