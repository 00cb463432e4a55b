"""What the Linen, NNX and function front ends of ``mxjax.nn.wrap`` share.

One place for the RNG stream name, whether a set of rules needs a key, the
"randomized policy needs a key" error, ``report()`` / ``last_report``, and the
warning when a rule matched nothing.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from mxjax.nn.rules import NOT_GEMM, Rule, WrapReport

__all__ = ["RNG_STREAM", "ReportBox", "Reporting", "missing_key_error", "rules_need_key",
           "unmatched_message", "unused_rules_message"]

# The RNG collection (Linen) / nnx.Rngs stream randomized policies draw from.
RNG_STREAM = "mxjax"


def rules_need_key(rules: Sequence[Rule]) -> bool:
    """Whether any rule's policy is randomized (stochastic rounding, random Hadamard)."""
    return any(r.policy is not None and r.policy.needs_key for r in rules)


def missing_key_error(arg: str, how: str) -> ValueError:
    """The error for a randomized policy called without its key (`how`: what to pass)."""
    return ValueError(f"{arg}: a rule's policy is randomized and needs a key; pass {how}")


def unmatched_message(report: WrapReport, limit: int = 12) -> str:
    """The warning when every rule of `report` matched nothing: the rules and the paths seen."""
    seen: dict[tuple[str, str], int] = {}
    for s in report.sites:
        key = (s.path or "(root)", s.kind)
        seen[key] = seen.get(key, 0) + 1
    listed = [f"{p!r} ({k}, {n} dot{'s' if n > 1 else ''})" for (p, k), n in seen.items()]
    more = f" and {len(listed) - limit} more" if len(listed) > limit else ""
    paths = ", ".join(listed[:limit]) + more if listed else "none (no dot_general was traced)"
    return (
        "mxjax.nn.wrap: no rule matched any matmul, so the model runs unchanged. Rules: "
        + "; ".join(r.describe() for r in report.rules)
        + f". Module paths and kinds seen: {paths}. A rule's path is a regex matched with "
        "re.fullmatch against these paths, and its operands must include the kind; "
        "print(wrapped.report(*call_args)) shows them."
    )


def unused_rules_message(report: WrapReport, limit: int = 3) -> str | None:
    """The warning when some (not all) rules of `report` matched nothing; None if all matched.

    For each unused rule: why (its path matches no module path, or what it matches
    is of another kind, or was taken by an earlier rule) and the nearest paths seen
    (``difflib``).
    """
    used = {s.rule for s in report.sites if s.rule is not None}
    unused = [(i, r) for i, r in enumerate(report.rules) if i not in used]
    if not unused:
        return None
    gemms = [s for s in report.sites if s.kind != NOT_GEMM]
    paths = list(dict.fromkeys(s.path or "(root)" for s in gemms))
    lines = []
    for i, rule in unused:
        hits = [s for s in gemms if rule.matches(s.path)]
        if not hits:
            near = difflib.get_close_matches(rule.path, paths, n=limit, cutoff=0.4) or paths[:limit]
            why = (f"its path matches no module path; nearest paths seen: "
                   f"{', '.join(map(repr, near)) or 'none'}")
        elif not any(s.kind in rule.kinds for s in hits):
            kinds = sorted({s.kind for s in hits})
            why = (f"its path matches {len(hits)} dot_general(s), of kind {', '.join(kinds)}, "
                   f"not in its operands (add operands={kinds[0]!r} or 'any')")
        else:
            earlier = sorted({s.rule for s in hits if s.rule is not None and s.rule < i})
            why = ("every dot_general it selects was taken by an earlier rule "
                   f"({', '.join(f'rule {j}: {report.rules[j].describe()}' for j in earlier)})")
        lines.append(f"rule {i}, {rule.describe()}: {why}")
    return ("mxjax.nn.wrap: " + ("a rule" if len(unused) == 1 else f"{len(unused)} rules")
            + " matched no matmul: " + "; ".join(lines) + ". A rule's path is a regex matched "
            "with re.fullmatch against the module paths; print(wrapped.report(*call_args)) "
            "shows them.")


class ReportBox:
    """Mutable holder for the last report (kept outside NNX state and pytrees)."""

    def __init__(self):
        self.report: WrapReport | None = None
        self.warned = False


class Reporting:
    """``last_report`` and ``report()`` for the wrapped front ends.

    A subclass sets ``self._box = ReportBox()`` and implements
    ``_trace(args, kwargs, *, abstract_key) -> (output, WrapReport)``.
    """

    _box: ReportBox

    @property
    def last_report(self) -> WrapReport | None:
        """The WrapReport of the last call (None before the first call)."""
        return self._box.report

    def _trace(self, args: tuple, kwargs: dict, *, abstract_key: bool) -> tuple[Any, WrapReport]:
        raise NotImplementedError

    def _record(self, report: WrapReport) -> None:
        """Keeps a call's report; warns (once per wrapped model) when a rule matched nothing:
        every rule (`unmatched_message`) or some (`unused_rules_message`)."""
        self._box.report = report
        if self._box.warned or not report.unused_rules:
            return
        self._box.warned = True
        if len(report.unused_rules) == len(report.rules):
            message = unmatched_message(report)
        else:
            message = unused_rules_message(report)
        warnings.warn(message, UserWarning, stacklevel=3)

    def report(self, *args, **kwargs) -> WrapReport:
        """The WrapReport: of the last call without arguments, else of a call with these.

        With arguments (the call's own: e.g. ``variables, x`` for Linen, ``x``
        for NNX) the call is traced abstractly (``jax.eval_shape``: no FLOPs,
        no state change; randomized policies get a placeholder key), and
        ``last_report`` is left as it was.
        Raises:
          RuntimeError: without arguments, before the first call.
        """
        if not args and not kwargs:
            if self._box.report is None:
                raise RuntimeError(
                    "report(): the wrapped model has not been called yet; call it once, or pass "
                    "the call's arguments (report(*args, **kwargs)) to trace one abstractly"
                )
            return self._box.report
        return traced_report(lambda: self._trace(args, kwargs, abstract_key=True))


def traced_report(run: Callable[[], tuple[Any, WrapReport]]) -> WrapReport:
    """Runs `run` under ``jax.eval_shape`` and returns the report it produced."""
    box: list[WrapReport] = []

    def shapes_only():
        out, rep = run()
        box.append(rep)
        return out

    jax.eval_shape(shapes_only)
    return box[0]


def placeholder_key():
    """The key used when tracing a randomized policy for its report only."""
    return jax.random.key(0)
