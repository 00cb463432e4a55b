"""A function transform that runs every dot_general of a traced function under a policy.

``transform_call(fn, args, kwargs, rules=..., key=...)`` traces ``fn`` to a jaxpr
(``jax.make_jaxpr``), then evaluates the jaxpr again, replacing each
``dot_general`` equation by ``mxjax.dot_general`` with the policy of the first
rule whose regex matches the equation's module path. Nothing is patched: JAX
and the model's code are untouched, and matmuls written anywhere (``jnp.einsum``,
``jnp.dot``, ``@``, Flax layers) are reached because they all lower to the
``dot_general`` primitive.

Module paths come from the equations' name stacks. The Linen and NNX wrappers
open a ``jax.named_scope('mxjax[<path>]')`` around every module method call; the
innermost such scope is the equation's path. Without any marker (a plain
function) the path is the name stack itself ('/'-joined ``jax.named_scope``
names).

Higher-order primitives whose sub-jaxprs contain a dot_general are re-emitted
through the public API: ``jit``/``pjit``/``closed_call`` and ``custom_jvp_call``
are inlined (a custom JVP rule around a matmul is replaced by differentiating
the policy's custom VJP), ``remat`` becomes ``jax.checkpoint``, ``scan``,
``while`` and ``cond`` become ``lax.scan``/``lax.while_loop``/``lax.switch``
with an iteration counter folded into the keys (so each iteration, e.g. each
scanned layer, draws its own noise). A dot_general inside a ``custom_vjp`` is
left alone and reported as skipped. Any other primitive with a dot_general
inside raises NotImplementedError.

Randomness: the key of a dot_general is ``fold_in(key, crc32(path#index))``
folded with the enclosing loop counters, then split per GEMM by
``mxjax.dot_general``.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from mxjax.interceptor import dot_general as policy_dot_general
from mxjax.nn.rules import Rule, Site, WrapReport

try:  # name stacks and tracebacks of re-bound equations (as jax.core.eval_jaxpr does)
    from jax._src import source_info_util as _siu
except ImportError:  # pragma: no cover - only the name stacks of re-bound equations are lost
    _siu = None

__all__ = ["MARKER_PREFIX", "marker", "module_path", "transform_call"]

MARKER_PREFIX = "mxjax["
_MARKER_RE = re.compile(r"mxjax\[([^\]]*)\]")
_DOT = jcore.primitives.dot_general_p


def marker(path: str) -> str:
    """The named-scope name that tags everything under it with module `path`."""
    return f"{MARKER_PREFIX}{path}]"


def module_path(name_stack: str) -> str:
    """Innermost marked module path in a '/'-joined name stack (else the stack itself)."""
    found = _MARKER_RE.findall(name_stack)
    if found:
        return found[-1]
    return name_stack.strip("/")


# --------------------------------------------------------------------------- #
# Sub-jaxpr helpers (jax 0.11: ClosedJaxpr + open Jaxpr; jax 0.12: Jaxpr with consts)
# --------------------------------------------------------------------------- #
def _open(j) -> tuple[Any, list]:
    consts = list(getattr(j, "consts", ()) or ())
    return getattr(j, "jaxpr", j), consts


def _is_jaxpr(v) -> bool:
    return isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))


def _sub_jaxprs(params: dict) -> list:
    out = []
    for v in params.values():
        if _is_jaxpr(v):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out.extend(x for x in v if _is_jaxpr(x))
    return out


def _has_dot(j, cache: dict) -> bool:
    """Whether a (sub-)jaxpr contains a dot_general; `cache` lives for one transform."""
    inner, _ = _open(j)
    hit = cache.get(id(inner))
    if hit is not None and hit[0] is inner:
        return hit[1]
    found = any(e.primitive is _DOT or any(_has_dot(s, cache) for s in _sub_jaxprs(e.params))
                for e in inner.eqns)
    cache[id(inner)] = (inner, found)
    return found


def _bind_params(eqn) -> dict:
    p = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(p, tuple):  # older jax: (subfuns, params)
        subfuns, params = p
        if subfuns:
            raise NotImplementedError(f"mxjax.nn: cannot re-bind {eqn.primitive.name} with subfuns")
        return params
    return p


# --------------------------------------------------------------------------- #
# Interpreter
# --------------------------------------------------------------------------- #
class _Ctx:
    """Trace-time state: rules, the base key, and what was found."""

    def __init__(self, rules: tuple[Rule, ...], key):
        self.rules = rules
        self.key = key
        self.sites: list[Site] = []
        self.skipped: list[str] = []
        self._counts: dict[str, int] = {}
        self.has_dot_cache: dict = {}

    def match(self, path: str) -> tuple[int | None, Any]:
        for i, r in enumerate(self.rules):
            if r.matches(path):
                return i, r.policy
        return None, None

    def next_index(self, path: str) -> int:
        n = self._counts.get(path, 0)
        self._counts[path] = n + 1
        return n

    def report(self) -> WrapReport:
        return WrapReport(tuple(self.sites), self.rules, tuple(self.skipped))


def _stack_str(eqn) -> str:
    return str(eqn.source_info.name_stack)


def _join(prefix: str, s: str) -> str:
    return f"{prefix}/{s}" if prefix and s else (prefix or s)


def _dot(eqn, invals, ctx: _Ctx, stack: str, salts: tuple):
    lhs, rhs = invals
    path = module_path(stack)
    idx = ctx.next_index(path)
    rule, policy = ctx.match(path)
    note = ""
    if policy is not None and not (jnp.issubdtype(lhs.dtype, jnp.floating)
                                   and jnp.issubdtype(rhs.dtype, jnp.floating)):
        note, policy = "non-float operands: left unchanged", None
    ctx.sites.append(Site(path, idx, rule, policy, tuple(lhs.shape), tuple(rhs.shape), note))
    params = eqn.params
    if policy is None:
        return eqn.primitive.bind(lhs, rhs, **_bind_params(eqn))
    key = None
    if policy.needs_key:
        if ctx.key is None:
            raise ValueError(
                f"key: the policy for module path {path!r} ({policy.name or 'custom'}) is randomized "
                "and needs a key: pass rngs={'mxjax': key} (Linen), an nnx.Rngs with an 'mxjax' "
                "stream (NNX) or mxjax_key= (functions)"
            )
        key = jax.random.fold_in(ctx.key, zlib.crc32(f"{path}#{idx}".encode()) & 0x7FFFFFFF)
        for s in salts:
            key = jax.random.fold_in(key, s)
    return policy_dot_general(
        lhs, rhs, params["dimension_numbers"], params.get("precision"),
        params.get("preferred_element_type"), policy=policy, key=key,
        out_sharding=params.get("out_sharding"))


def _eval(j, args, ctx: _Ctx, prefix: str, salts: tuple) -> list:
    jaxpr, consts = _open(j)
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        stack = _join(prefix, _stack_str(eqn))
        if eqn.primitive is _DOT:
            outs = [_dot(eqn, invals, ctx, stack, salts)]
        elif any(_has_dot(s, ctx.has_dot_cache) for s in _sub_jaxprs(eqn.params)):
            outs = _higher_order(eqn, invals, ctx, stack, salts)
        else:
            outs = _rebind(eqn, invals, prefix)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _rebind(eqn, invals, prefix: str) -> list:
    params = _bind_params(eqn)
    if _siu is not None:
        ns = _siu.current_name_stack() + eqn.source_info.name_stack
        with _siu.user_context(eqn.source_info.traceback, name_stack=ns), eqn.ctx.manager:
            ans = eqn.primitive.bind(*invals, **params)
    else:  # pragma: no cover
        ans = eqn.primitive.bind(*invals, **params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def _scan_counts(params: dict) -> tuple[int, int]:
    if "num_consts" in params:  # jax <= 0.11
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # jax 0.12
    return len(consts), len(carry)


def _higher_order(eqn, invals, ctx: _Ctx, stack: str, salts: tuple) -> list:
    name = eqn.primitive.name
    p = eqn.params
    if name in ("pjit", "jit", "closed_call", "core_call"):
        sub = p.get("jaxpr", p.get("call_jaxpr"))
        return _eval(sub, invals, ctx, stack, salts)
    if name == "custom_jvp_call":
        return _eval(p["call_jaxpr"], invals, ctx, stack, salts)
    if name in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
        ctx.skipped.append(f"{module_path(stack) or '(root)'}: dot_general inside a custom_vjp "
                           "(left unchanged)")
        return _rebind(eqn, invals, "")
    if name in ("remat", "remat2", "checkpoint"):
        def body(*args):
            return _eval(p["jaxpr"], list(args), ctx, stack, salts)

        return list(jax.checkpoint(body, prevent_cse=p.get("prevent_cse", True),
                                   policy=p.get("policy"))(*invals))
    if name == "scan":
        n_consts, n_carry = _scan_counts(p)
        consts, init, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                            invals[n_consts + n_carry:])

        def scan_body(carry, x):
            i, c = carry
            outs = _eval(p["jaxpr"], [*consts, *c, *x], ctx, stack, salts + (i,))
            return (i + 1, outs[:n_carry]), outs[n_carry:]

        (_, final), ys = lax.scan(scan_body, (jnp.int32(0), list(init)), list(xs),
                                  length=p["length"], reverse=p["reverse"],
                                  unroll=p.get("unroll", 1))
        return [*final, *ys]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
        if _has_dot(p["cond_jaxpr"], ctx.has_dot_cache):
            raise NotImplementedError("mxjax.nn: a dot_general in a while_loop condition")

        def cond_fn(carry):
            return _eval(p["cond_jaxpr"], [*cconsts, *carry[1]], ctx, stack, salts)[0]

        def body_fn(carry):
            i, c = carry
            return i + 1, _eval(p["body_jaxpr"], [*bconsts, *c], ctx, stack, salts + (i,))

        return list(lax.while_loop(cond_fn, body_fn, (jnp.int32(0), list(init)))[1])
    if name == "cond":
        index, ops = invals[0], invals[1:]
        def branch(b):
            return lambda *a: _eval(b, list(a), ctx, stack, salts)

        return list(lax.switch(index, [branch(b) for b in p["branches"]], *ops))
    raise NotImplementedError(
        f"mxjax.nn: cannot intercept a dot_general inside the {name!r} primitive "
        f"(module path {module_path(stack)!r}); apply the policy inside it with "
        "policy.dot_general(...) instead"
    )


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #
def _is_dynamic(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def transform_call(fn: Callable, args: tuple, kwargs: dict, *, rules: tuple[Rule, ...], key,
                   prefix: str = "") -> tuple[Any, WrapReport]:
    """Calls ``fn(*args, **kwargs)`` with every dot_general under its rule's policy.

    Array leaves of ``(args, kwargs)`` are traced; every other leaf is static.
    Returns ``(output, report)``.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dyn_idx = [i for i, x in enumerate(leaves) if _is_dynamic(x)]

    def flat_fn(*dyn):
        full = list(leaves)
        for i, d in zip(dyn_idx, dyn):
            full[i] = d
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return fn(*a, **k)

    dyn = [leaves[i] for i in dyn_idx]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
    ctx = _Ctx(rules, key)
    outs = _eval(closed, dyn, ctx, prefix, ())
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs), ctx.report()
