"""Llama model: presets, RoPE, masking, GQA, scan/unroll/remat, policy plumbing."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from llama_test_utils import RecordingPolicy, expected_layer_keys, max_abs, small

from models import llama as L
from models.llama import Llama, LlamaConfig, RopeScaling, param_count
from mxjax import policies


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(7), (2, 12), 0, 128, dtype=jnp.int32)


@functools.partial(nnx.jit, static_argnames=("policy",))
def _fwd(model, tokens, policy=None, policy_key=None):
    return model(tokens, policy=policy, policy_key=policy_key)


# --------------------------------------------------------------------------- presets


def test_llama3_8b_exact_param_count_without_allocation():
    cfg = LlamaConfig.llama3_8b()
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim,
            cfg.vocab_size) == (4096, 32, 32, 8, 128, 14336, 128256)
    assert cfg.rope_theta == 500000.0 and cfg.norm_eps == 1e-5 and not cfg.tie_embeddings
    assert cfg.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)
    assert param_count(cfg) == 8_030_261_248
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.float32)}
    q = abstract.layers.q_proj.kernel
    assert q.shape == (32, 4096, 4096)


def test_1b_and_tiny_presets():
    assert param_count(LlamaConfig.llama3_1b()) == 1_235_814_400  # Llama 3.2-1B
    t = LlamaConfig.tiny()
    assert (t.dim, t.n_layers, t.n_heads, t.n_kv_heads, t.ffn_dim) == (256, 4, 8, 2, 896)
    assert LlamaConfig.tiny(vocab_size=300).vocab_size == 300


def test_config_validation_and_dtype_normalisation():
    c = small(dtype="bfloat16", param_dtype=jnp.float32)
    assert c.dtype == np.dtype(jnp.bfloat16) and c.param_dtype == np.dtype("float32")
    assert hash(c) == hash(small(dtype=jnp.bfloat16))
    with pytest.raises(ValueError, match="n_kv_heads"):
        small(n_kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        small(dtype="int8")
    with pytest.raises(ValueError, match="attention_impl"):
        small(attention_impl="flash")
    with pytest.raises(ValueError, match="quantize_attention"):
        small(attention_impl="jax", quantize_attention=True)
    with pytest.raises(ValueError, match="vocab_size"):
        small(vocab_size=0)
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(TypeError):
        LlamaConfig(128, 64, 2, 4, 2, 128)  # keyword-only


def test_params_fp32_no_biases_and_logical_axes_everywhere():
    model = Llama(small(dtype="bfloat16"), rngs=nnx.Rngs(0))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    names = {".".join(map(str, p)) for p, _ in flat}
    assert not any("bias" in n for n in names)
    assert names == {
        "embed_tokens.embedding", "norm.scale", "lm_head.kernel",
        *(f"layers.{n}.kernel" for n in ("q_proj", "k_proj", "v_proj", "o_proj",
                                         "gate_proj", "up_proj", "down_proj")),
        "layers.input_layernorm.scale", "layers.post_attention_layernorm.scale"}
    for p, v in flat:
        assert v.get_value().dtype == jnp.float32, p
        axes = v.get_metadata()["logical_axes"]
        assert len(axes) == v.get_value().ndim, p
        assert (axes[0] == "layers") == (p[0] == "layers"), p


# --------------------------------------------------------------------------- RoPE


def _np_llama3_inv_freq(head_dim, theta, factor, low, high, old_len):
    """Direct float64 transcription of Meta's llama3 apply_scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2)[: head_dim // 2] / head_dim))
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out), freqs


@pytest.mark.parametrize("head_dim,theta,old_len", [(128, 500000.0, 8192), (16, 10000.0, 64),
                                                    (64, 500000.0, 8192)])
def test_rope_inv_freq_matches_numpy_llama3_formula(head_dim, theta, old_len):
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=old_len)
    got = np.asarray(L.rope_inv_freq(head_dim, theta, scaling))
    assert got.dtype == np.float32
    want, raw = _np_llama3_inv_freq(head_dim, theta, 8.0, 1.0, 4.0, old_len)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    # all three bands occur, so the test covers each branch
    wl = 2 * math.pi / raw
    assert (wl < old_len / 4).any() and (wl > old_len).any()
    assert ((wl >= old_len / 4) & (wl <= old_len)).any()
    np.testing.assert_allclose(np.asarray(L.rope_inv_freq(head_dim, theta, None)), raw,
                               rtol=2e-6)


def test_apply_rope_matches_numpy_half_split_rotation(np_rng):
    b, t, h, d = 2, 9, 3, 16
    x = np_rng.standard_normal((b, t, h, d)).astype(np.float32)
    inv = np.asarray(L.rope_inv_freq(d, 10000.0, RopeScaling(original_max_position_embeddings=64)))
    cos, sin = L.rope_cos_sin(jnp.arange(t), jnp.asarray(inv))
    got = np.asarray(L.apply_rope(jnp.asarray(x), cos, sin))
    ang = np.arange(t)[:, None].astype(np.float64) * inv.astype(np.float64)[None, :]
    # pair (i, i + d/2) rotated as a complex number by the angle of frequency i
    z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * np.exp(1j * ang)[None, :, None, :]
    want = np.concatenate([z.real, z.imag], axis=-1)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # the rotation preserves norms and is the identity at position 0
    np.testing.assert_allclose(got[:, 0], x[:, 0], atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-5)


# --------------------------------------------------------------------------- attention


def test_causal_mask_later_tokens_do_not_change_earlier_logits(tokens):
    model = Llama(small(), rngs=nnx.Rngs(1))
    changed = tokens.at[:, 8:].set((tokens[:, 8:] + 5) % 128)
    a = _fwd(model, tokens)
    b = _fwd(model, changed)
    assert max_abs(a[:, :8], b[:, :8]) <= 1e-6
    assert max_abs(a[:, 8:], b[:, 8:]) > 1e-3


def test_gqa_head_mapping_matches_numpy_repeat_kv(np_rng):
    b, t, h, kv, d = 2, 5, 8, 2, 4
    q = np_rng.standard_normal((b, t, h, d)).astype(np.float32)
    k = np_rng.standard_normal((b, t, kv, d)).astype(np.float32)
    v = np_rng.standard_normal((b, t, kv, d)).astype(np.float32)
    gemms = L._Gemms(None, None, 0)
    got = np.asarray(L._attention_explicit(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                           n_kv_heads=kv, gemms=gemms, quantize=False))
    want = np.zeros_like(q)
    g = h // kv
    for head in range(h):
        j = head // g  # HF repeat_kv: query heads j*g .. j*g+g-1 share KV head j
        s = np.einsum("btd,bsd->bts", q[:, :, head], k[:, :, j]) / math.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want[:, :, head] = np.einsum("bts,bsd->btd", p, v[:, :, j])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_jax_attention_impl_matches_explicit(tokens):
    a = _fwd(Llama(small(), rngs=nnx.Rngs(2)), tokens)
    b = _fwd(Llama(small(attention_impl="jax"), rngs=nnx.Rngs(2)), tokens)
    assert max_abs(a, b) <= 1e-5


# --------------------------------------------------------------------------- scan / remat


def _loss_and_grads(model, tokens, **kw):
    def loss(m):
        logits = m(tokens, **kw)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
            logits, tokens[..., None], -1)[..., 0])
    return nnx.jit(lambda m: nnx.value_and_grad(loss)(m))(model)


@pytest.mark.slow
def test_scan_equals_unrolled_forward_and_grads(tokens):
    cfg = small(n_layers=3)
    scanned = Llama(cfg, rngs=nnx.Rngs(3))
    unrolled = Llama(cfg.replace(scan_layers=False), rngs=nnx.Rngs(3))
    ps = nnx.state(scanned, nnx.Param)
    pu = nnx.state(unrolled, nnx.Param)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), ps, pu)))
    assert max_abs(_fwd(scanned, tokens), _fwd(unrolled, tokens)) <= 1e-5
    (ls, gs), (lu, gu) = _loss_and_grads(scanned, tokens), _loss_and_grads(unrolled, tokens)
    assert abs(float(ls) - float(lu)) <= 1e-6
    diffs = jax.tree.leaves(jax.tree.map(max_abs, gs, gu))
    assert max(diffs) <= 1e-5


def test_scan_compiles_one_block():
    """The scanned forward holds one copy of the block: its HLO has a while loop and
    its size does not grow with the layer count (the unrolled one does)."""
    toks = jnp.zeros((1, 8), jnp.int32)

    def hlo(cfg):
        model = Llama(cfg, rngs=nnx.Rngs(0))
        g, s = nnx.split(model)
        return jax.jit(lambda s, t: nnx.merge(g, s)(t)).lower(s, toks).as_text()

    s2, s6 = hlo(small(n_layers=2)), hlo(small(n_layers=6))
    u2, u6 = hlo(small(n_layers=2, scan_layers=False)), hlo(small(n_layers=6, scan_layers=False))
    assert "while" in s2 and "while" not in u2
    assert abs(len(s6) - len(s2)) < 0.05 * len(s2)
    assert len(u6) > 2 * len(u2)


def test_remat_equals_no_remat(tokens):
    cfg = small()
    plain = Llama(cfg, rngs=nnx.Rngs(4))
    remat = Llama(cfg.replace(remat=True), rngs=nnx.Rngs(4))
    (lp, gp), (lr, gr) = _loss_and_grads(plain, tokens), _loss_and_grads(remat, tokens)
    assert abs(float(lp) - float(lr)) <= 1e-6
    assert max(jax.tree.leaves(jax.tree.map(max_abs, gp, gr))) <= 1e-6
    unrolled_remat = Llama(cfg.replace(remat=True, scan_layers=False), rngs=nnx.Rngs(4))
    lu, gu = _loss_and_grads(unrolled_remat, tokens)
    assert abs(float(lp) - float(lu)) <= 1e-6
    assert max(jax.tree.leaves(jax.tree.map(max_abs, gp, gu))) <= 1e-5


@pytest.mark.slow
def test_remat_keeping_quantized_residuals_equals_no_remat(tokens):
    # The packed residuals saved by the remat policy are those the forward made: the
    # gradients are bit for bit those without remat and with the default (full) remat.
    cfg = small(scan_layers=False)
    plain = Llama(cfg, rngs=nnx.Rngs(4))
    keep = Llama(cfg.replace(remat=True, remat_policy="quantized_residuals"), rngs=nnx.Rngs(4))
    full = Llama(cfg.replace(remat=True), rngs=nnx.Rngs(4))
    policy = policies.get("nvfp4")  # packs its residuals on every chip (mxjax.residuals)
    kw = {"policy": policy, "policy_key": jax.random.key(7)}
    lp, gp = _loss_and_grads(plain, tokens, **kw)
    for model in (keep, full):
        lr, gr = _loss_and_grads(model, tokens, **kw)
        assert float(lp) == float(lr)
        assert max(jax.tree.leaves(jax.tree.map(max_abs, gp, gr))) == 0.0
    with pytest.raises(ValueError, match="remat_policy must be one of"):
        small(remat_policy="dots")


def test_bf16_compute_runs_and_tracks_fp32(tokens):
    f32 = _fwd(Llama(small(), rngs=nnx.Rngs(5)), tokens)
    b16 = _fwd(Llama(small(dtype="bfloat16"), rngs=nnx.Rngs(5)), tokens)
    assert b16.dtype == jnp.float32 and b16.shape == (2, 12, 128)
    assert 0 < max_abs(f32, b16) < 0.05


def test_input_validation(tokens):
    model = Llama(small(max_seq_len=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens)
    with pytest.raises(ValueError, match="integer"):
        model(tokens[:, :4].astype(jnp.float32))
    with pytest.raises(TypeError, match="dot_general"):
        model(tokens[:, :4], policy="mxfp4_all")


# --------------------------------------------------------------------------- policy plumbing


def test_policy_needing_key_without_key_raises(tokens):
    model = Llama(small(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="policy_key"):
        model(tokens, policy=RecordingPolicy(needs_key=True))


@pytest.mark.parametrize("scan", [True, False])
def test_every_layer_and_projection_gets_its_own_key(tokens, scan):
    cfg = small(n_layers=3, scan_layers=scan)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    pol = RecordingPolicy()
    key = jax.random.key(42)
    out = _fwd(model, tokens, policy=pol, policy_key=key)
    jax.block_until_ready(out)
    jax.effects_barrier()
    assert len(pol.sink) == 7 * 3
    assert set(pol.sink) == expected_layer_keys(key, 3, range(7))
    # a policy without randomness gets no key and may be called without one
    pol2 = RecordingPolicy(needs_key=False)
    jax.block_until_ready(_fwd(model, tokens, policy=pol2))
    jax.effects_barrier()
    assert pol2.sink == [None] * 21


def test_quantize_attention_and_embed_head_route_through_policy(tokens):
    cfg = small(quantize_attention=True, quantize_embed_head=True)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    pol = RecordingPolicy()
    key = jax.random.key(1)
    jax.block_until_ready(_fwd(model, tokens, policy=pol, policy_key=key))
    jax.effects_barrier()
    f = jax.random.fold_in
    extra = {tuple(np.asarray(jax.random.key_data(f(f(key, 2), 0))).tolist()),
             tuple(np.asarray(jax.random.key_data(f(f(key, 3), 0))).tolist())}
    assert len(pol.sink) == 9 * 2 + 2
    assert set(pol.sink) == expected_layer_keys(key, 2, range(9)) | extra
    # with the flags on, the model still equals the no-policy model when the policy is exact
    base = _fwd(Llama(small(), rngs=nnx.Rngs(0)), tokens)
    assert max_abs(base, _fwd(model, tokens, policy=RecordingPolicy(needs_key=False))) <= 1e-5


def test_noise_depends_on_key(tokens):
    """Keys reach the GEMMs as traced values: a new key changes the output, the same key
    reproduces it, with one compilation. (Scan vs unrolled folding the same keys is
    covered by test_every_layer_and_projection_gets_its_own_key.)"""
    pol = RecordingPolicy(noise=1e-2)
    model = Llama(small(), rngs=nnx.Rngs(0))
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a = _fwd(model, tokens, policy=pol, policy_key=k1)
    b = _fwd(model, tokens, policy=pol, policy_key=k2)
    c = _fwd(model, tokens, policy=pol, policy_key=k1)
    assert max_abs(a, b) > 1e-3
    assert max_abs(a, c) == 0.0
