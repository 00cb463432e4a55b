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
(when a policy is randomized, with an iteration counter folded into the keys,
so each iteration, e.g. each scanned layer, draws its own noise). A
dot_general inside a ``custom_vjp`` is left alone and reported as skipped. Any
other primitive with a dot_general inside raises NotImplementedError.

Name stacks: everything the interpreter emits for an equation (a re-bound
equation, the quantized GEMM with its quantizer ops, the re-emitted
remat/scan/while/cond and inlined jit bodies) runs under the name stack of the
equation it replaces (``jax.extend.source_info_util.user_context``), without the
wrappers' ``mxjax[...]`` marker scopes, so ``jax.make_jaxpr``, HLO ``op_name``
metadata and profiles show the same module paths as the unwrapped model.

Operand kinds: a data-dependence analysis of the jaxpr from its inputs (each
input is a parameter or data; ``param_args`` says which) finds, for every
value, whether it is computed from parameters (and constants) alone and from
which parameters. A dot_general is a ``'weight'`` site when at least one
operand is computed from parameters alone (a parameter, possibly cast,
reshaped, transposed or sliced), an ``'activation'`` site when both depend on
data, and a ``'head'`` site (an output head) when its parameter-only operand
comes from a parameter the program also reads with a ``gather`` at
data-dependent indices (an embedding table: a tied head, e.g. ``jnp.dot(x,
embedding.T)`` or ``nn.Embed.attend``), or when its module path's last
component, or a component of its parameter's pytree path (e.g.
``params/lm_head/kernel``), fully matches ``rules.HEAD_NAMES`` (``lm_head``,
``head``, ...).
Loops are analysed to a fixed point (a scan carry that mixes in data is data).

Randomness: the key of a dot_general is ``fold_in(key, crc32(path#index))``
folded with the enclosing loop counters, then split per GEMM by
``mxjax.dot_general``.
"""

from __future__ import annotations

import contextlib
import re
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend import source_info_util as siu

from mxjax.interceptor import dot_general as policy_dot_general
from mxjax.nn.analysis import (
    NO_PARAMS,
    analyze,
    call_jaxpr,
    eqn_deps,
    has_dot,
    join_all,
    open_jaxpr,
    read_dep,
    scan_counts,
    sub_jaxprs,
)
from mxjax.nn.rules import HEAD_NAMES, Rule, Site, WrapReport

__all__ = ["MARKER_PREFIX", "marker", "module_path", "transform_call"]

MARKER_PREFIX = "mxjax["
_MARKER_RE = re.compile(r"mxjax\[([^\]]*)\]")
_DOT = jcore.primitives.dot_general_p


def marker(path: str) -> str:
    """The named-scope name that tags everything under it with module `path`."""
    return f"{MARKER_PREFIX}{path}]"


def clean_name_stack(name_stack):
    """`name_stack` (a ``NameStack``) without the wrappers' marker scopes."""
    return type(name_stack)(tuple(s for s in name_stack.stack
                                  if not s.name.startswith(MARKER_PREFIX)))


@contextlib.contextmanager
def _as(eqn):
    """Binds what follows as `eqn` was bound: its name stack (no markers) and traceback."""
    ns = siu.current_name_stack() + clean_name_stack(eqn.source_info.name_stack)
    with siu.user_context(eqn.source_info.traceback, name_stack=ns), eqn.ctx.manager:
        yield


def module_path(name_stack: str) -> str:
    """Innermost marked module path in a '/'-joined name stack (else the stack itself)."""
    found = _MARKER_RE.findall(name_stack)
    if found:
        return found[-1]
    return name_stack.strip("/")


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
    """Trace-time state: rules, the base key, embedding tables, and what was found."""

    def __init__(self, rules: tuple[Rule, ...], key, tables: frozenset, head_params: frozenset):
        self.rules = rules
        self.key = key
        self.tables = tables
        self.head_params = head_params
        self.sites: list[Site] = []
        self.skipped: list[str] = []
        self._counts: dict[str, int] = {}
        self.has_dot_cache: dict = {}

    def match(self, path: str, kind: str) -> tuple[int | None, Any]:
        for i, r in enumerate(self.rules):
            if r.matches(path, kind):
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


def _kind(path: str, lhs_dep, rhs_dep, ctx: _Ctx) -> tuple[str, str]:
    """(kind, why) of a dot_general from its operands' dependences."""
    if lhs_dep is None and rhs_dep is None:
        return "activation", "both operands depend on the inputs"
    sides = [n for n, d in (("lhs", lhs_dep), ("rhs", rhs_dep)) if d is not None]
    side = sides[0] if len(sides) == 1 else "lhs and rhs"
    params = join_all(d for d in (lhs_dep, rhs_dep) if d is not None)
    if params & ctx.tables:
        return "head", f"{side} is the embedding table (a parameter also read by a gather)"
    if params & ctx.head_params:
        return "head", f"{side} from a parameter named like an output head"
    if re.fullmatch(HEAD_NAMES, path.rsplit("/", 1)[-1]):
        return "head", f"{side} from parameters alone, in a module named like an output head"
    what = "parameters alone" if params else "constants alone"
    return "weight", f"{side} computed from {what}"


def _dot(eqn, invals, deps, ctx: _Ctx, stack: str, salts: tuple):
    lhs, rhs = invals
    path = module_path(stack)
    idx = ctx.next_index(path)
    kind, why = _kind(path, deps[0], deps[1], ctx)
    rule, policy = ctx.match(path, kind)
    note = ""
    if policy is None:
        why += "; no rule selects this path and kind: unchanged"
    else:
        why += f"; rule {rule}"
    if policy is not None and not (jnp.issubdtype(lhs.dtype, jnp.floating)
                                   and jnp.issubdtype(rhs.dtype, jnp.floating)):
        note, policy = "non-float operands: left unchanged", None
        why += f" ({note})"
    ctx.sites.append(Site(path, idx, rule, policy, tuple(lhs.shape), tuple(rhs.shape), note,
                          kind, why))
    params = eqn.params
    if policy is None or policy.is_passthrough:  # the equation itself: the same program
        return _rebind(eqn, invals)[0]
    key = None
    if policy.needs_key:
        if ctx.key is None:
            raise ValueError(
                f"key: the policy for module path {path!r} ({policy.name or 'custom'}) "
                "is randomized "
                "and needs a key: pass rngs={'mxjax': key} (Linen), an nnx.Rngs with an 'mxjax' "
                "stream (NNX) or mxjax_key= (functions)"
            )
        key = jax.random.fold_in(ctx.key, zlib.crc32(f"{path}#{idx}".encode()) & 0x7FFFFFFF)
        for s in salts:
            key = jax.random.fold_in(key, s)
    with _as(eqn):
        return policy_dot_general(
            lhs, rhs, params["dimension_numbers"], params.get("precision"),
            params.get("preferred_element_type"), policy=policy, key=key,
            out_sharding=params.get("out_sharding"))


def _eval(j, args, deps, ctx: _Ctx, prefix: str, salts: tuple) -> list:
    jaxpr, consts = open_jaxpr(j)
    env: dict = {}
    denv: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v], denv[v] = x, NO_PARAMS
    for v, x, d in zip(jaxpr.invars, args, deps, strict=True):
        env[v], denv[v] = x, d
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        ins = [read_dep(denv, v) for v in eqn.invars]
        out_deps, sub_ins = eqn_deps(eqn, ins, None)
        stack = _join(prefix, _stack_str(eqn))
        if eqn.primitive is _DOT:
            outs = [_dot(eqn, invals, ins, ctx, stack, salts)]
        elif any(has_dot(s, ctx.has_dot_cache) for s in sub_jaxprs(eqn.params)):
            with _as(eqn):
                outs = _higher_order(eqn, invals, [d for _, d in sub_ins], ctx, stack, salts)
        else:
            outs = _rebind(eqn, invals)
        for v, x, d in zip(eqn.outvars, outs, out_deps, strict=True):
            env[v], denv[v] = x, d
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals) -> list:
    ans = eqn.primitive.bind(*invals, **_bind_params(eqn))
    return list(ans) if eqn.primitive.multiple_results else [ans]


def _rebind(eqn, invals) -> list:
    with _as(eqn):
        return _bind(eqn, invals)


def _higher_order(eqn, invals, sub_deps: list, ctx: _Ctx, stack: str, salts: tuple) -> list:
    """Re-emits a higher-order equation with a dot_general inside; called under ``_as(eqn)``.

    `sub_deps`: the input dependences of each sub-jaxpr, from `eqn_deps`.
    """
    name = eqn.primitive.name
    p = eqn.params
    if name in ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call"):
        return _eval(call_jaxpr(p), invals, sub_deps[0], ctx, stack, salts)
    if name in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
        ctx.skipped.append(f"{module_path(stack) or '(root)'}: dot_general inside a custom_vjp "
                           "(left unchanged)")
        return _bind(eqn, invals)  # already under the equation's name stack
    if name in ("remat", "remat2", "checkpoint"):
        def body(*args):
            return _eval(p["jaxpr"], list(args), sub_deps[0], ctx, stack, salts)

        return list(jax.checkpoint(body, prevent_cse=p.get("prevent_cse", True),
                                   policy=p.get("policy"))(*invals))
    if name == "scan":
        n_consts, n_carry = scan_counts(p)
        consts, init, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                            invals[n_consts + n_carry:])

        counted = ctx.key is not None  # an iteration counter only where noise needs it

        def scan_body(carry, x):
            i, c = carry if counted else (None, carry)
            outs = _eval(p["jaxpr"], [*consts, *c, *x], sub_deps[0], ctx, stack,
                         salts + (i,) if counted else salts)
            new = outs[:n_carry]
            return ((i + 1, new) if counted else new), outs[n_carry:]

        init_carry = (jnp.int32(0), list(init)) if counted else list(init)
        final, ys = lax.scan(scan_body, init_carry, list(xs), length=p["length"],
                             reverse=p["reverse"], unroll=p.get("unroll", 1))
        final = final[1] if counted else final
        return [*final, *ys]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
        if has_dot(p["cond_jaxpr"], ctx.has_dot_cache):
            raise NotImplementedError("mxjax.nn: a dot_general in a while_loop condition")

        counted = ctx.key is not None

        def cond_fn(carry):
            c = carry[1] if counted else carry
            return _eval(p["cond_jaxpr"], [*cconsts, *c], sub_deps[0], ctx, stack, salts)[0]

        def body_fn(carry):
            if not counted:
                return _eval(p["body_jaxpr"], [*bconsts, *carry], sub_deps[1], ctx, stack, salts)
            i, c = carry
            return i + 1, _eval(p["body_jaxpr"], [*bconsts, *c], sub_deps[1], ctx, stack,
                                salts + (i,))

        if not counted:
            return list(lax.while_loop(cond_fn, body_fn, list(init)))
        return list(lax.while_loop(cond_fn, body_fn, (jnp.int32(0), list(init)))[1])
    if name == "cond":
        index, ops = invals[0], invals[1:]

        def branch(b, d):
            return lambda *a: _eval(b, list(a), d, ctx, stack, salts)

        branches = [branch(b, d) for b, d in zip(p["branches"], sub_deps, strict=True)]
        return list(lax.switch(index, branches, *ops))
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


def _key_name(k) -> str:
    """The name of one pytree path entry (dict key, attribute or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _mask(tree, value: bool):
    return jax.tree.map(lambda _: value, tree)


def transform_call(fn: Callable, args: tuple, kwargs: dict, *, rules: tuple[Rule, ...], key,
                   prefix: str = "", param_args: tuple[int, ...] = ()) -> tuple[Any, WrapReport]:
    """Calls ``fn(*args, **kwargs)`` with every dot_general under its rule's policy.

    Array leaves of ``(args, kwargs)`` are traced; every other leaf is static.
    The array leaves of the positional arguments listed in `param_args` are the
    parameters (for operand kinds); all other array leaves are data. Arrays
    `fn` closes over count as parameters too.
    Returns ``(output, report)``.
    """
    for i in param_args:
        if not isinstance(i, int) or not 0 <= i < len(args):
            raise ValueError(f"param_args: {i!r} is not a positional argument index "
                             f"(there are {len(args)})")
    is_param = jax.tree_util.tree_leaves(
        (tuple(_mask(a, i in param_args) for i, a in enumerate(args)), _mask(kwargs, False)))
    paths, _ = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    if len(is_param) != len(leaves):  # pragma: no cover - tree.map keeps the structure
        raise AssertionError("mxjax.nn: parameter mask does not match the arguments")
    dyn_idx = [i for i, x in enumerate(leaves) if _is_dynamic(x)]

    def flat_fn(*dyn):
        full = list(leaves)
        for i, d in zip(dyn_idx, dyn):
            full[i] = d
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return fn(*a, **k)

    dyn = [leaves[i] for i in dyn_idx]
    deps = [frozenset({n}) if is_param[i] else None for n, i in enumerate(dyn_idx)]
    head_params = frozenset(n for n, i in enumerate(dyn_idx) if is_param[i]
                            and any(re.fullmatch(HEAD_NAMES, _key_name(k)) for k in paths[i][0]))
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
    tables: set = set()
    analyze(closed, deps, tables)
    ctx = _Ctx(rules, key, frozenset(tables), head_params)
    outs = _eval(closed, dyn, deps, ctx, prefix, ())
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs), ctx.report()
