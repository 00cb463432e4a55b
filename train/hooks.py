"""Extension points of a training run (`Hooks`) and what the in-step hook sees.

Hooks let other code (`train.diagnostics.numerics`, tests) add metrics without touching the
step: ``forward`` replaces the model call (returning logits and an aux pytree),
``in_step`` computes extra scalars/arrays inside the jitted step from a
`StepContext`, ``on_record`` adds host-side fields to each metrics record,
``diagnostics`` collects quantized-GEMM statistics. With no hooks the compiled
step is the plain one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepContext:
    """What an ``in_step`` hook sees (all traced values inside the jitted step).

    params/grads/new_params: pytrees like the model's pure param dict (fp32).
    ``grads`` are the averaged, unclipped gradients; ``new_params`` the
    parameters after the update (before the non-finite guard). loss, grad_norm,
    lr: f32 scalars; step: int32 scalar (the step being taken, 0-based); aux:
    the forward hook's auxiliary output averaged over micro-batches ({} without).
    """

    params: Any
    grads: Any
    new_params: Any
    loss: jax.Array
    grad_norm: jax.Array
    lr: jax.Array
    step: jax.Array
    aux: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hooks:
    """Optional extension points of a run (see the module docstring)."""

    forward: Callable[..., tuple[jax.Array, Any]] | None = None
    """``forward(model, tokens int32[b, T], *, policy, policy_key, step) -> (logits
    f32[b, T, V], aux)``; ``step`` is the traced int32 step (2**31-1 in evaluation)."""
    in_step: Callable[[StepContext], Mapping[str, Any]] | None = None
    """Returns a dict of arrays computed in the step; they land in the metrics record."""
    on_record: Callable[[dict[str, Any]], Mapping[str, Any] | None] | None = None
    """Host side, called with each record before it is written; may return fields to add."""
    diagnostics: Any = None
    """An ``mxjax.diagnostics.DiagnosticsConfig``: collect the stats of every quantized GEMM
    of the step (``mxjax.diagnostics.value_and_grad_with_stats``); they reach ``in_step``
    as ``ctx.aux['gemm_stats']`` f32[n_slots, 3, fields] (averaged over micro-batches).
    Losses and gradients are unchanged; None (default) compiles the plain step."""
