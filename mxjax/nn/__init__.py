"""Flax integration: policy modules for Linen and NNX layers, and ``wrap``.

* Layers: ``nn.Dense(dot_general=policy.dot_general())`` (deterministic),
  ``nn.Dense(dot_general_cls=mxjax.nn.linen_dot_general_cls(policy))`` (any
  policy; randomized ones draw from the ``'mxjax'`` RNG collection),
  ``nnx.Linear(dot_general=mxjax.nn.NnxDotGeneral(policy, rngs=rngs))``,
  ``nnx.Einsum(einsum_op=mxjax.nn.NnxEinsumOp(policy, rngs=rngs))``,
  ``jnp.einsum(..., _dot_general=policy.dot_general(key))``.
* ``mxjax.nn.wrap(model, policy_or_rules)``: a whole existing model (Linen, NNX,
  or a function), including matmuls it writes itself (``jnp.einsum``,
  ``jnp.dot``, ``@``), with ``Rule(path=regex, policy=..., operands=kind)`` per
  module path and operand kind (``'weight'``: the linear layers, the default;
  ``'activation'``: attention; ``'head'``: the output head; ``'any'``). Module
  names are kept in name stacks; ``wrapped.report()`` says what each matmul got.
"""

from mxjax.nn.frontend import RNG_STREAM
from mxjax.nn.interpret import transform_call
from mxjax.nn.linen import LinenDotGeneral, LinenWrapped, linen_dot_general_cls
from mxjax.nn.nnx import NnxDotGeneral, NnxEinsumOp, NnxWrapped
from mxjax.nn.rules import HEAD_NAMES, KINDS, Rule, Site, WrapReport
from mxjax.nn.wrap import FunctionWrapped, wrap

__all__ = [
    "HEAD_NAMES",
    "KINDS",
    "RNG_STREAM",
    "FunctionWrapped",
    "LinenDotGeneral",
    "LinenWrapped",
    "NnxDotGeneral",
    "NnxEinsumOp",
    "NnxWrapped",
    "Rule",
    "Site",
    "WrapReport",
    "linen_dot_general_cls",
    "transform_call",
    "wrap",
]
