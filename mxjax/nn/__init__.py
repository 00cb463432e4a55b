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
  paths: ``mxjax.nn.paths``; ``wrapped.report(*call_args)`` says what each
  matmul got (look before training: a rule matching nothing only warns, once).
"""

from mxjax.nn.frontend import RNG_STREAM
from mxjax.nn.interpret import transform_call
from mxjax.nn.linen import LinenDotGeneral, LinenWrapped, linen_dot_general_cls
from mxjax.nn.nnx import NnxDotGeneral, NnxEinsumOp, NnxWrapped
from mxjax.nn.rules import HEAD_NAMES, KINDS, NOT_GEMM, Rule, Site, WrapReport
from mxjax.nn.wrap import FunctionWrapped, wrap

__all__ = [
    "HEAD_NAMES",
    "KINDS",
    "NOT_GEMM",
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
