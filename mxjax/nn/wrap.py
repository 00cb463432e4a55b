"""``mxjax.nn.wrap``: apply a policy or path rules to an existing model or function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
from flax import nnx

from mxjax.nn.interpret import transform_call
from mxjax.nn.linen import LinenWrapped
from mxjax.nn.nnx import NnxWrapped
from mxjax.nn.rules import Rule, WrapReport, as_rules

__all__ = ["FunctionWrapped", "wrap"]


class FunctionWrapped:
    """A function whose dot_generals run under path rules (from ``mxjax.nn.wrap``).

    Call it like the function, plus ``mxjax_key=`` for randomized policies.
    Paths are the ``jax.named_scope`` names around each matmul ('/'-joined).
    """

    def __init__(self, fn: Callable, rules: tuple[Rule, ...]):
        self.fn = fn
        self.rules = rules
        self.needs_key = any(r.policy is not None and r.policy.needs_key for r in rules)
        self.last_report: WrapReport | None = None

    def __call__(self, *args, mxjax_key=None, **kwargs):
        if self.needs_key and mxjax_key is None:
            raise ValueError("mxjax_key: a rule's policy is randomized; pass mxjax_key=key")
        out, self.last_report = transform_call(self.fn, args, kwargs, rules=self.rules,
                                               key=mxjax_key)
        return out

    def report(self, *args, **kwargs) -> WrapReport:
        """Traces abstractly and returns the WrapReport."""
        import jax

        box = []

        def run():
            key = jax.random.key(0) if self.needs_key else None
            out, rep = transform_call(self.fn, args, kwargs, rules=self.rules, key=key)
            box.append(rep)
            return out

        jax.eval_shape(run)
        return box[0]


def wrap(model: Any, policy_or_rules: Any, *, rngs: nnx.Rngs | None = None):
    """Applies a precision policy (or path rules) to every matmul of a model.

    Args:
      model: a Flax Linen module, an NNX module, or a plain function.
      policy_or_rules: a PrecisionPolicy, a preset name (applies to every
        dot_general), a ``Rule`` or a sequence of Rules (first full-regex match on
        the module path wins; dot_generals no rule matches stay unchanged).
      rngs: NNX only: an ``nnx.Rngs`` with an ``'mxjax'`` stream, needed when a
        policy is randomized. (Linen: pass ``rngs={'mxjax': key}`` to ``apply``;
        functions: ``mxjax_key=key``.)
    Returns:
      Linen: a ``LinenWrapped`` with ``init``/``apply``/``report``.
      NNX: an ``NnxWrapped`` module (call it like the model; ``.module`` is the
      model, ``.report(*args)``).
      Function: a ``FunctionWrapped``.
      After each call ``.last_report`` holds the WrapReport (which modules got
      which policy, unused rules).
    """
    rules = as_rules(policy_or_rules)
    if isinstance(model, nn.Module):
        if rngs is not None:
            raise ValueError("rngs: Linen models take their key from apply(rngs={'mxjax': key})")
        return LinenWrapped(model, rules)
    if isinstance(model, nnx.Module):
        return NnxWrapped(model, rules, rngs=rngs)
    if callable(model):
        if rngs is not None:
            raise ValueError("rngs: a wrapped function takes its key as mxjax_key=")
        return FunctionWrapped(model, rules)
    raise TypeError(f"model: expected a Flax Linen/NNX module or a function, got {model!r}")
