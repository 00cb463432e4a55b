"""mxjax.nn.wrap keeps module names: jaxpr name stacks and HLO op_name metadata."""

from __future__ import annotations

import collections
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jcore
from jax.extend import source_info_util as siu

import mxjax.nn as mnn


class Block(nn.Module):
    """Einsum attention (activation x activation) plus projections, under remat and scan."""

    @nn.compact
    def __call__(self, carry, x):
        q = nn.DenseGeneral((2, 8), name="q_proj")(x)
        k = nn.DenseGeneral((2, 8), name="k_proj")(x)
        s = jnp.einsum("thd,shd->hts", q, k)
        o = jnp.einsum("hts,shd->thd", jax.nn.softmax(s, axis=-1), k)
        return carry, nn.DenseGeneral(16, axis=(-2, -1), name="o_proj")(o)


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=2)
        y = layers(name="layers")(None, jnp.stack([x, x]))[1]
        return nn.Dense(16, name="head_mlp")(y.sum(0))


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16,
                                           decode=False, rngs=rngs)
        self.up = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        with jax.named_scope("block"):  # NNX adds no module scopes itself; users may
            return self.up(x + self.attn(x))


def _sub_jaxprs(eqn):
    platforms = eqn.params.get("branches_platforms") if eqn.primitive.name == "cond" else None
    if platforms is not None:
        # A quantized GEMM's `lax.platform_dependent` switch (CPU form, GPU/TPU form):
        # one site, whose branches carry the same names; follow the CPU one (these
        # tests lower for CPU, and only that branch survives lowering).
        branches = [getattr(b, "jaxpr", b) for b in eqn.params["branches"]]
        names = [collections.Counter(str(ns) for ns, e in _walk(b)
                                     if e.primitive.name == "dot_general") for b in branches]
        assert all(n == names[0] for n in names), names
        yield branches[next(i for i, ps in enumerate(platforms) if ps and "cpu" in ps)]
        return
    for v in eqn.params.values():
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(j, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                yield getattr(j, "jaxpr", j)


def _walk(jaxpr, parent=None):
    """(full name stack, eqn) of every equation, recursively through all sub-jaxprs."""
    parent = siu.NameStack() if parent is None else parent
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        full = parent + eqn.source_info.name_stack
        yield full, eqn
        for sub in _sub_jaxprs(eqn):
            yield from _walk(sub, full)


def _dot_stacks(jaxpr) -> collections.Counter:
    return collections.Counter(str(ns) for ns, e in _walk(jaxpr)
                               if e.primitive.name == "dot_general")


def _no_markers(jaxpr):
    bad = {str(ns) for ns, _ in _walk(jaxpr) if "mxjax" in str(ns)}
    assert not bad, f"marker scopes leaked into name stacks: {sorted(bad)[:3]}"


X = jax.random.normal(jax.random.key(1), (4, 16))


def test_linen_remat_scan_einsum_attention_keep_their_names():
    m = Stack()
    v = m.init(jax.random.key(0), X)
    plain = _dot_stacks(jax.make_jaxpr(m.apply)(v, X))
    assert set(plain) == {"Stack/layers/q_proj", "Stack/layers/k_proj", "Stack/layers/o_proj",
                          "Stack/layers/thd,shd->hts", "Stack/layers/hts,shd->thd",
                          "Stack/head_mlp"}
    # The default (linear layers quantized) and everything quantized (attention included).
    for rules in ("mxfp4_all", mnn.Rule(path=".*", policy="mxfp4_all", operands="any")):
        wrapped = mnn.wrap(m, rules)
        jaxpr = jax.make_jaxpr(wrapped.apply)(v, X)
        assert _dot_stacks(jaxpr) == plain
        _no_markers(jaxpr)
        # The quantizer's own ops sit under the module too (not at the root).
        # The quantizer's block amax: a max-reduction of abs bits (uint32).
        quantizer_ops = [str(ns) for ns, e in _walk(jaxpr) if e.primitive.name == "reduce_max"
                         and e.invars[0].aval.dtype == jnp.uint32]
        assert quantizer_ops and set(quantizer_ops) <= set(plain)


def test_nnx_model_keeps_its_names_and_gains_its_module_paths():
    # NNX records no module scopes: each matmul's ops get its module path appended
    # to the name stack the model gave it, so HLO op_names end with the report's path.
    model = NnxBlock(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 4, 16))
    graphdef, state = nnx.split(model)
    plain_jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    plain = [str(ns) for ns, e in _walk(plain_jaxpr) if e.primitive.name == "dot_general"]
    assert len(plain) == 7  # q, k, v, out, 2 attention, up
    assert plain.count("block") == 5 and plain.count("block/vmap(BTNH,BSNH->BNTS)") == 1
    wrapped = mnn.wrap(model, mnn.Rule(path=".*", policy="mxfp4_all", operands="any"))
    gw, sw = nnx.split(wrapped)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(gw, s)(x))(sw, x)
    paths = [s.path for s in wrapped.last_report.sites]
    assert paths == ["attn/query", "attn/key", "attn/value", "attn", "attn", "attn/out", "up"]
    assert _dot_stacks(jaxpr) == collections.Counter(
        f"{ns}/{p}" for ns, p in zip(plain, paths, strict=True))
    _no_markers(jaxpr)


def _dot_op_names(hlo: str) -> collections.Counter:
    names = re.findall(r'op_name="([^"]*/dot_general)"', hlo)
    # Below the module path, JAX's own scopes of the emulated GEMM: "jit(emulated_gemm)"
    # (its cached trace) and the branch `lax.platform_dependent` keeps (the per-platform
    # GEMM form): "cond/branch_<k>_fun" up to jax 0.12.0, "platform" from 0.12.1 on;
    # not markers.
    names = [re.sub(r"/jit\(emulated_gemm\)(?=/)", "", n) for n in names]
    names = [re.sub(r"/(cond/branch_\d+_fun|platform)(?=/)", "", n) for n in names]
    return collections.Counter(n.split("/", 1)[1] for n in names)  # drop jit(<fn name>)


def test_hlo_op_metadata_carries_the_module_names():
    m = Stack()
    v = m.init(jax.random.key(0), X)
    wrapped = mnn.wrap(m, "mxfp4_all")
    plain = jax.jit(m.apply).lower(v, X).compile().as_text()
    ours = jax.jit(wrapped.apply).lower(v, X).compile().as_text()
    want = _dot_op_names(plain)
    assert any("layers/q_proj" in n for n in want) and any("head_mlp" in n for n in want)
    assert set(_dot_op_names(ours)) == set(want)
    assert "mxjax[" not in ours


def test_functions_cond_loops_jit_and_custom_rules_keep_their_names():
    w = jax.random.normal(jax.random.key(2), (16, 16)) * 0.2

    @jax.custom_vjp
    def cv(x):
        return x @ w

    cv.defvjp(lambda x: (cv(x), None), lambda _, g: (g @ w.T,))

    @jax.custom_jvp
    def cj(x):
        return x @ w

    cj.defjvp(lambda p, t: (cj(p[0]), t[0] @ w))

    @jax.jit
    def inner(x):
        with jax.named_scope("in_jit"):
            return x @ w

    def f(x, i):
        with jax.named_scope("outer"):
            with jax.named_scope("cond"):
                x = jax.lax.cond(i > 0, lambda x: jnp.tanh(x @ w), lambda x: x, x)
            with jax.named_scope("loop"):
                x = jax.lax.fori_loop(0, 2, lambda _, x: jnp.tanh(x @ w), x)
            with jax.named_scope("custom"):
                x = cv(cj(x))
            return inner(x)

    plain = _dot_stacks(jax.make_jaxpr(f)(X, 1))
    wrapped = mnn.wrap(f, "mxfp4_all")
    jaxpr = jax.make_jaxpr(wrapped)(X, 1)
    assert _dot_stacks(jaxpr) == plain
    assert plain["outer/custom"] == 2 and plain["outer/in_jit"] == 1
    assert [s.kind for s in wrapped.last_report.sites] == ["weight"] * 4
    assert len(wrapped.last_report.skipped) == 1  # the custom_vjp's own matmul
