"""Flax NNX integration: policy modules for ``dot_general``/``einsum_op`` and the NNX wrapper."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mxjax import policies
from mxjax.interceptor import dot_general
from mxjax.nn.frontend import RNG_STREAM, ReportBox, Reporting, placeholder_key, rules_need_key
from mxjax.nn.interpret import transform_call
from mxjax.nn.paths import PathSource
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


_NNX_PATHS = PathSource(front_end="nnx")


class NnxWrapped(Reporting, nnx.Module):
    """An NNX module whose dot_generals run under path rules (from ``mxjax.nn.wrap``).

    Calling it calls the wrapped module (``.module``) with every dot_general
    (``nnx.Linear``, ``nnx.Einsum``, attention, ``jnp.einsum``/``jnp.dot``/``@``
    in the module's own code) under the first matching rule's policy. Module
    paths are NNX graph paths ('/'-joined, e.g. ``'layers/0/mlp/up'``; root
    ``''``) read from the data flow: a weight matmul is at the module owning
    its weight, a matmul of two activations at the deepest module containing
    the modules both operands come from (``mxjax.nn.paths``). The parameters
    (for operand kinds) are the module's state. The call runs on a private
    copy (``nnx.split``/``nnx.merge`` of the module's state): the user's module
    objects are never touched, through any NNX transform inside the model
    (``nnx.scan``/``remat``/``vmap``/``jit``) and bridge modules
    (``nnx.bridge.ToNNX``).
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
            out = m(*args, **kwargs)
            return out, nnx.state(m)

        return transform_call(fn, (state, *args), kwargs, rules=self.rules, key=key,
                              param_args=(0,), paths=_NNX_PATHS, aux_output=True)

    def __call__(self, *args, **kwargs):
        (out, new_state), report = self._trace(args, kwargs, abstract_key=False)
        self._record(report)
        nnx.update(self.module, new_state)
        return out
