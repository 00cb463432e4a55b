"""mxjax.nn.wrap operand kinds: linear layers by default, attention and heads on request."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import lax

import mxjax.nn as mnn
import mxjax.testing as mt

V, D = 64, 16


class TiedLM(nn.Module):
    """Tied embedding (gather in, jnp.dot out), einsum attention on a cast and transposed kernel."""

    @nn.compact
    def __call__(self, tokens):
        emb = nn.Embed(V, D, name="embed")
        x = emb(tokens)                                              # gather: the table
        w = self.param("qk", nn.initializers.normal(0.2), (D, 2 * D))
        qk = x @ w.astype(jnp.bfloat16).T.reshape(2 * D, D).T.astype(jnp.float32)  # cast/reshape
        q, k = jnp.split(qk, 2, axis=-1)
        p = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k), axis=-1)   # activation x activation
        x = x + jnp.einsum("bts,bsd->btd", p, k)
        x = nn.Dense(D, name="mlp")(x)
        return jnp.dot(x, emb.embedding.T)                               # tied output head


class UntiedLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        return nn.Dense(V, name="lm_head")(nn.Dense(D, name="mlp")(x))


TOKENS = jax.random.randint(jax.random.key(1), (2, 8), 0, V)


def _kinds(rep):
    return [(s.path, s.kind, None if s.policy is None else s.policy.name) for s in rep.sites]


def test_default_quantizes_linear_layers_only_and_the_report_says_why():
    m = TiedLM()
    v = m.init(jax.random.key(0), TOKENS)
    wrapped = mnn.wrap(m, "mxfp4_all")
    with pytest.raises(RuntimeError, match="not been called yet"):
        wrapped.report()
    y = jax.jit(wrapped.apply)(v, TOKENS)
    rep = wrapped.report()
    assert rep is wrapped.last_report
    assert _kinds(rep) == [("", "weight", "mxfp4_all"),          # x @ (cast, reshaped) kernel
                           ("", "activation", None), ("", "activation", None),
                           ("mlp", "weight", "mxfp4_all"),
                           ("embed", "head", None)]   # the tied head: at the table's module
    assert "embedding table" in rep.sites[-1].why and "gather" in rep.sites[-1].why
    assert rep.sites[-1].head_rule == "tied"
    assert "both operands depend on the inputs" in rep.sites[1].why
    text = str(rep)
    assert "kind" in text and "head" in text and "activation" in text
    mt.assert_quantized_weight_matmuls(rep, "mxfp4_all", paths=("", "mlp"))
    # With arguments, report() traces anew and leaves last_report alone.
    assert _kinds(wrapped.report(v, TOKENS)) == _kinds(rep)
    assert wrapped.last_report is rep
    assert jnp.isfinite(y).all()


def test_rules_select_attention_and_the_head_by_operand_kind():
    m = TiedLM()
    v = m.init(jax.random.key(0), TOKENS)
    every = mnn.wrap(m, mnn.Rule(path=".*", policy="mxfp4_all", operands="any")).report(v, TOKENS)
    assert all(s.policy is not None for s in every.sites)
    heads = mnn.wrap(m, mnn.Rule(path=".*", policy="fp8", operands=("weight", "head")))
    assert [k for _, k, p in _kinds(heads.report(v, TOKENS)) if p == "fp8"] == [
        "weight", "weight", "head"]
    attn = mnn.wrap(m, [mnn.Rule(path=".*", policy="passthrough", operands="activation"),
                        mnn.Rule(path=".*", policy="mxfp4_all")])
    got = _kinds(attn.report(v, TOKENS))
    assert [p for _, k, p in got if k == "activation"] == ["passthrough", "passthrough"]
    with pytest.raises(AssertionError, match="quantized although not a weight matmul"):
        mt.assert_quantized_weight_matmuls(every)
    with pytest.raises(ValueError, match="operands"):
        mnn.Rule(path=".*", policy="passthrough", operands="weights")


def test_untied_head_by_structure_or_name_and_nnx_and_functions():
    m = UntiedLM()
    v = m.init(jax.random.key(0), TOKENS)
    rep = mnn.wrap(m, "mxfp4_all").report(v, TOKENS)
    assert _kinds(rep) == [("mlp", "weight", "mxfp4_all"), ("lm_head", "head", None)]
    assert rep.sites[1].head_rule == "structure" and "vocabulary" in rep.sites[1].why

    class Classifier(nn.Module):  # no embedding table: the name decides
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10, name="head")(nn.Dense(D, name="mlp")(x))

    x = jnp.ones((2, D))
    rep = mnn.wrap(Classifier(), "mxfp4_all").report(Classifier().init(jax.random.key(0), x), x)
    assert _kinds(rep) == [("mlp", "weight", "mxfp4_all"), ("head", "head", None)]
    assert rep.sites[1].head_rule == "name" and "named like an output head" in rep.sites[1].why

    class NnxTied(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.mlp = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, tokens):
            return self.embed.attend(self.mlp(self.embed(tokens)))

    wrapped = mnn.wrap(NnxTied(nnx.Rngs(0)), "mxfp4_all")
    nnx.jit(lambda m, t: m(t))(wrapped, TOKENS)
    assert _kinds(wrapped.report()) == [("mlp", "weight", "mxfp4_all"), ("embed", "head", None)]

    # Functions: parameters are params_argnums and closed-over arrays; a scan
    # carry that starts as a parameter but mixes in data is data (fixed point).
    w_closed = jnp.ones((D, D)) * 0.1

    def f(w, x):
        def body(c, _):
            return jnp.tanh(c @ c + x), None

        c = lax.scan(body, w, None, length=2)[0]
        return (c @ w) @ w_closed

    x = jnp.ones((D, D))
    assert [s.kind for s in mnn.wrap(f, "mxfp4_all", params_argnums=0).report(w_closed, x)
            .sites] == ["activation", "weight", "weight"]
    assert [s.kind for s in mnn.wrap(f, "mxfp4_all").report(w_closed, x).sites] == [
        "activation", "activation", "weight"]
    with pytest.raises(ValueError, match="params_argnums"):
        mnn.wrap(m, "passthrough", params_argnums=0)


@pytest.mark.parametrize("tied", [False, True])
def test_the_projects_llama_wrapped_keeps_its_default_recipe(tied):
    # models.llama keeps attention and the embedding/head at compute precision
    # unless quantize_attention / quantize_embed_head: wrap's default agrees.
    from models.llama import Llama, LlamaConfig

    cfg = LlamaConfig.tiny(vocab_size=64, n_layers=1, dim=32, n_heads=2, n_kv_heads=1,
                           ffn_dim=48, tie_embeddings=tied)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    rep = mnn.wrap(model, "mxfp4_all").report(jnp.zeros((1, 8), jnp.int32))
    kinds = {}
    for s in rep.sites:
        kinds.setdefault(s.kind, []).append(s.path)
    assert len(kinds["weight"]) == 7  # q, k, v, o, gate, up, down
    assert len(kinds["activation"]) == 2  # scores and values
    assert len(kinds["head"]) == 1
    head = rep.sites_of("head")[0]
    assert head.policy is None
    assert head.head_rule == ("tied" if tied else "structure")
    assert head.path == ("embed_tokens" if tied else "lm_head")
    mt.assert_quantized_weight_matmuls(rep, "mxfp4_all")
