"""mxjax.nn: Flax Linen/NNX layers with a policy, and wrap() on existing models."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import mxjax
import mxjax.nn as mnn
from mxjax import policies

MX = policies.get("mxfp4_all")
DIMS = (((1,), (0,)), ((), ()))
# x @ w under MX, the reference the layers are compared with (jitted: one compile per shape
# instead of the quantizer's ops one by one).
MX_MATMUL = jax.jit(lambda x, w: mxjax.dot_general(x, w, DIMS, policy=MX))


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------- models
class LinenMLP(nn.Module):
    """Dense layers plus matmuls written in the module's own code."""

    dot_general: object = None

    @nn.compact
    def __call__(self, x):
        kw = {} if self.dot_general is None else {"dot_general": self.dot_general}
        h = nn.relu(nn.Dense(64, name="up", **kw)(x))
        h = nn.Dense(32, name="down", **kw)(h)
        mix = self.param("mix", nn.initializers.normal(0.2), (32, 32))
        return h @ mix if self.dot_general is None else self.dot_general(h, mix, DIMS)


class NnxMLP(nnx.Module):
    def __init__(self, *, rngs, dot_general=None):
        kw = {} if dot_general is None else {"dot_general": dot_general}
        self.up = nnx.Linear(32, 64, rngs=rngs, **kw)
        self.down = nnx.Linear(64, 32, rngs=rngs, **kw)
        self.mix = nnx.Param(jax.random.normal(rngs.params(), (32, 32)) * 0.2)
        self.dg = dot_general

    def __call__(self, x):
        h = self.down(jax.nn.relu(self.up(x)))
        if self.dg is None:
            return jnp.einsum("bd,df->bf", h, self.mix[...])
        return jnp.einsum("bd,df->bf", h, self.mix[...], _dot_general=self.dg)


def _x(n=32, d=32, seed=1):
    return jax.random.normal(jax.random.key(seed), (n, d))


# ----------------------------------------------------------------------------- layers
def test_linen_dense_dense_general_and_einsum_with_a_policy():
    x = _x()
    dg = MX.dot_general()

    class Layers(nn.Module):
        @nn.compact
        def __call__(self, x):
            a = nn.Dense(16, dot_general=dg, name="dense")(x)
            b = nn.DenseGeneral((2, 8), axis=-1, dot_general=dg, name="dg1")(x)
            c = nn.DenseGeneral(16, axis=(-2, -1), dot_general=dg, name="dg2")(b)
            return a, b, c

    m = Layers()
    v = m.init(jax.random.key(0), x)
    e = nn.Einsum((32, 16), "bd,df->bf", name="e")  # calls jnp.einsum itself: wrap reaches it
    ve = e.init(jax.random.key(0), x)

    @jax.jit
    def run(v, ve, x):
        p, pe = v["params"], ve["params"]
        a, b, c = m.apply(v, x)
        refs = (mxjax.dot_general(x, p["dense"]["kernel"], DIMS, policy=MX) + p["dense"]["bias"],
                mxjax.dot_general(b, p["dg2"]["kernel"], (((1, 2), (0, 1)), ((), ())), policy=MX)
                + p["dg2"]["bias"],
                mxjax.dot_general(x, pe["kernel"], DIMS, policy=MX) + pe["bias"])
        return (a, c, mnn.wrap(e, MX).apply(ve, x)), refs

    (a, c, ein), (ra, rc, re_) = run(v, ve, x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(ra))
    np.testing.assert_array_equal(np.asarray(c), np.asarray(rc))
    np.testing.assert_allclose(np.asarray(ein), np.asarray(re_), rtol=1e-6, atol=1e-6)


def test_linen_dot_general_cls_draws_per_layer_noise_from_the_mxjax_stream():
    cls = mnn.linen_dot_general_cls("mxfp4_all_sr")

    def same_init(key, shape, dtype):  # both layers get the same weights
        return jax.random.normal(jax.random.key(5), shape, dtype) * 0.2

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            a = nn.Dense(32, dot_general_cls=cls, kernel_init=same_init, name="a")
            b = nn.Dense(32, dot_general_cls=cls, kernel_init=same_init, name="b")
            return a(x), b(x)

    m, x = Two(), _x()
    v = m.init({"params": jax.random.key(0), "mxjax": jax.random.key(1)}, x)
    gy = _x(32, 32, 9)

    @jax.jit
    def grads(v, x, k):
        y, vjp = jax.vjp(lambda x: m.apply(v, x, rngs={"mxjax": k}), x)
        return y, vjp((gy, jnp.zeros_like(gy)))[0], vjp((jnp.zeros_like(gy), gy))[0]

    (ya, yb), da, db = grads(v, x, jax.random.key(2))
    # fprop is RNE with the same weights: identical. dgrad uses SR: each layer its own noise.
    np.testing.assert_array_equal(np.asarray(ya), np.asarray(yb))
    assert not np.array_equal(np.asarray(da), np.asarray(db))
    _, da2, _ = grads(v, x, jax.random.key(2))
    _, da3, _ = grads(v, x, jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(da), np.asarray(da2))
    assert not np.array_equal(np.asarray(da), np.asarray(da3))
    with pytest.raises(Exception, match="mxjax"):
        m.apply(v, x)


def test_nnx_linear_and_einsum_with_policy_modules():
    x = _x()
    rngs = nnx.Rngs(0, mxjax=1)
    lin = nnx.Linear(32, 16, dot_general=MX.dot_general(), rngs=rngs)
    ref = MX_MATMUL(x, lin.kernel[...]) + lin.bias[...]
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(lin, x)), np.asarray(ref))
    ein = nnx.Einsum("bd,df->bf", (32, 16), einsum_op=mnn.NnxEinsumOp(MX), rngs=rngs)
    ref = MX_MATMUL(x, ein.kernel[...])
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(ein, x)), np.asarray(ref))
    # A randomized policy draws a new key on every call: two steps, different noise.
    shared = nnx.Rngs(mxjax=5)
    sr = nnx.Linear(32, 16, dot_general=mnn.NnxDotGeneral("mxfp4_all_rht16", rngs=shared),
                    rngs=rngs)
    f = nnx.jit(lambda m, x: m(x))
    y1, y2 = f(sr, x), f(sr, x)
    assert not np.array_equal(np.asarray(y1), np.asarray(y2))
    with pytest.raises(ValueError, match="'mxjax' stream"):
        mnn.NnxDotGeneral("mxfp4_all_sr", rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------- wrap: Linen
def test_wrap_linen_mlp_equals_the_model_built_with_the_policy_and_reports():
    x = _x()
    plain, built = LinenMLP(), LinenMLP(dot_general=MX.dot_general())
    v = plain.init(jax.random.key(0), x)
    wrapped = mnn.wrap(plain, [mnn.Rule(path="attn.*", policy="fp8"),
                               mnn.Rule(path=".*", policy=MX)])
    loss = lambda apply: (lambda v: jnp.mean(apply(v, x) ** 2))
    ours = jax.jit(jax.value_and_grad(loss(wrapped.apply)))(v)
    theirs = jax.jit(jax.value_and_grad(loss(built.apply)))(v)
    _leaves_equal(ours, theirs)  # output and every gradient, bit for bit
    exact = jax.jit(jax.grad(loss(plain.apply)))(v)
    assert not np.allclose(np.asarray(ours[1]["params"]["up"]["kernel"]),
                           np.asarray(exact["params"]["up"]["kernel"]), rtol=1e-4)
    rep = wrapped.last_report
    assert wrapped.report() is rep  # no arguments: the last call's report
    assert rep.modules == {"up": "mxfp4_all", "down": "mxfp4_all", "": "mxfp4_all"}
    assert [r.path for r in rep.unused_rules] == ["attn.*"]
    assert "unused: Rule('attn.*' -> fp8, operands=weight)" in str(rep)
    assert wrapped.report(v, x).modules == rep.modules


def test_wrap_linen_rules_first_match_wins_and_none_leaves_unchanged():
    x = _x()
    m = LinenMLP()
    v = m.init(jax.random.key(0), x)
    wrapped = mnn.wrap(m, [mnn.Rule(path="down", policy=None),
                           mnn.Rule(path="up|down", policy="mxfp4_all_h16"),
                           mnn.Rule(path=".*", policy="fp8")])
    rep = wrapped.report(v, x)
    assert rep.modules == {"up": "mxfp4_all_h16", "down": None, "": "fp8"}
    assert [(s.path, s.rule) for s in rep.sites] == [("up", 1), ("down", 0), ("", 2)]
    assert rep.unused_rules == ()
    down = next(s for s in rep.sites if s.path == "down")
    assert "rule 0 (policy None): unchanged" in down.why
    assert "no rule selects" not in down.why


def test_wrap_reaches_flax_attention_whose_code_we_did_not_write():
    # flax.linen.MultiHeadDotProductAttention: DenseGeneral projections plus the
    # attention core, which calls jnp.einsum directly (flax's own code).
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32, name="attn")(x)
            return nn.Dense(32, name="ffn")(nn.LayerNorm(name="ln")(x + h))

    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    m = Block()
    v = m.init(jax.random.key(0), x)
    wrapped = mnn.wrap(m, [mnn.Rule(path="attn", policy="passthrough", operands="activation"),
                           mnn.Rule(path=".*", policy="mxfp4_all")])
    y, grads = jax.jit(jax.value_and_grad(lambda v: jnp.sum(wrapped.apply(v, x) ** 2)))(v)
    rep = wrapped.last_report
    assert rep.modules == {"attn/query": "mxfp4_all", "attn/key": "mxfp4_all",
                           "attn/value": "mxfp4_all", "attn": "passthrough",
                           "attn/out": "mxfp4_all", "ffn": "mxfp4_all"}
    assert sum(s.path == "attn" for s in rep.sites) == 2  # q·k and probs·v einsums
    y0 = jax.jit(lambda v: jnp.sum(m.apply(v, x) ** 2))(v)
    assert not np.allclose(float(y), float(y0), rtol=1e-6)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["params"]["attn"]["query"]["kernel"]).sum()) > 0


def test_wrap_linen_randomized_layers_and_scan_iterations_get_their_own_noise():
    class Body(nn.Module):
        @nn.compact
        def __call__(self, c, x):
            return c, nn.Dense(32, kernel_init=nn.initializers.constant(0.05), name="d")(x)

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            s = nn.scan(nn.remat(Body), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=3)
            return s(name="layers")(None, jnp.stack([x, x, x]))[1]

    x = _x()
    m = Scanned()
    v = m.init(jax.random.key(0), x)
    wrapped = mnn.wrap(m, "mxfp4_all_rht16")
    f = jax.jit(lambda v, k: wrapped.apply(v, x, rngs={"mxjax": k}))
    ys = f(v, jax.random.key(1))
    assert wrapped.last_report.modules == {"layers/d": "mxfp4_all_rht16"}
    # Same weights, same input in all three scanned layers: only the noise differs.
    assert not np.array_equal(np.asarray(ys[0]), np.asarray(ys[1]))
    assert not np.array_equal(np.asarray(ys[1]), np.asarray(ys[2]))
    np.testing.assert_array_equal(np.asarray(ys), np.asarray(f(v, jax.random.key(1))))
    assert not np.array_equal(np.asarray(ys), np.asarray(f(v, jax.random.key(2))))
    with pytest.raises(ValueError, match="rngs=\\{'mxjax'"):
        wrapped.apply(v, x)


# ----------------------------------------------------------------------------- wrap: NNX
def test_wrap_nnx_mlp_equals_the_model_built_with_the_policy_and_reports():
    x = _x()
    plain = NnxMLP(rngs=nnx.Rngs(0))
    built = NnxMLP(rngs=nnx.Rngs(0), dot_general=MX.dot_general())
    wrapped = mnn.wrap(plain, [mnn.Rule(path="up|down|", policy=MX),
                               mnn.Rule(path="never", policy="fp8")])

    def loss(m):
        return jnp.mean(m(x) ** 2)

    step = nnx.jit(lambda m: nnx.value_and_grad(loss)(m))
    l1, g1 = step(wrapped)
    l2, g2 = step(built)
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
    _leaves_equal(nnx.state(g1.module, nnx.Param), nnx.state(g2, nnx.Param))
    rep = wrapped.report(x)
    assert rep.modules == {"up": "mxfp4_all", "down": "mxfp4_all", "": "mxfp4_all"}
    assert [r.path for r in rep.unused_rules] == ["never"]
    assert wrapped.module is plain


def test_wrap_nnx_reaches_flax_attention_whose_code_we_did_not_write():
    # nnx.MultiHeadAttention (flax's code): LinearGeneral projections plus the
    # attention core's jnp.einsum calls.
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=32, qkv_features=32,
                                               decode=False, rngs=rngs)
            self.ffn = nnx.Linear(32, 32, rngs=rngs)

        def __call__(self, x):
            return self.ffn(x + self.attn(x))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    model = Model(nnx.Rngs(0))
    wrapped = mnn.wrap(model, [mnn.Rule(path=r"blocks/1/.*", policy="passthrough", operands="any"),
                               mnn.Rule(path=r"blocks/0/(attn/\w+|ffn)", policy="mxfp4_all")])
    rep = wrapped.report(x)
    expected = {f"blocks/{i}/{n}": ("mxfp4_all", "passthrough")[i] for i in (0, 1)
                for n in ("attn/query", "attn/key", "attn/value", "attn/out", "ffn")}
    expected["blocks/0/attn"] = None  # the score einsums of block 0: no rule matched
    expected["blocks/1/attn"] = "passthrough"
    assert rep.modules == expected
    assert sum(s.path == "blocks/0/attn" for s in rep.sites) == 2
    loss_fn = lambda m: jnp.sum(m(x) ** 2)
    loss, grads = nnx.jit(lambda m: nnx.value_and_grad(loss_fn)(m))(wrapped)
    exact = nnx.jit(loss_fn)(model)
    assert np.isfinite(float(loss)) and not np.isclose(float(loss), float(exact))
    g = nnx.state(grads, nnx.Param)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(g))


def test_wrap_nnx_randomized_noise_per_layer_and_per_step():
    class Parallel(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(32, 32, rngs=rngs)
            self.b = nnx.Linear(32, 32, rngs=rngs)
            self.b.kernel[...] = self.a.kernel[...]
            self.b.bias[...] = self.a.bias[...]

        def __call__(self, x):
            return self.a(x), self.b(x)

    x = _x()
    model = Parallel(nnx.Rngs(0))
    f = nnx.jit(lambda m, x: m(x))
    wrapped = mnn.wrap(model, "mxfp4_all_rht16", rngs=nnx.Rngs(mxjax=0))
    a1, b1 = f(wrapped, x)
    a2, _ = f(wrapped, x)
    assert not np.array_equal(np.asarray(a1), np.asarray(b1))  # same weights, own noise
    assert not np.array_equal(np.asarray(a1), np.asarray(a2))  # a new key every step
    again = mnn.wrap(model, "mxfp4_all_rht16", rngs=nnx.Rngs(mxjax=0))
    np.testing.assert_array_equal(np.asarray(f(again, x)[0]), np.asarray(a1))  # same seed


# ----------------------------------------------------------------------------- functions
def test_wrap_a_function_with_named_scopes_and_jnp_dot():
    def f(x, w1, w2):
        with jax.named_scope("first"):
            h = jnp.dot(x, w1)
        with jax.named_scope("second"):
            return h @ w2

    x, w1, w2 = _x(), _x(32, 32, 2), _x(32, 32, 3)
    wf = mnn.wrap(f, [mnn.Rule(path="first", policy=MX)], params_argnums=(1, 2))
    y = jax.jit(wf)(x, w1, w2)
    ref = MX_MATMUL(x, w1) @ w2
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6, atol=1e-5)
    assert wf.last_report.modules == {"first": "mxfp4_all", "second": None}


def test_wrap_reaches_dots_inside_cond_loops_custom_jvp_and_vmap():
    w = _x(32, 32, 2) * 0.2

    @jax.custom_jvp
    def cj(x):
        return x @ w

    cj.defjvp(lambda p, t: (cj(p[0]), t[0] @ w))

    @jax.custom_vjp
    def cv(x):
        return x @ w

    cv.defvjp(lambda x: (cv(x), None), lambda _, g: (g @ w.T,))

    def f(x, i):
        x = lax.cond(i > 0, lambda x: jnp.tanh(x @ w), lambda x: x, x)
        x = lax.fori_loop(0, 2, lambda _, x: jnp.tanh(x @ w), x)
        return cv(cj(x))

    def manual(x, i):
        d = functools.partial(mxjax.dot_general, dimension_numbers=DIMS, policy=MX)
        x = jnp.tanh(d(x, w)) if i > 0 else x
        for _ in range(2):
            x = jnp.tanh(d(x, w))
        return d(x, w) @ w  # the custom_vjp matmul is left unchanged

    x = _x()
    wf = mnn.wrap(f, MX)
    y = jax.jit(lambda x: wf(x, 1))(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(jax.jit(lambda x: manual(x, 1))(x)),
                               rtol=1e-5, atol=1e-5)
    rep = wf.last_report
    assert len(rep.sites) == 3  # cond branch, loop body, custom_jvp (traced once each)
    assert len(rep.skipped) == 1 and "custom_vjp" in rep.skipped[0]
    yv = jax.jit(jax.vmap(lambda x: wf(x, 1)))(x.reshape(2, 16, 32))
    np.testing.assert_allclose(np.asarray(yv.reshape(32, 32)),
                               np.asarray(jax.jit(jax.vmap(lambda x: manual(x, 1)))(
                                   x.reshape(2, 16, 32)).reshape(32, 32)), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- errors
def test_wrap_and_rule_errors():
    with pytest.raises(ValueError, match="not a valid regular expression"):
        mnn.Rule(path="(", policy="passthrough")
    with pytest.raises(ValueError, match="unknown preset"):
        mnn.Rule(path=".*", policy="mxfp44")
    with pytest.raises(TypeError, match="policy_or_rules"):
        mnn.wrap(LinenMLP(), [])
    with pytest.raises(TypeError, match="model"):
        mnn.wrap(3, "passthrough")
    with pytest.raises(ValueError, match="'mxjax' stream"):
        mnn.wrap(NnxMLP(rngs=nnx.Rngs(0)), "tseng")
    with pytest.raises(ValueError, match="mxjax_key"):
        mnn.wrap(lambda x: x @ x, "mxfp4_all_sr")(jnp.ones((4, 4)))
