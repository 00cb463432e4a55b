"""Data dependence of a traced program: which values are computed from parameters alone.

For `mxjax.nn.wrap`'s interpreter (``mxjax.nn.interpret``): a dependence is
``None`` (the value depends on data) or the frozenset of the parameters (input
indices) it is computed from. ``analyze`` runs a jaxpr to its outputs' dependences,
through calls, loops (to a fixed point) and conds; ``eqn_deps`` is one equation.
Also the sub-jaxpr helpers both modules share (jax 0.11: ClosedJaxpr + open
Jaxpr; jax 0.12: Jaxpr with consts).
"""

from __future__ import annotations

from typing import Any

from jax.extend import core as jcore

__all__ = ["CALLS", "NO_PARAMS", "analyze", "call_jaxpr", "eqn_deps", "has_dot", "join_all",
           "open_jaxpr", "read_dep", "scan_counts", "sub_jaxprs"]

_DOT = jcore.primitives.dot_general_p


# --------------------------------------------------------------------------- #
# Sub-jaxpr helpers (jax 0.11: ClosedJaxpr + open Jaxpr; jax 0.12: Jaxpr with consts)
# --------------------------------------------------------------------------- #
def open_jaxpr(j) -> tuple[Any, list]:
    consts = list(getattr(j, "consts", ()) or ())
    return getattr(j, "jaxpr", j), consts


def is_jaxpr(v) -> bool:
    return isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))


def sub_jaxprs(params: dict) -> list:
    out = []
    for v in params.values():
        if is_jaxpr(v):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out.extend(x for x in v if is_jaxpr(x))
    return out


def has_dot(j, cache: dict) -> bool:
    """Whether a (sub-)jaxpr contains a dot_general; `cache` lives for one transform."""
    inner, _ = open_jaxpr(j)
    hit = cache.get(id(inner))
    if hit is not None and hit[0] is inner:
        return hit[1]
    found = any(e.primitive is _DOT or any(has_dot(s, cache) for s in sub_jaxprs(e.params))
                for e in inner.eqns)
    cache[id(inner)] = (inner, found)
    return found


# --------------------------------------------------------------------------- #
# Data dependence: None = depends on data; frozenset = the parameters it is computed from
# --------------------------------------------------------------------------- #
CALLS = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
          "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint")
NO_PARAMS: frozenset = frozenset()


def join_all(deps) -> frozenset | None:
    out = NO_PARAMS
    for d in deps:
        if d is None:
            return None
        out = out | d
    return out


def join2(a, b):
    return None if a is None or b is None else a | b


def call_jaxpr(p: dict):
    return p.get("jaxpr", p.get("call_jaxpr", p.get("fun_jaxpr")))


def loop_fixed_point(body, fixed: list, carry: list, rest: list, n_carry: int,
                      tables: set | None) -> list:
    """Carry dependences of a loop body run to a fixed point (body(fixed, carry, rest))."""
    while True:
        outs = analyze(body, [*fixed, *carry, *rest], tables)
        new = [join2(c, o) for c, o in zip(carry, outs[:n_carry], strict=True)]
        if new == carry:
            return carry
        carry = new


def eqn_deps(eqn, ins: list, tables: set | None) -> tuple[list, list]:
    """(output dependences, [(sub-jaxpr, its input dependences)]) of one equation.

    `tables` (when not None) collects the parameters read by a ``gather`` at
    data-dependent indices: embedding tables.
    """
    name, p = eqn.primitive.name, eqn.params
    n_out = len(eqn.outvars)
    if name == "gather" and tables is not None and ins[0] and ins[1] is None:
        tables.update(ins[0])
    if name in CALLS and call_jaxpr(p) is not None:
        sub = call_jaxpr(p)
        return analyze(sub, ins, tables), [(sub, ins)]
    if name == "scan":
        n_consts, n_carry = scan_counts(p)
        consts, carry = ins[:n_consts], ins[n_consts:n_consts + n_carry]
        xs = ins[n_consts + n_carry:]
        carry = loop_fixed_point(p["jaxpr"], consts, list(carry), xs, n_carry, None)
        body_in = [*consts, *carry, *xs]
        outs = analyze(p["jaxpr"], body_in, tables)
        return [*carry, *outs[n_carry:]], [(p["jaxpr"], body_in)]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], list(ins[cn + bn:])
        while True:
            carry = loop_fixed_point(p["body_jaxpr"], bconsts, carry, [], len(carry), None)
            pred = analyze(p["cond_jaxpr"], [*cconsts, *carry], None)[0]
            if pred is None and any(c is not None for c in carry):
                carry = [None] * len(carry)  # how often the body runs depends on data
                continue
            break
        analyze(p["body_jaxpr"], [*bconsts, *carry], tables)
        return carry, [(p["cond_jaxpr"], [*cconsts, *carry]), (p["body_jaxpr"], [*bconsts, *carry])]
    if name == "cond":
        index, ops = ins[0], ins[1:]
        outs = None
        for b in p["branches"]:
            o = analyze(b, ops, tables)
            outs = o if outs is None else [join2(a, c) for a, c in zip(outs, o, strict=True)]
        if index is None:
            outs = [None] * n_out
        return outs, [(b, ops) for b in p["branches"]]
    return [join_all(ins)] * n_out, []


def analyze(j, ins: list, tables: set | None) -> list:
    """Output dependences of a (sub-)jaxpr given its inputs' dependences."""
    jaxpr, _ = open_jaxpr(j)
    env: dict = {}
    for v in jaxpr.constvars:
        env[v] = NO_PARAMS
    for v, d in zip(jaxpr.invars, ins, strict=True):
        env[v] = d
    for eqn in jaxpr.eqns:
        outs, _ = eqn_deps(eqn, [read_dep(env, v) for v in eqn.invars], tables)
        for v, d in zip(eqn.outvars, outs, strict=True):
            env[v] = d
    return [read_dep(env, v) for v in jaxpr.outvars]


def read_dep(env: dict, v):
    return NO_PARAMS if isinstance(v, jcore.Literal) else env[v]


def scan_counts(params: dict) -> tuple[int, int]:
    if "num_consts" in params:  # jax <= 0.11
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # jax 0.12
    return len(consts), len(carry)


