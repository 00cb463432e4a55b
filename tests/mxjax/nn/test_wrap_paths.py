"""mxjax.nn.wrap on models it did not write: paths that JAX's caches cannot
change, bridge modules, and nothing changed on the user's objects."""

from __future__ import annotations

import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mxjax
import mxjax.nn as mnn

MX = mxjax.policies.get("mxfp4_all")
DIMS = (((1,), (0,)), ((), ()))
X = jax.random.normal(jax.random.key(1), (4, 16))
TOKENS = jax.random.randint(jax.random.key(2), (2, 4), 0, 64)


def _sites(rep):
    return [(s.path, s.kind, None if s.policy is None else s.policy.name) for s in rep.sites]


def _lowered(fn, *args) -> str:
    """The lowered HLO's instructions with their op_name metadata (no stack frames)."""
    text = jax.jit(fn).lower(*args).as_text(dialect="hlo", debug_info=True)
    return "\n".join(re.sub(r" stack_frame_id=\d+", "", line) for line in text.splitlines()
                     if re.match(r"\s*(ROOT )?%?[\w.]+ = ", line))


def _quantizes(program: str) -> bool:
    """Whether a lowered program holds a quantizer (its block amax: a max-reduction of the
    elements' abs bits, u32)."""
    return re.search(r"= u32\[[0-9,]*\]\S* reduce\(", program) is not None


def _no_mxjax(program: str) -> None:
    names = re.findall(r'op_name="([^"]*)"', program)
    assert names, "no op_name metadata to check"
    assert not [n for n in names if "mxjax" in n], "mxjax's scopes in a plain program"


# ------------------------------------------------------ a module reached by two paths
def _nn_jit_model():
    class M(nn.Module):
        @functools.partial(nn.jit, static_argnames=("self",))
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="up")(x)

    return M()


def test_case1_nn_jit_paths_survive_a_plain_call_first():
    m = _nn_jit_model()
    v = m.init(jax.random.key(0), X)
    m.apply(v, X)  # the plain model first: nn.jit caches its trace
    w = mnn.wrap(m, [mnn.Rule(path="up", policy="mxfp4_all_h16")])
    assert _sites(w.report(v, X)) == [("up", "weight", "mxfp4_all_h16")]


# ----------------------------------------------------------------------------- caches, both orders
def _linen_models():
    """Fresh Linen models (fresh functions: cold caches), one per JAX/Flax cache."""
    proj = jax.jit(lambda x, k: x @ k)  # a jitted helper inside a module's code

    class Jitted(nn.Module):
        @functools.partial(nn.jit, static_argnames=("self",))
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16, name="inner")(x)

    class Helper(nn.Module):
        @nn.compact
        def __call__(self, x):
            return proj(x, self.param("kernel", nn.initializers.normal(0.2), (16, 16)))

    class Body(nn.Module):
        @nn.compact
        def __call__(self, c, x):
            return c, nn.Dense(16, name="d")(x)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = Jitted(name="jitted")(x)
            x = nn.remat(Helper)(name="helper")(x)
            scan = nn.scan(nn.remat(Body), variable_axes={"params": 0},
                           split_rngs={"params": True}, length=2)
            return scan(name="layers")(None, jnp.stack([x, x]))[1]

    return Model()


LINEN_PATHS = [("jitted/inner", "weight", "fp8"), ("helper", "weight", "fp8"),
               ("layers/d", "weight", "fp8")]


@pytest.mark.parametrize("plain_first", [True, False])
def test_linen_caches_change_nothing_in_either_order(plain_first):
    # nn.jit, a jax.jit helper, nn.remat and nn.scan. A plain call first must not
    # hide the paths from wrap; a plain call after a wrapped one must not see mxjax.
    # (Lowering traces as a call does, through the same caches; nothing compiles.)
    m = _linen_models()
    v = m.init(jax.random.key(0), X)
    wrapped = mnn.wrap(m, "fp8")  # cheap to lower; the paths are the point
    plain_before = _lowered(m.apply, v, X) if plain_first else None
    assert _quantizes(_lowered(wrapped.apply, v, X))
    assert _sites(wrapped.last_report) == LINEN_PATHS
    plain_after = _lowered(m.apply, v, X)
    _no_mxjax(plain_after)
    assert not _quantizes(plain_after)
    if plain_before is None:  # the same program as a model never wrapped
        fresh = _linen_models()
        plain_before = _lowered(fresh.apply, v, X)
    assert plain_after == plain_before


def _nnx_model():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 16, rngs=rngs)

        @nnx.jit
        def __call__(self, x):
            return jnp.tanh(self.up(x))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.first = Block(rngs)

            @nnx.vmap(in_axes=0, out_axes=0)
            def stacked(key):
                return Block(nnx.Rngs(params=key))

            self.layers = stacked(jax.random.split(jax.random.key(1), 2))
            self.q = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            x = self.first(x)

            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def body(layer, x):
                return nnx.remat(lambda layer, x: layer(x))(layer, x)

            x = body(self.layers, x)
            return jnp.einsum("bd,cd->bc", self.q(x), x)

    return Net(nnx.Rngs(0))


NNX_PATHS = [("first/up", "weight", "fp8"), ("layers/up", "weight", "fp8"),
             ("q", "weight", "fp8"), ("", "activation", "passthrough")]


@pytest.mark.parametrize("plain_first", [True, False])
def test_nnx_caches_change_nothing_in_either_order(plain_first):
    # nnx.jit inside the model (a cached trace on copies of the modules), nnx.scan
    # over nnx.vmap-stacked layers, nnx.remat, and the user's nnx.jit around it all.
    model = _nnx_model()

    def program(m):
        return _lowered(nnx.jit(lambda m, x: m(x)), m, X)

    plain_before = program(model) if plain_first else None
    wrapped = mnn.wrap(model, [mnn.Rule(path=".*", policy="passthrough", operands="activation"),
                               mnn.Rule(path=".*", policy="fp8")])
    assert _quantizes(program(wrapped))
    assert _sites(wrapped.last_report) == NNX_PATHS
    plain_after = program(model)
    _no_mxjax(plain_after)
    assert not _quantizes(plain_after)
    if plain_before is None:
        plain_before = program(_nnx_model())
    assert plain_after == plain_before


_PERSISTENT_CACHE_SCRIPT = r"""
import os, sys, jax, jax.numpy as jnp, numpy as np, flax.linen as nn
import mxjax, mxjax.nn as mnn
assert mxjax.__file__.startswith(sys.argv[2]), mxjax.__file__
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(32, name="up")(x))

# Everything jitted: each program is one cache entry (no op-by-op compiles).
x = np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32)
m = MLP(); v = jax.jit(lambda x: m.init(jax.random.key(0), x))(x)
policy = mxjax.policies.get("fp8")
wrapped = mnn.wrap(m, policy)
run = {"plain": lambda: jax.jit(m.apply)(v, x), "wrapped": lambda: jax.jit(wrapped.apply)(v, x)}
first = {name: np.asarray(run[name]()) for name in ("plain", "wrapped")}
ref = jax.jit(lambda p: jnp.tanh(mxjax.dot_general(x, p["kernel"], (((1,), (0,)), ((), ())),
                                                 policy=policy) + p["bias"]))(v["params"]["up"])
n_files = len(os.listdir(sys.argv[1]))
jax.clear_caches()
second = {name: np.asarray(run[name]()) for name in ("wrapped", "plain")}  # from the disk
np.testing.assert_array_equal(first["wrapped"], np.asarray(ref))
assert not np.array_equal(first["plain"], first["wrapped"])
for name in first:
    np.testing.assert_array_equal(second[name], first[name])
assert n_files >= 2 and len(os.listdir(sys.argv[1])) == n_files, (n_files, sys.argv[1])
print("ok", n_files)
"""


@pytest.mark.slow
def test_the_persistent_compilation_cache_changes_nothing(tmp_path):
    # In a fresh process (JAX sets the cache up once per process): plain, then wrapped;
    # then, JAX's in-memory caches cleared, wrapped and plain again from the disk cache.
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[3]
    script, cache = tmp_path / "run.py", tmp_path / "cache"
    script.write_text(_PERSISTENT_CACHE_SCRIPT)
    cache.mkdir()
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(script), str(cache), str(root)],
                          check=False, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")


# ----------------------------------------------------------------------------- case 2: bridges
def _snapshot(model: nnx.Module):
    """Class, attributes (by identity) and state (by value) of every object in the graph."""
    objs = [(p, o) for p, o in nnx.iter_graph(model) if isinstance(o, nnx.Module)]
    def value(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return ([(p, type(o), {k: id(a) for k, a in vars(o).items()}) for p, o in objs],
            jax.tree.map(value, nnx.state(model)))


def _to_nnx_dense():
    m = nnx.bridge.ToNNX(nn.Dense(8), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(m, jnp.ones((2, 32)))
    return m


def _assert_untouched(model, before, twin_after_plain_call):
    """Classes and attributes as before; state as a plain call leaves it (e.g. RNG counts)."""
    after = _snapshot(model)
    assert after[0] == before[0]
    jax.tree.map(np.testing.assert_array_equal, after[1], twin_after_plain_call[1])


def test_case2_nnx_with_linen_inside_through_to_nnx_and_nothing_changes_on_it():
    m = _to_nnx_dense()
    x = jax.random.normal(jax.random.key(3), (2, 32))
    wrapped = mnn.wrap(m, "mxfp4_all_h16")

    @nnx.jit
    def both(wrapped, x):
        ref = mxjax.dot_general(x, m.kernel[...], DIMS, policy="mxfp4_all_h16") + m.bias[...]
        return wrapped(x), ref

    y, ref = both(wrapped, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    assert _sites(wrapped.last_report) == [("", "weight", "mxfp4_all_h16")]
    # What wrap and a call change on the user's objects (an eager call: nnx.jit's own
    # graph updates aside): nothing but what the plain call itself changes.
    m, twin = _to_nnx_dense(), _to_nnx_dense()
    before = _snapshot(m)
    wrapped = mnn.wrap(m, "mxfp4_all_h16")
    assert _snapshot(m)[0] == before[0]
    wrapped.report(x)  # traced with the policy, abstractly
    mnn.wrap(m, "passthrough")(x)  # called eagerly (a pass-through policy: cheap op by op)
    twin(x)
    _assert_untouched(m, before, _snapshot(twin))


class _Attend(nnx.Module):
    def __init__(self, rngs):
        self.q = nnx.Linear(16, 16, rngs=rngs)
        self.k = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        p = jax.nn.softmax(jnp.einsum("btd,bsd->bts", self.q(x), self.k(x)), axis=-1)
        return jnp.einsum("bts,bsd->btd", p, x)


class _Mixed(nnx.Module):
    """NNX holding Linen (ToNNX), an nnx.List and attention; paths from the data."""

    def __init__(self, rngs):
        self.enc = nnx.bridge.ToNNX(nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(16)]),
                                    rngs=rngs)
        self.blocks = nnx.List([_Attend(rngs)])
        self.out = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.out(self.blocks[0](self.enc(x)))


def _mixed(x):
    model = _Mixed(nnx.Rngs(0))
    nnx.bridge.lazy_init(model.enc, x)
    return model


def test_nnx_graph_with_bridge_list_attention_is_untouched():
    x = jax.random.normal(jax.random.key(4), (2, 3, 16))
    model, twin = _mixed(x), _mixed(x)
    before = _snapshot(model)
    rep = mnn.wrap(model, "mxfp4_fprop").report(x)
    assert {s.path: s.kind for s in rep.sites} == {
        "enc/layers_0": "weight", "enc/layers_2": "weight", "blocks/0/q": "weight",
        "blocks/0/k": "weight", "blocks/0": "activation", "": "activation", "out": "weight"}
    # The values einsum: probabilities (from blocks/0) x the block's input (from enc).
    assert [s.path for s in rep.sites if s.kind == "activation"] == ["blocks/0", ""]
    mnn.wrap(model, "passthrough")(x)
    twin(x)
    _assert_untouched(model, before, _snapshot(twin))


def test_linen_with_nnx_inside_through_to_linen():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nnx.bridge.ToLinen(nnx.Linear, args=(16, 16), name="inner")(x)
            return nn.Dense(16, name="out")(jnp.tanh(h))

    m = Model()
    v = m.init(jax.random.key(0), X)
    wrapped = mnn.wrap(m, [mnn.Rule(path="inner", policy="mxfp4_all")])
    assert _sites(wrapped.report(v, X)) == [("inner", "weight", "mxfp4_all"),
                                            ("out", "weight", None)]

    @jax.jit
    def both(v, x):
        p = v["params"]
        h = mxjax.dot_general(x, p["inner"]["kernel"], DIMS, policy=MX) + p["inner"]["bias"]
        return wrapped.apply(v, x), jnp.tanh(h) @ p["out"]["kernel"] + p["out"]["bias"]

    y, ref = both(v, X)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- case 3: nested apply
class _TiedByApply(nn.Module):
    def setup(self):
        self.wte = nn.Embed(64, 32)
        self.lm_head = nn.Dense(64, use_bias=False)

    def __call__(self, t):
        return self.lm_head.apply({"params": {"kernel": self.wte.embedding.T}}, self.wte(t))


def test_case3_a_submodule_applied_inside_its_parent_has_its_own_path():
    m = _TiedByApply()
    v = m.init(jax.random.key(0), TOKENS)
    wrapped = mnn.wrap(m, [mnn.Rule(path="lm_head", policy="mxfp4_all", operands="head")])

    @jax.jit
    def both(v, t):
        table = v["params"]["wte"]["embedding"]
        dims = (((2,), (0,)), ((), ()))
        return wrapped.apply(v, t), mxjax.dot_general(table[t], table.T, dims, policy=MX)

    y, ref = both(v, TOKENS)
    assert _sites(wrapped.last_report) == [("lm_head", "head", "mxfp4_all")]
    assert wrapped.last_report.sites[0].head_rule == "tied"
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))


class _Encoded(nn.Module):
    def setup(self):
        self.enc = nn.Dense(8)

    def encode(self, x):
        return self.enc(x)

    def __call__(self, x):
        return self.encode(x)  # Flax scopes: '_Encoded/_Encoded.encode/enc'


def test_method_calls_and_method_functions_drop_method_names():
    m = _TiedByApply()
    v = m.init(jax.random.key(0), TOKENS)
    wrapped = mnn.wrap(m, mnn.Rule(path=".*", policy="passthrough", operands="any"))
    attend = wrapped.report(v, TOKENS, method=lambda mod, t: mod.wte.attend(mod.wte(t)))
    assert _sites(attend) == [("wte", "head", "passthrough")]  # Flax's scope: 'wte.attend'
    # A module calling its own method; a class lifted by nn.jit (scope: the inner class).
    for model in (_Encoded(), nn.jit(_Encoded)()):
        v = model.init(jax.random.key(0), X)
        wrapped = mnn.wrap(model, "passthrough")
        assert _sites(wrapped.report(v, X)) == [("enc", "weight", "passthrough")]
        assert _sites(wrapped.report(v, X, method="encode")) == [("enc", "weight", "passthrough")]


def test_without_flax_module_scopes_wrap_says_so():
    m = _TiedByApply()
    v = m.init(jax.random.key(0), TOKENS)
    nn.disable_named_call()
    try:
        with pytest.raises(ValueError, match="enable_named_call"):
            mnn.wrap(m, "mxfp4_all").report(v, TOKENS)
    finally:
        nn.enable_named_call()


# ----------------------------------------------------------------------------- case 4: not GEMMs
class _Norms(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.normal(1.0), (x.shape[-1],))
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        y = jnp.einsum("...k,k->...k", y, scale)  # RMSNorm's scale as an einsum
        outer = self.param("outer", nn.initializers.normal(1.0), (1, 8))
        return y[:, :1] @ outer, y  # a contraction of size 1: an outer product


def test_case4_dot_generals_that_sum_nothing_stay_exact_and_are_reported():
    m = _Norms()
    v = m.init(jax.random.key(0), X)
    wrapped = mnn.wrap(m, mnn.Rule(path=".*", policy="mxfp4_all", operands="any"))
    with pytest.warns(UserWarning, match=re.escape("'(root)' (not_gemm, 2 dots)")):
        got = jax.jit(wrapped.apply)(v, X)  # no GEMM, so no rule matched: a warning
    jax.tree.map(np.testing.assert_array_equal, got, jax.jit(m.apply)(v, X))
    rep = wrapped.last_report
    assert [(s.kind, s.policy, s.rule) for s in rep.sites] == [("not_gemm", None, None)] * 2
    assert "no contracting dimension" in rep.sites[0].why
    assert "total size 1" in rep.sites[1].why
    assert rep.sites_of("not_gemm") == rep.sites and rep.modules == {}
    assert "not_gemm" in str(rep)


# ----------------------------------------------------------------------------- case 5: heads
class _LM(nn.Module):
    ffn: int = 64  # as wide as the vocabulary: not a head (it does not reach the output)

    @nn.compact
    def __call__(self, t):
        x = nn.Embed(64, 16, name="embed")(t)
        x = x + nn.Dense(16, name="down")(jax.nn.gelu(nn.Dense(self.ffn, name="up")(x)))
        return nn.Dense(64, name="logits_dense")(x), x  # logits and the hidden states


def test_case5_an_untied_head_by_structure_whatever_its_name():
    m = _LM()
    v = m.init(jax.random.key(0), TOKENS)
    rep = mnn.wrap(m, "fp8").report(v, TOKENS)
    assert _sites(rep) == [("up", "weight", "fp8"), ("down", "weight", "fp8"),
                           ("logits_dense", "head", None)]
    head = rep.sites[-1]
    assert head.head_rule == "structure" and "vocabulary" in head.why
    # The hidden states reach the output too, through `down`: not a head (width 16).
    heads = mnn.wrap(m, mnn.Rule(path=".*", policy="fp8", operands="head")).report(v, TOKENS)
    assert [s.path for s in heads.sites if s.policy is not None] == ["logits_dense"]


# ----------------------------------------------------------------------------- unmatched rules
def test_when_no_rule_matches_wrap_warns_once_with_rules_and_paths():
    m = _LM()
    v = m.init(jax.random.key(0), TOKENS)
    wrapped = mnn.wrap(m, [mnn.Rule(path="model/up", policy="mxfp4_all"),
                           mnn.Rule(path="down", policy="fp8", operands="activation")])
    with pytest.warns(UserWarning, match="no rule matched") as caught:
        jax.eval_shape(wrapped.apply, v, TOKENS)  # a call (traced: nothing compiled)
    msg = str(caught[0].message)
    assert "Rule('model/up' -> mxfp4_all" in msg and "Rule('down' -> fp8" in msg
    assert "'up' (weight, 1 dot)" in msg and "'logits_dense' (head, 1 dot)" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.eval_shape(wrapped.apply, v, TOKENS)  # once per wrapped model
        every = mnn.wrap(m, [mnn.Rule(path="up", policy="mxfp4_all"),
                             mnn.Rule(path="down", policy="fp8")])
        jax.eval_shape(every.apply, v, TOKENS)  # every rule matched: no warning
    rep = wrapped.last_report
    assert [r.path for r in rep.unused_rules] == ["model/up", "down"]
    fn = mnn.wrap(lambda x: x @ x.T, mnn.Rule(path="nowhere", policy="passthrough"))
    with pytest.warns(UserWarning, match=re.escape("'(root)' (activation, 1 dot)")):
        jax.eval_shape(fn, X)


def test_a_rule_matching_nothing_warns_once_even_when_others_matched():
    # A typo in one rule's path is reported even when another rule matched.
    m = _LM()
    v = m.init(jax.random.key(0), TOKENS)
    wrapped = mnn.wrap(m, [mnn.Rule(path="dwon", policy=None),  # typo for 'down'
                           mnn.Rule(path="up", policy="fp8", operands="activation"),
                           mnn.Rule(path=".*", policy="mxfp4_all")])
    with pytest.warns(UserWarning, match="2 rules matched no matmul") as caught:
        jax.eval_shape(wrapped.apply, v, TOKENS)
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "rule 0, Rule('dwon' -> unchanged, operands=weight): its path matches no " in msg
    assert "nearest paths seen: 'down'" in msg  # difflib: the typo's nearest path first
    assert "rule 1, Rule('up' -> fp8, operands=activation)" in msg
    assert "of kind weight, not in its operands" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.eval_shape(wrapped.apply, v, TOKENS)  # once per wrapped model
    shadowed = mnn.wrap(m, [mnn.Rule(path=".*", policy="fp8"),
                            mnn.Rule(path="up", policy="mxfp4_all")])
    with pytest.warns(UserWarning, match=re.escape(
            "every dot_general it selects was taken by an earlier rule (rule 0: Rule('.*'")):
        jax.eval_shape(shadowed.apply, v, TOKENS)


# ----------------------------------------------------------------------------- op_name agreement
def _op_names(hlo: str) -> list[str]:
    names = re.findall(r'op_name="([^"]*)/dot_general"', hlo)
    # Drop JAX's own entries: jit(...), transforms, einsum scopes, and the platform switch's
    # kept branch ("cond/branch_<k>_fun" up to jax 0.12.0, "platform" from 0.12.1 on).
    out = []
    for n in names:
        parts = [p for p in n.split("/")[1:]
                 if not re.fullmatch(r"\w+\(.*\)|cond|branch_\d+_fun|platform", p)]
        out.append("/".join(p for p in parts if "," not in p and "->" not in p))
    return out


def test_hlo_op_names_end_with_the_reported_paths():
    class Tied(nn.Module):
        @nn.compact
        def __call__(self, t):
            embed = nn.Embed(64, 16, name="embed")
            x = nn.Dense(16, name="mlp")(embed(t))
            return jnp.dot(x, embed.embedding.T)  # root code, the table's module: 'embed'

    m = Tied()
    v = m.init(jax.random.key(0), TOKENS)
    linen = mnn.wrap(m, mnn.Rule(path=".*", policy="mxfp4_all", operands="any"))
    names = _op_names(jax.jit(linen.apply).lower(v, TOKENS).as_text(dialect="hlo",
                                                                            debug_info=True))
    paths = [s.path for s in linen.report(v, TOKENS).sites]
    assert paths == ["mlp", "embed"]
    for p in paths:
        assert any(n.endswith(p) for n in names), (p, names)
    assert "mxjax" not in " ".join(names)
    model = _nnx_model()
    nnx_wrapped = mnn.wrap(model, [mnn.Rule(path=".*", policy="passthrough", operands="activation"),
                                   mnn.Rule(path=".*", policy="fp8")])
    gw, sw = nnx.split(nnx_wrapped)
    hlo = jax.jit(lambda s, x: nnx.merge(gw, s)(x)).lower(sw, X).as_text(dialect="hlo",
                                                                          debug_info=True)
    names = _op_names(hlo)
    paths = [s.path for s in nnx_wrapped.last_report.sites]  # the lowering's own trace
    assert paths == [p for p, _, _ in NNX_PATHS]
    for p in paths:
        assert any(n.endswith(p) for n in names), (p, names)
