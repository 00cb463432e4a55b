"""chex-based assertions for users' own numerical-equivalence tests of mxjax models.

* ``assert_equivalent(f, g, *args)``: outputs and gradients of two functions
  equal bit for bit (or within a stated bound), jitted.
* ``assert_matches_reference(make_fn, policy, *args)``: a model built with
  `policy` equals the same model under the exact XLA reference backend
  (bit for bit for ``backend='xla'``; kernel backends within the caller's bound).
* ``assert_passthrough_exact(fn, wrapped_fn, *args)``: a pass-through policy
  (``bf16``) gives exactly the unwrapped model's outputs and gradients.
* ``assert_quantized_weight_matmuls(report, policy)``: from a
  ``mxjax.nn.WrapReport``, every linear layer got the policy and nothing else
  was quantized.
* ``program_text(compiled)``: a compiled program's optimized HLO without its
  metadata and source-location tables, to assert two programs are the same.

Gradients are vector-Jacobian products with a fixed pseudo-random cotangent
(not all-ones, which quantizes exactly), w.r.t. the positional arguments in
`argnums`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp

from mxjax import policies
from mxjax.policies import PrecisionPolicy

__all__ = [
    "assert_equivalent",
    "assert_matches_reference",
    "assert_passthrough_exact",
    "assert_quantized_weight_matmuls",
    "program_text",
    "reference_policy",
]


def program_text(compiled: jax.stages.Compiled) -> str:
    """The optimized HLO of `compiled` (``jax.jit(f).lower(*args).compile()``) with only
    its instructions: no ``metadata={...}`` and none of the module's source-location
    tables (``FileNames``, ``FunctionNames``, ``FileLocations``, ``StackFrames``), whose
    numbering depends on what the process traced before. Two programs that compute the
    same thing the same way give equal strings."""
    text = re.sub(r",? metadata=\{[^}]*\}", "", compiled.as_text())
    return "\n".join(line for line in text.splitlines()
                     if re.match(r"\s*(ROOT )?%|\s*ENTRY|\s*\}|HloModule", line))


def reference_policy(policy: PrecisionPolicy | str) -> PrecisionPolicy:
    """`policy` with every quantized GEMM on the exact emulation (``backend='xla'``;
    ``PrecisionPolicy.with_backend``)."""
    return policies.get(policy).with_backend("xla")


def _cotangent(out: Any, seed: int) -> Any:
    leaves, treedef = jax.tree.flatten(out)
    keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
    cts = [jax.random.normal(k, jnp.shape(x), x.dtype)
           if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros_like(x)
           for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, cts)


def _outputs_and_grads(fn: Callable, args: tuple, argnums: tuple[int, ...], seed: int,
                       jit: bool):
    def run(*args):
        if not argnums:
            return fn(*args), ()
        diff = tuple(args[i] for i in argnums)

        def on(*d):
            full = list(args)
            for i, x in zip(argnums, d):
                full[i] = x
            return fn(*full)

        out, vjp = jax.vjp(on, *diff)
        return out, vjp(_cotangent(out, seed))

    return (jax.jit(run) if jit else run)(*args)


def assert_equivalent(f: Callable, g: Callable, *args, argnums: int | Sequence[int] = (0,),
                      atol: float = 0.0, rtol: float = 0.0, seed: int = 0,
                      jit: bool = True) -> None:
    """Asserts ``f(*args)`` and ``g(*args)`` agree, and so do their gradients.

    Args:
      f, g: functions of the same positional arguments returning pytrees of arrays.
      *args: the arguments (pytrees of arrays).
      argnums: positional arguments to differentiate (``()``: outputs only).
      atol, rtol: 0 (the default) means bit for bit (``chex.assert_trees_all_equal``);
        otherwise ``chex.assert_trees_all_close`` with these tolerances.
      seed: seed of the pseudo-random output cotangent.
      jit: run both under ``jax.jit`` (the default) or eagerly.
    Raises:
      AssertionError: naming the first leaf that differs.
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if any(not isinstance(i, int) or not 0 <= i < len(args) for i in nums):
        raise ValueError(f"argnums: {argnums!r} must index the {len(args)} positional arguments")
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol, rtol: must be >= 0, got {atol}, {rtol}")
    a = _outputs_and_grads(f, args, nums, seed, jit)
    b = _outputs_and_grads(g, args, nums, seed, jit)
    if atol == 0 and rtol == 0:
        chex.assert_trees_all_equal(a, b)
    else:
        chex.assert_trees_all_close(a, b, atol=atol, rtol=rtol)


def assert_matches_reference(make_fn: Callable[[PrecisionPolicy], Callable],
                             policy: PrecisionPolicy | str, *args,
                             argnums: int | Sequence[int] = (0,), atol: float = 0.0,
                             rtol: float = 0.0, seed: int = 0) -> None:
    """Asserts a model under `policy` equals the same model under the XLA reference backend.

    Args:
      make_fn: builds the function to test from a policy, e.g.
        ``lambda p: mxjax.nn.wrap(model, p).apply`` or
        ``lambda p: Model(dot_general=p.dot_general()).apply``.
      policy: the policy (its backends as the model will run them).
      *args, argnums, seed: as for ``assert_equivalent``.
      atol, rtol: 0 for ``backend='xla'`` (bit for bit). Kernel backends
        (``'pallas'``, ``'triton'``, ...) quantize identically but sum the f32
        products in another order: pass a bound, e.g. ``rtol=1e-6`` times the
        contraction length for f32 outputs (bf16 outputs: bf16's ulp).
    """
    p = policies.get(policy)
    assert_equivalent(make_fn(p), make_fn(reference_policy(p)), *args, argnums=argnums,
                      atol=atol, rtol=rtol, seed=seed)


def assert_passthrough_exact(fn: Callable, wrapped_fn: Callable, *args,
                             argnums: int | Sequence[int] = (0,), seed: int = 0) -> None:
    """Asserts the pass-through policy changes nothing: outputs and grads bit for bit.

    `fn` is the unwrapped model (e.g. ``model.apply``), `wrapped_fn` the same
    model with the pass-through policy (``mxjax.nn.wrap(model, 'passthrough').apply``
    or the model built with ``dot_general=policies.get('passthrough').dot_general()``).
    """
    assert_equivalent(fn, wrapped_fn, *args, argnums=argnums, seed=seed)


def assert_quantized_weight_matmuls(report, policy: PrecisionPolicy | str | None = None, *,
                                    paths: Sequence[str] | None = None,
                                    allow_activation: bool = False,
                                    allow_head: bool = False,
                                    allow_skipped: bool = False) -> None:
    """Asserts from a ``mxjax.nn.WrapReport`` that every weight matmul was quantized.

    Args:
      report: ``wrapped.report()`` (or ``wrapped.last_report``).
      policy: the policy every weight matmul must have (None: any policy that
        is not pass-through).
      paths: if given, the exact set of module paths that must hold weight matmuls.
      allow_activation: whether activation x activation matmuls (attention)
        may be quantized too (default: they must be left unchanged).
      allow_head: likewise for output heads.
      allow_skipped: whether matmuls wrap could not reach (inside a
        ``custom_vjp``) are acceptable.
    Raises:
      AssertionError: listing the offending sites.
    """
    want = None if policy is None else policies.get(policy)
    weights = [s for s in report.sites if s.kind == "weight"]
    if not weights:
        raise AssertionError("no weight matmul in the report (nothing to check)")
    wrong = [s for s in weights if s.policy is None or s.policy.is_passthrough
             or (want is not None and s.policy != want)]
    if wrong:
        raise AssertionError("weight matmuls without the expected policy: " + "; ".join(
            f"{s.path or '(root)'}#{s.index}: {s.policy.name if s.policy else None} ({s.why})"
            for s in wrong))
    if paths is not None and {s.path for s in weights} != set(paths):
        raise AssertionError(f"weight matmul paths {sorted({s.path for s in weights})} != "
                             f"expected {sorted(set(paths))}")
    extra = [s for s in report.sites if s.policy is not None and not s.policy.is_passthrough
             and ((s.kind == "activation" and not allow_activation)
                  or (s.kind == "head" and not allow_head))]
    if extra:
        raise AssertionError("quantized although not a weight matmul: " + "; ".join(
            f"{s.path or '(root)'}#{s.index} ({s.kind})" for s in extra))
    if report.skipped and not allow_skipped:
        raise AssertionError(f"matmuls wrap could not reach: {list(report.skipped)}")
