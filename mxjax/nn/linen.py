"""Flax Linen integration: a policy module for ``dot_general_cls`` and the Linen wrapper."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn

from mxjax import policies
from mxjax.interceptor import dot_general
from mxjax.nn.frontend import (
    RNG_STREAM,
    ReportBox,
    Reporting,
    missing_key_error,
    placeholder_key,
    rules_need_key,
)
from mxjax.nn.interpret import transform_call
from mxjax.nn.paths import PathSource
from mxjax.nn.rules import Rule
from mxjax.policies import PrecisionPolicy

__all__ = ["LinenDotGeneral", "LinenWrapped", "linen_dot_general_cls"]


class LinenDotGeneral(nn.Module):
    """A Linen module with ``lax.dot_general``'s call signature running `policy`.

    Randomized policies draw a key from the ``'mxjax'`` RNG collection with
    ``make_rng`` (the module path is folded in, so each layer gets its own
    noise; pass a new key per step). Use through ``nn.Dense(dot_general_cls=
    mxjax.nn.linen_dot_general_cls(policy))``; deterministic policies can also
    be passed as ``nn.Dense(dot_general=policy.dot_general())``.
    """

    policy: PrecisionPolicy
    rng_collection: str = RNG_STREAM

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 **kwargs):
        key = self.make_rng(self.rng_collection) if self.policy.needs_key else None
        return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                           policy=self.policy, key=key)


def linen_dot_general_cls(policy: PrecisionPolicy | str, rng_collection: str = RNG_STREAM):
    """A ``dot_general_cls`` for ``nn.Dense``/``nn.DenseGeneral`` that applies `policy`."""
    return functools.partial(LinenDotGeneral, policy=policies.get(policy),
                             rng_collection=rng_collection)


def _root_scopes(module: nn.Module, method) -> tuple[str, ...]:
    """The names the scope Flax opens around the applied method may have (() for a function
    that is not a method): the module's name, else the name of its class or of the class
    a lifted transform (``nn.jit(Cls)``: ``JitCls``) wraps."""
    if method is not None and not isinstance(method, str):
        name = getattr(method, "__name__", None)
        if name is None or getattr(type(module), name, None) is not method:
            return ()
    if module.name is not None:
        return (module.name,)
    return tuple(c.__name__ for c in type(module).__mro__
                 if issubclass(c, nn.Module) and c is not nn.Module)


class LinenWrapped(Reporting):
    """A Linen module whose dot_generals run under path rules (from ``mxjax.nn.wrap``).

    ``init`` is the module's own. ``apply(variables, *args, rngs=None,
    method=None, mutable=False, **kwargs)`` is the module's ``apply`` with every
    dot_general (Dense, DenseGeneral, Einsum, attention, and ``jnp.einsum``/
    ``jnp.dot``/``@`` in the module's code) replaced by the matching rule's
    policy. Randomized policies take their key from ``rngs['mxjax']``.
    Module paths are Linen's call paths, read from the scopes Flax opens
    around each module call ('/'-joined, root ``''``, e.g. ``'Block_0/Dense_1'``;
    ``mxjax.nn.paths``); the parameters (for operand kinds) are ``variables``.
    Nothing is intercepted: the module runs exactly as ``module.apply`` does.
    ``report()`` returns the last call's WrapReport (``last_report``);
    ``report(variables, *args, **kwargs)`` traces one abstractly.
    """

    def __init__(self, module: nn.Module, rules: tuple[Rule, ...]):
        self.module = module
        self.rules = rules
        self.needs_key = rules_need_key(rules)
        self._box = ReportBox()

    def init(self, rngs, *args, **kwargs):
        """The wrapped module's ``init`` (parameters are the same as unwrapped)."""
        return self.module.init(rngs, *args, **kwargs)

    def _split_rngs(self, rngs) -> tuple[Any, Any]:
        if rngs is None:
            return None, None
        if not isinstance(rngs, dict):
            raise TypeError(f"rngs: expected a dict of PRNG keys, got {type(rngs).__name__}")
        rest = dict(rngs)
        return rest.pop(RNG_STREAM, None), (rest or None)

    def _trace(self, args, kwargs, *, abstract_key):
        if not args:
            raise TypeError("report: expected the apply arguments (variables, *args, **kwargs)")
        kwargs = dict(kwargs)
        rngs = kwargs.pop("rngs", None)
        method = kwargs.pop("method", None)
        mutable = kwargs.pop("mutable", False)
        if abstract_key and self.needs_key and (rngs is None or RNG_STREAM not in rngs):
            rngs = {**(rngs or {}), RNG_STREAM: placeholder_key()}
        return self._call(args[0], args[1:], kwargs, rngs, method, mutable)

    def _call(self, variables, args, kwargs, rngs, method, mutable):
        key, rest = self._split_rngs(rngs)
        if self.needs_key and key is None:
            raise missing_key_error("rngs", "rngs={'mxjax': key} (a new key each step) to apply")

        returns_state = mutable is not False  # Flax's apply returns (output, variables)

        def fn(variables, rest, *args, **kwargs):
            out = self.module.apply(variables, *args, rngs=rest, method=method,
                                    mutable=mutable, **kwargs)
            return out if returns_state else (out, None)

        paths = PathSource(front_end="linen", roots=_root_scopes(self.module, method))
        (out, state), report = transform_call(
            fn, (variables, rest, *args), kwargs, rules=self.rules, key=key, param_args=(0,),
            paths=paths, aux_output=True)
        return ((out, state) if returns_state else out), report

    def apply(self, variables, *args, rngs=None, method=None, mutable=False, **kwargs):
        out, report = self._call(variables, args, kwargs, rngs, method, mutable)
        self._record(report)
        return out

    def __repr__(self) -> str:
        return f"mxjax.nn.wrap({type(self.module).__name__}, {len(self.rules)} rule(s))"
