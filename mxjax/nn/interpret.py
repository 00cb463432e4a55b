"""A function transform that runs every dot_general of a traced function under a policy.

``transform_call(fn, args, kwargs, rules=..., key=..., paths=...)`` traces ``fn``
to a jaxpr (``jax.make_jaxpr``), then evaluates the jaxpr again, replacing each
``dot_general`` equation by ``mxjax.dot_general`` with the policy of the first
rule whose regex matches the equation's module path and whose kinds include its
operand kind. Nothing is patched and nothing is added to the traced code: JAX,
Flax and the model are untouched, and matmuls written anywhere (``jnp.einsum``,
``jnp.dot``, ``@``, Flax layers) are reached because they all lower to the
``dot_general`` primitive.

Module paths (``mxjax.nn.paths``) are read from the program itself: the name
stacks Flax's Linen modules put there, and for NNX the data flow from the
module state. So a reused trace (``jax.jit``/``nn.jit``/``nnx.jit`` caches,
remat/scan caches) gives the same paths as a fresh one, and a plain call after
a wrapped one sees nothing of mxjax.

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
equation it replaces (``jax.extend.source_info_util.user_context``), so
``jax.make_jaxpr``, HLO ``op_name`` metadata and profiles show the unwrapped
model's names; a matmul's own ops get the trailing components of its module
path the name stack lacks (NNX: the whole path), so that their ``op_name`` ends
with the path the report shows.

Sites: a dot_general with no contracting dimension, or contracting dimensions of
total size 1, is no GEMM (``'not_gemm'``: left exact, whatever the rules). A
GEMM's kind (``'weight'``, ``'head'``, ``'activation'``) comes from
``mxjax.nn.kinds``, from a data-dependence analysis of the jaxpr
(``mxjax.nn.analysis``; each input is a parameter or data, ``param_args`` says
which).

Casts: where a GEMM operand is a narrowing float ``convert_element_type`` (Flax's
``promote_dtype`` casting an f32 kernel to a bf16 ``dtype``), the policy gets the wider
value with ``operand_dtype`` set: the same GEMM bit for bit, with the cast left to the
quantizer (``mxjax.dot_general``'s ``operand_dtype``).

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
    CONST,
    DATA,
    Facts,
    Info,
    call_jaxpr,
    eqn_infos,
    has_dot,
    not_gemm,
    open_jaxpr,
    prepass,
    read_info,
    scan_counts,
    site_origin,
    sub_jaxprs,
    weight_origin,
)
from mxjax.nn.kinds import classify
from mxjax.nn.paths import Path, PathSource, as_str, common_prefix, key_name
from mxjax.nn.rules import HEAD_NAMES, NOT_GEMM, Rule, Site, WrapReport

__all__ = ["transform_call"]

_DOT = jcore.primitives.dot_general_p
_CONVERT = lax.convert_element_type_p
_FUNCTION_PATHS = PathSource(front_end="function")


@contextlib.contextmanager
def _as(eqn, extra: Path = ()):
    """Binds what follows as `eqn` was bound (its name stack, plus `extra` scopes, and
    traceback)."""
    ns = siu.current_name_stack() + eqn.source_info.name_stack
    for name in extra:
        ns = ns.extend(name)
    with siu.user_context(eqn.source_info.traceback, name_stack=ns), eqn.ctx.manager:
        yield


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
    """Trace-time state: rules, the base key, what the prepass found, and the sites."""

    def __init__(self, rules: tuple[Rule, ...], key, facts: Facts, head_params: frozenset,
                 paths: PathSource):
        self.rules = rules
        self.key = key
        self.facts = facts
        self.head_params = head_params
        self.paths = paths
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


def _stack_path(ctx: _Ctx, stack) -> str:
    """The call path a name stack records (for messages; NNX records none)."""
    try:
        return as_str(ctx.paths.call_path(stack))
    except ValueError:
        return str(stack)


def _narrowed_from(eqn, read) -> Any:
    """The value a ``convert_element_type`` equation narrows to a smaller float dtype (e.g.
    an f32 weight Flax's ``promote_dtype`` casts to a bf16 compute dtype), or None."""
    if eqn.primitive is not _CONVERT or eqn.params.get("sharding") is not None:
        return None
    src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
    floats = jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)
    return read(eqn.invars[0]) if floats and src.itemsize > dst.itemsize else None


def _uncast(invals: list, sources: list) -> tuple[list, Any]:
    """The operands to hand the policy, and its ``operand_dtype``.

    Where an operand is a narrowing cast of a wider float value (`sources`, from
    `_narrowed_from`), the policy gets that value with ``operand_dtype`` the dtype both
    operands share: bit for bit the same GEMM, value and cotangents (``operand_dtype``'s
    contract), with the cast left to the quantizer, which reads the f32 weight instead of a
    materialized copy (the TPU kernel rounds it itself).
    """
    lhs, rhs = invals
    if lhs.dtype != rhs.dtype or all(s is None for s in sources):
        return invals, None
    return [x if s is None else s for x, s in zip(invals, sources, strict=True)], lhs.dtype


def _dot(eqn, invals, ins: list[Info], ctx: _Ctx, stack, salts: tuple, sources: list):
    lhs, rhs = invals
    call = ctx.paths.call_path(stack)
    path, extra = ctx.paths.site_path(call, weight_origin(*ins), site_origin(*ins))
    name = as_str(path)
    idx = ctx.next_index(name)
    shapes = (tuple(lhs.shape), tuple(rhs.shape))
    reason = not_gemm(eqn)
    if reason is not None:
        ctx.sites.append(Site(name, idx, None, None, *shapes, kind=NOT_GEMM,
                              why=f"{reason}: left exact"))
        return _rebind(eqn, invals, extra)[0]
    kind, why, head_rule = classify(eqn, ins[0], ins[1], path, ctx.facts, ctx.head_params)
    rule, policy = ctx.match(name, kind)
    note = ""
    if rule is None:
        why += "; no rule selects this path and kind: unchanged"
    elif policy is None:
        why += f"; rule {rule} (policy None): unchanged"
    else:
        why += f"; rule {rule}"
    if policy is not None and not (jnp.issubdtype(lhs.dtype, jnp.floating)
                                   and jnp.issubdtype(rhs.dtype, jnp.floating)):
        note, policy = "non-float operands: left unchanged", None
        why += f" ({note})"
    ctx.sites.append(Site(name, idx, rule, policy, *shapes, note, kind, why, head_rule))
    params = eqn.params
    if policy is None or policy.is_passthrough:  # the equation itself: the same program
        return _rebind(eqn, invals, extra)[0]
    key = None
    if policy.needs_key:
        if ctx.key is None:
            raise ValueError(
                f"key: the policy for module path {name!r} ({policy.name or 'custom'}) "
                "is randomized "
                "and needs a key: pass rngs={'mxjax': key} (Linen), an nnx.Rngs with an 'mxjax' "
                "stream (NNX) or mxjax_key= (functions)"
            )
        key = jax.random.fold_in(ctx.key, zlib.crc32(f"{name}#{idx}".encode()) & 0x7FFFFFFF)
        for s in salts:
            key = jax.random.fold_in(key, s)
    (lhs, rhs), operand_dtype = _uncast(invals, sources)
    with _as(eqn, extra):
        return policy_dot_general(
            lhs, rhs, params["dimension_numbers"], params.get("precision"),
            params.get("preferred_element_type"), policy=policy, key=key,
            operand_dtype=operand_dtype, out_sharding=params.get("out_sharding"))


def _eval(j, args, infos, ctx: _Ctx, prefix, salts: tuple) -> list:
    """Evaluates a (sub-)jaxpr; `prefix`: the name stack of the equations around it."""
    jaxpr, consts = open_jaxpr(j)
    env: dict = {}
    ienv: dict = {}
    narrowed: dict = {}  # var -> the wider float value a convert_element_type narrowed

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v], ienv[v] = x, CONST
    for v, x, d in zip(jaxpr.invars, args, infos, strict=True):
        env[v], ienv[v] = x, d
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        ins = [read_info(ienv, v) for v in eqn.invars]
        out_infos, sub_ins = eqn_infos(eqn, ins, None)
        stack = prefix + eqn.source_info.name_stack
        if eqn.primitive is _DOT:
            sources = [None if isinstance(v, jcore.Literal) else narrowed.get(v)
                       for v in eqn.invars]
            outs = [_dot(eqn, invals, ins, ctx, stack, salts, sources)]
        elif any(has_dot(s, ctx.has_dot_cache) for s in sub_jaxprs(eqn.params)):
            with _as(eqn):
                outs = _higher_order(eqn, invals, [d for _, d in sub_ins], ctx, stack, salts)
        else:
            outs = _rebind(eqn, invals)
        for v, x, d in zip(eqn.outvars, outs, out_infos, strict=True):
            env[v], ienv[v] = x, d
        src = _narrowed_from(eqn, read)
        if src is not None:
            narrowed[eqn.outvars[0]] = src
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals) -> list:
    ans = eqn.primitive.bind(*invals, **_bind_params(eqn))
    return list(ans) if eqn.primitive.multiple_results else [ans]


def _rebind(eqn, invals, extra: Path = ()) -> list:
    with _as(eqn, extra):
        return _bind(eqn, invals)


def _higher_order(eqn, invals, sub_infos: list, ctx: _Ctx, stack, salts: tuple) -> list:
    """Re-emits a higher-order equation with a dot_general inside; called under ``_as(eqn)``.

    `sub_infos`: the input Infos of each sub-jaxpr, from `eqn_infos`.
    """
    name = eqn.primitive.name
    p = eqn.params
    if name in ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call"):
        return _eval(call_jaxpr(p), invals, sub_infos[0], ctx, stack, salts)
    if name in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
        ins = sub_infos[0]
        weight = common_prefix(i.origin for i in ins if i.params is not None)
        origin = weight if weight is not None else common_prefix(i.origin for i in ins)
        where, _ = ctx.paths.site_path(ctx.paths.call_path(stack), weight, origin)
        ctx.skipped.append(f"{as_str(where) or '(root)'}: dot_general inside a custom_vjp "
                           "(left unchanged)")
        return _bind(eqn, invals)  # already under the equation's name stack
    if name in ("remat", "remat2", "checkpoint"):
        def body(*args):
            return _eval(p["jaxpr"], list(args), sub_infos[0], ctx, stack, salts)

        return list(jax.checkpoint(body, prevent_cse=p.get("prevent_cse", True),
                                   policy=p.get("policy"))(*invals))
    if name == "scan":
        n_consts, n_carry = scan_counts(p)
        consts, init, xs = (invals[:n_consts], invals[n_consts:n_consts + n_carry],
                            invals[n_consts + n_carry:])

        counted = ctx.key is not None  # an iteration counter only where noise needs it

        def scan_body(carry, x):
            i, c = carry if counted else (None, carry)
            outs = _eval(p["jaxpr"], [*consts, *c, *x], sub_infos[0], ctx, stack,
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
            return _eval(p["cond_jaxpr"], [*cconsts, *c], sub_infos[0], ctx, stack, salts)[0]

        def body_fn(carry):
            if not counted:
                return _eval(p["body_jaxpr"], [*bconsts, *carry], sub_infos[1], ctx, stack, salts)
            i, c = carry
            return i + 1, _eval(p["body_jaxpr"], [*bconsts, *c], sub_infos[1], ctx, stack,
                                salts + (i,))

        if not counted:
            return list(lax.while_loop(cond_fn, body_fn, list(init)))
        return list(lax.while_loop(cond_fn, body_fn, (jnp.int32(0), list(init)))[1])
    if name == "cond":
        index, ops = invals[0], invals[1:]

        def branch(b, d):
            return lambda *a: _eval(b, list(a), d, ctx, stack, salts)

        branches = [branch(b, d) for b, d in zip(p["branches"], sub_infos, strict=True)]
        return list(lax.switch(index, branches, *ops))
    raise NotImplementedError(
        f"mxjax.nn: cannot intercept a dot_general inside the {name!r} primitive "
        f"(module path {_stack_path(ctx, stack)!r}); apply the policy inside it with "
        "policy.dot_general(...) instead"
    )


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #
def _is_dynamic(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _mask(tree, value: bool):
    return jax.tree.map(lambda _: value, tree)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype if hasattr(x, "dtype") else np.result_type(x), jnp.inexact)


def transform_call(fn: Callable, args: tuple, kwargs: dict, *, rules: tuple[Rule, ...], key,
                   param_args: tuple[int, ...] = (), paths: PathSource = _FUNCTION_PATHS,
                   aux_output: bool = False) -> tuple[Any, WrapReport]:
    """Calls ``fn(*args, **kwargs)`` with every dot_general under its rule's policy.

    Array leaves of ``(args, kwargs)`` are traced; every other leaf is static.
    The array leaves of the positional arguments listed in `param_args` are the
    parameters (for operand kinds; a floating-point one is owned by the module
    ``paths.owner`` names); all other array leaves are data. Arrays `fn` closes
    over count as parameters too. `paths` says where module paths come from (the
    front end: function, Linen or NNX). With `aux_output`, ``fn`` returns
    ``(output, aux)`` and only ``output`` is the model's output (e.g. ``aux``:
    updated state).
    Returns ``(fn's return value, report)``.
    """
    for i in param_args:
        if not isinstance(i, int) or not 0 <= i < len(args):
            raise ValueError(f"param_args: {i!r} is not a positional argument index "
                             f"(there are {len(args)})")
    is_param = jax.tree_util.tree_leaves(
        (tuple(_mask(a, i in param_args) for i, a in enumerate(args)), _mask(kwargs, False)))
    keypaths, _ = jax.tree_util.tree_flatten_with_path((args, kwargs))
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
    infos = []
    for n, i in enumerate(dyn_idx):
        if not is_param[i]:
            infos.append(DATA)
            continue
        owner = paths.owner(keypaths[i][0][2:]) if _is_float(leaves[i]) else None
        infos.append(Info(frozenset({n}), owner))
    head_params = frozenset(
        n for n, i in enumerate(dyn_idx) if is_param[i]
        and any(re.fullmatch(HEAD_NAMES, key_name(k)) for k in keypaths[i][0]))
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
    n_model = len(jax.tree.leaves(out_shape[0] if aux_output else out_shape))
    ctx = _Ctx(rules, key, prepass(closed, infos, n_model), head_params, paths)
    outs = _eval(closed, dyn, infos, ctx, siu.NameStack(), ())
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs), ctx.report()
