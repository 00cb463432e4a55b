"""Flax NNX integration: policy modules for ``dot_general``/``einsum_op`` and the NNX wrapper."""

from __future__ import annotations

import contextlib
import functools
import inspect
import types

import jax
import jax.numpy as jnp
from flax import nnx

from mxjax import policies
from mxjax.interceptor import dot_general
from mxjax.nn.frontend import RNG_STREAM, ReportBox, Reporting, placeholder_key, rules_need_key
from mxjax.nn.interpret import marker, transform_call
from mxjax.nn.rules import Rule
from mxjax.policies import PrecisionPolicy

__all__ = ["NnxDotGeneral", "NnxEinsumOp", "NnxWrapped"]


def _check_stream(rngs, stream: str, what: str) -> None:
    if rngs is None or stream not in rngs:
        raise ValueError(
            f"rngs: {what} uses a randomized policy and needs an nnx.Rngs with a {stream!r} "
            f"stream, e.g. nnx.Rngs(0, {stream}=1)"
        )


def _stream_key(rngs, stream: str, what: str):
    _check_stream(rngs, stream, what)
    return getattr(rngs, stream)()


class NnxDotGeneral(nnx.Module):
    """An NNX module with ``lax.dot_general``'s call signature running `policy`.

    Pass it as ``nnx.Linear(..., dot_general=NnxDotGeneral(policy, rngs=rngs))``.
    Randomized policies draw a fresh key from ``rngs.mxjax()`` on every call;
    share one ``nnx.Rngs`` between layers so each layer and step gets its own
    noise (same seed, same run).
    """

    def __init__(self, policy: PrecisionPolicy | str, *, rngs: nnx.Rngs | None = None,
                 stream: str = RNG_STREAM):
        self.policy = policies.get(policy)
        self.stream = stream
        if self.policy.needs_key:
            _check_stream(rngs, stream, "NnxDotGeneral")
        self.rngs = rngs if self.policy.needs_key else None

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 **kwargs):
        key = (_stream_key(self.rngs, self.stream, "NnxDotGeneral") if self.policy.needs_key
               else None)
        return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                           policy=self.policy, key=key)


class NnxEinsumOp(nnx.Module):
    """``jnp.einsum`` under `policy`, for ``nnx.Einsum(..., einsum_op=NnxEinsumOp(policy))``."""

    def __init__(self, policy: PrecisionPolicy | str, *, rngs: nnx.Rngs | None = None,
                 stream: str = RNG_STREAM):
        self.dot_general = NnxDotGeneral(policy, rngs=rngs, stream=stream)

    def __call__(self, subscripts, *operands, **kwargs):
        return jnp.einsum(subscripts, *operands, _dot_general=self.dot_general, **kwargs)


# --------------------------------------------------------------------------- #
# Scoping module calls by path (on the wrapper's private merged copy only)
# --------------------------------------------------------------------------- #
_PATH_ATTR = "_mxjax_path"
_BASE_NAMES = frozenset(dir(nnx.Module))
_SKIP_TYPES = tuple(getattr(nnx, n) for n in ("List", "Dict") if hasattr(nnx, n))
_SCOPED: dict[type, type] = {}


def _scoped_method(f):
    @functools.wraps(f)
    def method(self, *args, **kwargs):
        path = self.__dict__.get(_PATH_ATTR)
        if path is None:
            return f(self, *args, **kwargs)
        with jax.named_scope(marker(path)):
            return f(self, *args, **kwargs)

    method._mxjax_scoped = True
    return method


def _scoped_class(cls: type) -> type:
    """A subclass of `cls` whose __call__ and public methods open the module's path scope."""
    if getattr(cls, "_mxjax_scoped_class", False):
        return cls
    sub = _SCOPED.get(cls)
    if sub is None:
        ns = {"_mxjax_scoped_class": True, "__module__": cls.__module__,
              "__qualname__": cls.__qualname__}
        for name in dir(cls):
            if name != "__call__" and (name.startswith("_") or name in _BASE_NAMES):
                continue
            attr = inspect.getattr_static(cls, name, None)
            if isinstance(attr, types.FunctionType):
                ns[name] = _scoped_method(attr)
        sub = type(cls)(cls.__name__, (cls,), ns)
        _SCOPED[cls] = sub
    return sub


@contextlib.contextmanager
def _scoped(root: nnx.Module):
    changed = []
    try:
        for path, m in nnx.iter_modules(root):
            if isinstance(m, _SKIP_TYPES):
                continue
            cls = type(m)
            object.__setattr__(m, "__class__", _scoped_class(cls))
            m.__dict__[_PATH_ATTR] = "/".join(str(p) for p in path)
            changed.append((m, cls))
        yield
    finally:
        for m, cls in changed:
            m.__dict__.pop(_PATH_ATTR, None)
            object.__setattr__(m, "__class__", cls)


class NnxWrapped(Reporting, nnx.Module):
    """An NNX module whose dot_generals run under path rules (from ``mxjax.nn.wrap``).

    Calling it calls the wrapped module (``.module``) with every dot_general
    (``nnx.Linear``, ``nnx.Einsum``, attention, ``jnp.einsum``/``jnp.dot``/``@``
    in the module's own code) under the first matching rule's policy. Module
    paths are NNX graph paths ('/'-joined, e.g. ``'layers/0/mlp/up'``; root
    ``''``); the parameters (for operand kinds) are the module's state.
    Randomized policies draw ``rngs.mxjax()`` once per call (a new key each
    step; per-layer noise is derived from it). State updates of the wrapped
    module (e.g. batch statistics) are written back. ``report()`` returns the
    last call's WrapReport (``last_report``); ``report(*args)`` traces one
    abstractly.
    """

    def __init__(self, module: nnx.Module, rules: tuple[Rule, ...], *,
                 rngs: nnx.Rngs | None = None):
        self.module = module
        self.rules = rules
        self.needs_key = rules_need_key(rules)
        if self.needs_key:
            _check_stream(rngs, RNG_STREAM, "mxjax.nn.wrap")
        self.rngs = rngs if self.needs_key else None
        self._box = ReportBox()

    def _trace(self, args, kwargs, *, abstract_key):
        if abstract_key:
            key = placeholder_key() if self.needs_key else None
        else:
            key = _stream_key(self.rngs, RNG_STREAM, "mxjax.nn.wrap") if self.needs_key else None
        graphdef, state = nnx.split(self.module)

        def fn(state, *args, **kwargs):
            m = nnx.merge(graphdef, state)
            with _scoped(m):
                out = m(*args, **kwargs)
            return out, nnx.state(m)

        return transform_call(fn, (state, *args), kwargs, rules=self.rules, key=key,
                              param_args=(0,))

    def __call__(self, *args, **kwargs):
        (out, new_state), self._box.report = self._trace(args, kwargs, abstract_key=False)
        nnx.update(self.module, new_state)
        return out
