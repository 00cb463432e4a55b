"""What a traced program's data flow says about each value and each dot_general.

For `mxjax.nn.wrap`'s interpreter (``mxjax.nn.interpret``). Each value gets an
``Info``: the parameters it is computed from (None: it depends on data) and the
module its data comes from (``origin``, see ``mxjax.nn.paths``). ``analyze`` runs a
jaxpr to its outputs' Infos, through calls, loops (to a fixed point) and conds;
``eqn_infos`` is one equation. ``prepass`` also finds the embedding tables (the
parameters read by a ``gather`` at data-dependent indices, and their vocabulary
sizes) and the GEMMs whose result reaches the model's output without another
GEMM. ``not_gemm`` says why a dot_general is no GEMM. Also the sub-jaxpr
helpers both modules share (jax 0.11: ClosedJaxpr + open Jaxpr; jax 0.12: Jaxpr
with consts).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.extend import core as jcore

from mxjax.nn.paths import Path, common_prefix

__all__ = ["CALLS", "CONST", "DATA", "Facts", "Info", "analyze", "call_jaxpr", "eqn_infos",
           "has_dot", "not_gemm", "open_jaxpr", "prepass", "read_info", "scan_counts",
           "site_origin", "sub_jaxprs", "weight_origin"]

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
# Infos: parameters (None = depends on data) and origin of every value
# --------------------------------------------------------------------------- #
CALLS = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
         "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint")


@dataclasses.dataclass(frozen=True, slots=True)
class Info:
    """What the analysis knows about one value.

    Attributes:
      params: the parameters (input indices) it is computed from, or None when it
        depends on data (a non-parameter input).
      origin: the module path its data comes from (a parameter's owner, a
        matmul's site), or None (data inputs and constants come from no module).
    """

    params: frozenset | None
    origin: Path | None = None

    def as_data(self) -> Info:
        return Info(None, self.origin)


DATA = Info(None, None)
CONST = Info(frozenset(), None)


def join(infos) -> Info:
    params: frozenset | None = frozenset()
    for i in infos:
        params = None if params is None or i.params is None else params | i.params
    return Info(params, common_prefix(i.origin for i in infos))


@dataclasses.dataclass
class Facts:
    """What ``prepass`` found in a whole program (one transform's worth)."""

    tables: set = dataclasses.field(default_factory=set)  # embedding tables (param indices)
    vocabs: set = dataclasses.field(default_factory=set)  # their row counts
    to_output: dict = dataclasses.field(default_factory=dict)  # id(eqn) -> GEMM eqn


def not_gemm(eqn) -> str | None:
    """Why a dot_general equation is not a GEMM (None when it is one).

    No contracting dimension (an elementwise or broadcast product written as a
    dot, e.g. RMSNorm's ``jnp.einsum('...k,k->...k', y, scale)``) or contracting
    dimensions of total size 0 or 1 (an outer product): nothing is summed.
    """
    (contract, _), _ = eqn.params["dimension_numbers"]
    if not contract:
        return "no contracting dimension: an elementwise or broadcast product, not a GEMM"
    shape = eqn.invars[0].aval.shape
    try:
        k = int(math.prod(shape[d] for d in contract))
    except Exception:  # noqa: BLE001 - a symbolic dimension: a real contraction
        return None
    if k <= 1:
        return f"contraction of total size {k}: an outer product, not a GEMM"
    return None


def weight_origin(lhs: Info, rhs: Info) -> Path | None:
    """The module owning a dot's weight: the origin of its parameter-only operand(s)."""
    return common_prefix(i.origin for i in (lhs, rhs) if i.params is not None)


def site_origin(lhs: Info, rhs: Info) -> Path | None:
    """The module a dot belongs to by its data: its weight's, else its operands' common one."""
    w = weight_origin(lhs, rhs)
    return w if w is not None else common_prefix((lhs.origin, rhs.origin))


def _dot_info(eqn, lhs: Info, rhs: Info) -> Info:
    """A GEMM's result comes from its site; a dot that is no GEMM mixes like a product."""
    params = join((lhs, rhs)).params
    if not_gemm(eqn) is not None:
        return Info(params, common_prefix((lhs.origin, rhs.origin)))
    return Info(params, site_origin(lhs, rhs))


def call_jaxpr(p: dict):
    return p.get("jaxpr", p.get("call_jaxpr", p.get("fun_jaxpr")))


def _loop_fixed_point(body, fixed: list, carry: list, rest: list, n_carry: int) -> list:
    """Carry Infos of a loop body run to a fixed point (body(fixed, carry, rest))."""
    while True:
        outs = analyze(body, [*fixed, *carry, *rest], None)
        new = [join((c, o)) for c, o in zip(carry, outs[:n_carry], strict=True)]
        if new == carry:
            return carry
        carry = new


def _gather(eqn, ins: list, facts: Facts) -> None:
    table, idx = ins[0], ins[1]
    if table.params and idx.params is None:  # a parameter read at data-dependent rows
        facts.tables.update(table.params)
        dims = eqn.params["dimension_numbers"].start_index_map
        if len(dims) == 1:
            facts.vocabs.add(eqn.invars[0].aval.shape[dims[0]])


def eqn_infos(eqn, ins: list, facts: Facts | None) -> tuple[list, list]:
    """(output Infos, [(sub-jaxpr, its input Infos)]) of one equation.

    `facts` (when not None) collects the embedding tables (``gather``).
    """
    name, p = eqn.primitive.name, eqn.params
    n_out = len(eqn.outvars)
    if name == "gather" and facts is not None:
        _gather(eqn, ins, facts)
    if name == "dot_general":
        return [_dot_info(eqn, ins[0], ins[1])], []
    if name in CALLS and call_jaxpr(p) is not None:
        sub = call_jaxpr(p)
        return analyze(sub, ins, facts), [(sub, ins)]
    if name == "scan":
        n_consts, n_carry = scan_counts(p)
        consts, carry = ins[:n_consts], ins[n_consts:n_consts + n_carry]
        xs = ins[n_consts + n_carry:]
        carry = _loop_fixed_point(p["jaxpr"], consts, list(carry), xs, n_carry)
        body_in = [*consts, *carry, *xs]
        outs = analyze(p["jaxpr"], body_in, facts)
        return [*carry, *outs[n_carry:]], [(p["jaxpr"], body_in)]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = ins[:cn], ins[cn:cn + bn], list(ins[cn + bn:])
        while True:
            carry = _loop_fixed_point(p["body_jaxpr"], bconsts, carry, [], len(carry))
            pred = analyze(p["cond_jaxpr"], [*cconsts, *carry], None)[0]
            if pred.params is None and any(c.params is not None for c in carry):
                carry = [c.as_data() for c in carry]  # how often the body runs depends on data
                continue
            break
        analyze(p["body_jaxpr"], [*bconsts, *carry], facts)
        return carry, [(p["cond_jaxpr"], [*cconsts, *carry]), (p["body_jaxpr"], [*bconsts, *carry])]
    if name == "cond":
        index, ops = ins[0], ins[1:]
        outs = None
        for b in p["branches"]:
            o = analyze(b, ops, facts)
            outs = o if outs is None else [join((a, c)) for a, c in zip(outs, o, strict=True)]
        if index.params is None:
            outs = [o.as_data() for o in outs]
        return outs, [(b, ops) for b in p["branches"]]
    return [join(ins)] * n_out, []


def analyze(j, ins: list, facts: Facts | None) -> list:
    """Output Infos of a (sub-)jaxpr given its inputs' Infos."""
    jaxpr, _ = open_jaxpr(j)
    env: dict = {}
    for v in jaxpr.constvars:
        env[v] = CONST
    for v, d in zip(jaxpr.invars, ins, strict=True):
        env[v] = d
    for eqn in jaxpr.eqns:
        outs, _ = eqn_infos(eqn, [read_info(env, v) for v in eqn.invars], facts)
        for v, d in zip(eqn.outvars, outs, strict=True):
            env[v] = d
    return [read_info(env, v) for v in jaxpr.outvars]


def read_info(env: dict, v) -> Info:
    return CONST if isinstance(v, jcore.Literal) else env[v]


# --------------------------------------------------------------------------- #
# Which GEMMs' results reach the model's output without passing another GEMM
# --------------------------------------------------------------------------- #
def _live_eqn(eqn, outs: list[bool], found: dict) -> list[bool]:
    name, p = eqn.primitive.name, eqn.params
    n_in = len(eqn.invars)
    if name == "dot_general":
        if not_gemm(eqn) is None:
            found[id(eqn)] = eqn
            return [False] * n_in
        return [True] * n_in
    if name in CALLS and call_jaxpr(p) is not None:
        return _live(call_jaxpr(p), outs, found)
    if name == "scan":
        n_consts, n_carry = scan_counts(p)
        carry = list(outs[:n_carry])
        while True:
            ins = _live(p["jaxpr"], [*carry, *outs[n_carry:]], found)
            new = [a or b for a, b in zip(carry, ins[n_consts:n_consts + n_carry], strict=True)]
            if new == carry:
                return ins
            carry = new
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        carry = list(outs)
        while True:
            ins = _live(p["body_jaxpr"], carry, found)
            new = [a or b for a, b in zip(carry, ins[bn:], strict=True)]
            if new == carry:
                return [False] * cn + ins[:bn] + carry
            carry = new
    if name == "cond":
        ins = [False] * (n_in - 1)
        for b in p["branches"]:
            ins = [a or c for a, c in zip(ins, _live(b, outs, found), strict=True)]
        return [False, *ins]
    return [True] * n_in


def _live(j, out_live: list[bool], found: dict) -> list[bool]:
    """Which inputs of a (sub-)jaxpr reach its live outputs without passing a GEMM."""
    jaxpr, _ = open_jaxpr(j)
    live = {v for v, on in zip(jaxpr.outvars, out_live, strict=True)
            if on and not isinstance(v, jcore.Literal)}
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if not any(outs):
            continue
        for v, on in zip(eqn.invars, _live_eqn(eqn, outs, found), strict=True):
            if on and not isinstance(v, jcore.Literal):
                live.add(v)
    return [v in live for v in jaxpr.invars]


def prepass(closed, ins: list, n_model_outputs: int) -> Facts:
    """The whole program's Facts; its first `n_model_outputs` outputs are the model's."""
    facts = Facts()
    analyze(closed, ins, facts)
    jaxpr, _ = open_jaxpr(closed)
    n_out = len(jaxpr.outvars)
    _live(closed, [i < n_model_outputs for i in range(n_out)], facts.to_output)
    return facts


def scan_counts(params: dict) -> tuple[int, int]:
    if "num_consts" in params:  # jax <= 0.11
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # jax 0.12
    return len(consts), len(carry)


