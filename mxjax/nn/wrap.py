"""``mxjax.nn.wrap``: apply a policy or path rules to an existing model or function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
from flax import nnx

from mxjax.nn.frontend import (
    ReportBox,
    Reporting,
    missing_key_error,
    placeholder_key,
    rules_need_key,
)
from mxjax.nn.interpret import transform_call
from mxjax.nn.linen import LinenWrapped
from mxjax.nn.nnx import NnxWrapped
from mxjax.nn.rules import Rule, as_rules

__all__ = ["FunctionWrapped", "wrap"]


class FunctionWrapped(Reporting):
    """A function whose dot_generals run under path rules (from ``mxjax.nn.wrap``).

    Call it like the function, plus ``mxjax_key=`` for randomized policies.
    Paths are the ``jax.named_scope`` names around each matmul ('/'-joined;
    ``mxjax.nn.paths``).
    The parameters (for operand kinds) are the positional arguments listed in
    ``params_argnums`` and the arrays the function closes over.
    ``report()`` returns the last call's WrapReport (``last_report``);
    ``report(*args, **kwargs)`` traces one abstractly.
    """

    def __init__(self, fn: Callable, rules: tuple[Rule, ...], params_argnums: tuple[int, ...]):
        self.fn = fn
        self.rules = rules
        self.params_argnums = params_argnums
        self.needs_key = rules_need_key(rules)
        self._box = ReportBox()

    def _trace(self, args, kwargs, *, abstract_key):
        kwargs = dict(kwargs)
        key = kwargs.pop("mxjax_key", None)
        if abstract_key and self.needs_key and key is None:
            key = placeholder_key()
        if self.needs_key and key is None:
            raise missing_key_error("mxjax_key", "mxjax_key=key")
        return transform_call(self.fn, args, kwargs, rules=self.rules, key=key,
                              param_args=self.params_argnums)

    def __call__(self, *args, mxjax_key=None, **kwargs):
        out, report = self._trace(args, {**kwargs, "mxjax_key": mxjax_key}, abstract_key=False)
        self._record(report)
        return out


def wrap(model: Any, policy_or_rules: Any, *, rngs: nnx.Rngs | None = None,
         params_argnums: int | tuple[int, ...] = ()):
    """Applies a precision policy (or path rules) to every matmul of a model.

    Args:
      model: a Flax Linen module, an NNX module, or a plain function.
      policy_or_rules: anything ``mxjax.policies.resolve`` takes (a
        PrecisionPolicy, a preset name, a policy dict, or None / ``'none'``
        for no policy), meaning ``Rule(path='.*', policy=...)``: every weight
        matmul, i.e. the linear layers; attention and the output head stay
        unchanged. Or a ``Rule`` or a sequence of Rules
        (the first rule whose path regex fully matches the module path and
        whose ``operands`` include the site's kind wins; dot_generals no rule
        selects stay unchanged). ``Rule(..., operands='any')`` adds attention
        and the head; ``operands=('weight', 'head')`` adds the head only.
      rngs: NNX only: an ``nnx.Rngs`` with an ``'mxjax'`` stream, needed when a
        policy is randomized. (Linen: pass ``rngs={'mxjax': key}`` to ``apply``;
        functions: ``mxjax_key=key``.)
      params_argnums: functions only: the positional arguments that are
        parameters (an int or a tuple). A matmul with an operand computed from
        them (or from arrays the function closes over) alone is a weight matmul.
    Returns:
      Linen: a ``LinenWrapped`` with ``init``/``apply``/``report``.
      NNX: an ``NnxWrapped`` module (call it like the model; ``.module`` is the
      model, ``.report(*args)``).
      Function: a ``FunctionWrapped``.
      After each call ``.last_report`` (and ``.report()``) holds the WrapReport:
      each dot_general's module path, operand kind, policy and why, and unused
      rules. ``.report(*call_args)`` traces a call abstractly instead. The
      first call in which a rule matched nothing warns (UserWarning, once per
      wrapped model, even when other rules matched), naming the rule, why, and
      the nearest module paths seen.

    Module paths (``mxjax.nn.paths``) are read from the traced program, so JAX's
    trace caches do not change them, and ``wrap`` changes nothing on `model`:
    no class swapped, no attribute written, nothing added to the code a plain
    call of the model traces (NNX: only the state the call itself updates, e.g.
    batch statistics or RNG counters, is written back, as a plain call would).
    """
    rules = as_rules(policy_or_rules)
    argnums = (params_argnums,) if isinstance(params_argnums, int) else params_argnums
    if not isinstance(argnums, tuple) or not all(
            isinstance(i, int) and i >= 0 for i in argnums):
        raise TypeError(f"params_argnums: expected an int or a tuple of non-negative ints, got "
                        f"{params_argnums!r}")
    if argnums and isinstance(model, (nn.Module, nnx.Module)):
        raise ValueError("params_argnums: only for functions (Linen/NNX parameters are known)")
    if isinstance(model, nn.Module):
        if rngs is not None:
            raise ValueError("rngs: Linen models take their key from apply(rngs={'mxjax': key})")
        return LinenWrapped(model, rules)
    if isinstance(model, nnx.Module):
        return NnxWrapped(model, rules, rngs=rngs)
    if callable(model):
        if rngs is not None:
            raise ValueError("rngs: a wrapped function takes its key as mxjax_key=")
        return FunctionWrapped(model, rules, argnums)
    raise TypeError(f"model: expected a Flax Linen/NNX module or a function, got {model!r}")
