"""mxjax.diagnostics: hand-computed statistics and the probe mechanism (through the interceptor)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mxjax
from mxjax import diagnostics as D
from mxjax import policies
from mxjax.formats import Rounding, ScaleRule
from mxjax.recipes import GemmRecipe, OperandRecipe

F32 = jnp.float32


def _stats(x, fmt, axis=-1, **kw):
    """operand_stats of x quantized with these settings, as floats (one jitted call)."""
    key = kw.pop("key", None)

    @jax.jit
    def f(x, key):
        return D.operand_stats(x, mxjax.quantize(x, fmt, axis, key=key, **kw))

    return {k: float(v) for k, v in f(x, key).items()}


def _two_blocks():
    """Block 0 amax 7 (FLOOR scale 2^0), block 1 amax 1 (2^-2), block 2 all zero."""
    x = np.zeros((3, 32), np.float32)
    x[0, :5] = [7.0, 3.0, 0.25, 0.1, 5.5]
    x[1, :3] = [1.0, -0.5, 0.3]
    return x


# --------------------------------------------------------------------------- operand stats
def test_mxfp4_floor_hand_computed():
    # Block 0 (scale 1): 7 -> 6 (clipped), 3 -> 3, 0.25 -> 0 (tie to even), 0.1 -> 0, 5.5 -> 6
    # (rounded, not clipped). Block 1 (scale 1/4): 1, -0.5 exact, 0.3 -> 0.25.
    x = _two_blocks()
    s = _stats(jnp.asarray(x), mxjax.MXFP4)
    err2 = 1.0**2 + 0.25**2 + 0.1**2 + 0.5**2 + 0.05**2
    assert s["rel_err"] == pytest.approx(math.sqrt(err2 / float(np.sum(x.astype(np.float64) ** 2))),
                                         rel=1e-6)
    assert s["underflow"] == 2 / 8  # 0.25 and 0.1 of the 8 nonzeros
    assert s["saturation"] == 1 / 8  # only 7
    # scale exponents 0 and -2; the all-zero block is ignored
    assert (s["scale_log2_min"], s["scale_log2_max"]) == (-2.0, 0.0)
    assert s["scale_log2_mean"] == -1.0
    assert s["scale_log2_std"] == 1.0


def test_axis_and_padding_do_not_change_stats():
    x = _two_blocks()
    a = _stats(jnp.asarray(x), mxjax.MXFP4, axis=-1)
    b = _stats(jnp.asarray(x.T.copy()), mxjax.MXFP4, axis=0)
    c = _stats(jnp.asarray(x[:, :20]), mxjax.MXFP4)  # 20 columns: zero-padded to 32 inside
    assert b == pytest.approx(a, rel=1e-6)  # only the summation order differs
    assert c == pytest.approx(a, rel=1e-6)  # the dropped columns were zeros


def test_scale_rules_saturation():
    x = jnp.asarray(_two_blocks())
    # RCEIL: amax 7 = 1.75 * 4 > 1.5 * 4, scale 2^1 -> |y| <= 3.5: nothing clips.
    assert _stats(x, mxjax.MXFP4, scale_rule=ScaleRule.RCEIL)["saturation"] == 0.0
    # EVEN: m = 1.75 rounds up to 2 -> scale 2^1, no clipping either.
    assert _stats(x, mxjax.MXFP4, scale_rule=ScaleRule.EVEN)["saturation"] == 0.0
    # EVEN with amax 6.5 (m = 1.625 < 1.75): scale 1, 6.5 > 6 clips.
    y = x.at[0, 0].set(6.5)
    assert _stats(y, mxjax.MXFP4, scale_rule=ScaleRule.EVEN)["saturation"] == 1 / 8


def test_sr_prescale_moves_values_below_max():
    x = jnp.asarray(_two_blocks())
    s = _stats(x, mxjax.MXFP4, rounding=Rounding.STOCHASTIC, key=jax.random.key(0),
               sr_prescale=True)
    assert s["saturation"] == 0.0  # 7 * 3/4 = 5.25 < 6
    s = _stats(x, mxjax.MXFP4, rounding=Rounding.STOCHASTIC, key=jax.random.key(0))
    assert s["saturation"] == 1 / 8


def test_subnormal_input_counts_as_nonzero():
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 1.0
    x[0, 1] = np.float32(1e-40)  # fp32 subnormal; 2^-2 scale makes it far below 0.5
    s = _stats(jnp.asarray(x), mxjax.MXFP4)
    assert s["underflow"] == 0.5


def test_nvfp4_hand_computed():
    x = np.zeros((32,), np.float32)
    x[0], x[1] = 6.0, 0.001  # block 0: amax 6 -> E4M3 scale 448, d = 448 * 6/2688 = 1
    x[16] = 0.75  # block 1: 0.75 / 6 / t = 56 -> d = 56 * t = 1/8
    s = _stats(jnp.asarray(x), mxjax.NVFP4)
    assert s["underflow"] == pytest.approx(1 / 3)  # 0.001 of the 3 nonzeros
    assert s["saturation"] == 0.0
    assert s["scale_log2_max"] == pytest.approx(0.0, abs=1e-6)
    assert s["scale_log2_min"] == pytest.approx(-3.0, abs=1e-6)
    assert s["scale_log2_std"] == pytest.approx(1.5, abs=1e-6)


def test_fp8_per_tensor_hand_computed():
    x = jnp.asarray([7.0, 1e-9, 0.0, -3.5], F32)  # t = 7/448 = 2^-6; 1e-9/t far below 2^-9
    s = _stats(x, mxjax.FP8_E4M3)
    assert s["underflow"] == pytest.approx(1 / 3)
    assert s["saturation"] == 0.0
    assert (s["scale_log2_min"], s["scale_log2_max"], s["scale_log2_std"]) == (-6.0, -6.0, 0.0)
    assert s["rel_err"] == pytest.approx(1e-9 / math.sqrt(49 + 12.25), rel=1e-3)


def test_nan_is_never_hidden_and_zeros_give_zeros():
    x = jnp.asarray(_two_blocks()).at[1, 5].set(jnp.nan)
    s = _stats(x, mxjax.MXFP4)
    assert math.isnan(s["rel_err"]) and math.isnan(s["scale_log2_max"])
    z = _stats(jnp.zeros((2, 32), F32), mxjax.MXFP4)
    assert z == {k: 0.0 for k in D.OPERAND_STATS}


def test_operand_stats_validates():
    x = jnp.ones((2, 32), F32)
    with pytest.raises(TypeError, match="q: expected an MXArray"):
        D.operand_stats(x, x)
    with pytest.raises(ValueError, match="x: shape"):
        D.operand_stats(jnp.ones((2, 31), F32), mxjax.quantize(x, mxjax.MXFP4))


def test_cosine_and_gemm_row():
    assert float(D.cosine_similarity(jnp.asarray([1.0, 0.0]), jnp.asarray([1.0, 1.0]))) == \
        pytest.approx(1 / math.sqrt(2))
    assert float(D.cosine_similarity(jnp.zeros(3), jnp.zeros(3))) == 1.0
    assert float(D.cosine_similarity(jnp.zeros(3), jnp.ones(3))) == 0.0
    x = jnp.asarray(_two_blocks())
    recipe = GemmRecipe(lhs=OperandRecipe(fmt="mxfp4"), rhs=OperandRecipe(fmt="bf16"))
    row = jax.jit(functools.partial(D.gemm_stats, lhs_recipe=recipe.lhs, rhs_recipe=recipe.rhs))(
        lhs=x, rhs=x)
    assert row.shape == (D.N_GEMM_FIELDS,)
    f = dict(zip(D.GEMM_FIELDS, np.asarray(row).tolist()))
    xq = np.asarray(mxjax.fake_quantize(x, "mxfp4"), np.float64)
    xe = np.asarray(x, np.float64)
    a, b = (xq @ xe.T).ravel(), (xe @ xe.T).ravel()
    assert f["cosine"] == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b), rel=1e-6)
    assert f["count"] == 1.0
    assert f["lhs_underflow"] == 0.25 and f["rhs_rel_err"] == 0.0  # bf16 passes through
    with pytest.raises(ValueError, match="batch"):
        D.gemm_stats(lhs=x, rhs=x[None], lhs_recipe=recipe.lhs, rhs_recipe=recipe.rhs)


# --------------------------------------------------------------------------- probe mechanism
def _record_recipe():
    return GemmRecipe(lhs=OperandRecipe(fmt="mxfp4"), rhs=OperandRecipe(fmt="mxfp4"))


def _qmm(x, w):
    return mxjax.fake_quantize(x, "mxfp4") @ mxjax.fake_quantize(w, "mxfp4", axis=0)


@jax.custom_vjp
def _toy_gemm(x, w):
    """A stand-in for a quantized GEMM backend: records fprop, dgrad and wgrad rows."""
    return _qmm(x, w)


def _toy_fwd(x, w):
    r = _record_recipe()
    y = _qmm(x, w)
    D.record_gemm("fprop", x, w.T, r, None, None)
    return y, (x, w)


def _toy_bwd(res, g):
    x, w = res
    r = _record_recipe()
    D.record_gemm("dgrad", g, w, r, None, None)
    D.record_gemm("wgrad", g.T, x.T, r, None, None)
    return g @ w.T, x.T @ g


_toy_gemm.defvjp(_toy_fwd, _toy_bwd)


def _toy_dot(x, w):
    slot = D.next_probe()
    if slot is None:
        return _toy_gemm(x, w)
    return D.probed_call(_toy_gemm, slot, x, w)


def _toy_loss(w, x):
    """Two layers through lax.scan (one traced call site) plus one outside it."""
    def body(h, wi):
        return jnp.tanh(_toy_dot(h, wi)), None

    h, _ = lax.scan(body, x, w)
    h = _toy_dot(h, w[0])
    return jnp.sum(h * h), {}


def test_probes_carry_stats_and_leave_gradients_unchanged():
    w = jax.random.normal(jax.random.key(0), (2, 32, 32), F32) * 0.2
    x = jax.random.normal(jax.random.key(1), (8, 32), F32)
    (l0, _), g0 = jax.jit(jax.value_and_grad(_toy_loss, has_aux=True))(w, x)
    vg = jax.jit(D.value_and_grad_with_stats(_toy_loss, D.DiagnosticsConfig(cosine=True)))
    (l1, aux), g1 = vg(w, x)
    assert float(l1) == float(l0)
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g0))
    stats = np.asarray(aux["gemm_stats"])
    assert stats.shape == (2, 3, D.N_GEMM_FIELDS)  # the scan body's call site + the last call
    count = D.GEMM_FIELDS.index("count")
    np.testing.assert_array_equal(stats[:, :, count], [[2, 2, 2], [1, 1, 1]])
    # The recorded fprop row of the last call equals the stats computed directly.
    @jax.jit
    def direct_stats(w, x):
        h = x
        for i in range(2):
            h = jnp.tanh(_qmm(h, w[i]))
        return D.quantized_operand_stats(h, OperandRecipe(fmt="mxfp4"), -1)

    direct = direct_stats(w, x)
    lhs = [D.GEMM_FIELDS.index(f"lhs_{s}") for s in D.OPERAND_STATS]
    np.testing.assert_allclose(stats[1, 0, lhs], np.asarray(direct), rtol=1e-5, atol=1e-7)
    cos = stats[1, 0, D.GEMM_FIELDS.index("cosine")]
    assert 0.9 < cos < 1.0
    s = D.summarize_probes(stats, ["scanned", "last"])
    assert set(s["per_slot"]) == {"scanned", "last"}
    assert s["per_slot"]["scanned"]["wgrad"]["count"] == 2.0
    assert 0 < s["flat"]["wgrad/lhs_rel_err"] < 1


def test_probes_off_adds_nothing_and_count_slots():
    w = jnp.ones((2, 32, 32), F32)
    x = jnp.ones((4, 32), F32)
    jaxpr_off = str(jax.make_jaxpr(jax.grad(lambda w: _toy_loss(w, x)[0]))(w))
    jax.make_jaxpr(D.value_and_grad_with_stats(_toy_loss))(w, x)  # tracing with probes ...
    assert str(jax.make_jaxpr(jax.grad(lambda w: _toy_loss(w, x)[0]))(w)) == jaxpr_off
    assert D.count_slots(lambda w: _toy_loss(w, x), w) == 2
    assert D.next_probe() is None  # ... leaves no recorder behind
    with pytest.raises(RuntimeError, match="more quantized GEMMs"):
        D.instrument(lambda w: _toy_loss(w, x))(D.init_probes(1), w)


def test_probes_shape_is_checked():
    with pytest.raises(ValueError, match="probes: expected shape"), D.collect(jnp.zeros((2, 3))):
        pass


# --------------------------------------------------------------------------- the interceptor
def _dn():
    return (((1,), (0,)), ((), ()))


# mxfp4_all: every GEMM quantized; tseng: a pass-through fprop, and keys (SR, random H64)
@pytest.mark.parametrize("name", ["mxfp4_all", pytest.param("tseng", marks=pytest.mark.slow)])
def test_interceptor_records_every_gemm(name):
    """Two layers under lax.scan with a key folded per layer inside the body (as the model does)."""
    pol = policies.get(name)
    x = jax.random.normal(jax.random.key(0), (64, 64), F32)
    w = jax.random.normal(jax.random.key(1), (2, 64, 64), F32) * 0.1

    def loss(params, x):
        def body(h, xs):
            wi, i = xs
            k = jax.random.fold_in(jax.random.key(3), i)
            return jnp.tanh(mxjax.dot_general(h, wi, _dn(), policy=pol, key=k)), None

        h, _ = lax.scan(body, x, (params, jnp.arange(2)))
        return jnp.sum(h), {}

    (l0, _), g0 = jax.jit(jax.value_and_grad(loss, has_aux=True))(w, x)
    (l1, aux), g1 = jax.jit(D.value_and_grad_with_stats(loss))(w, x)
    assert float(l0) == float(l1)
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))
    stats = np.asarray(aux["gemm_stats"])
    assert stats.shape == (1, 3, D.N_GEMM_FIELDS), "is mxjax.dot_general wired to diagnostics?"
    counts = stats[0, :, D.GEMM_FIELDS.index("count")]
    want = [0.0 if pol.fprop.is_passthrough else 2.0, 2.0, 2.0]  # one call site, two layers
    np.testing.assert_array_equal(counts, want)
    summary = D.summarize_probes(stats)["per_gemm"]
    for g in ("dgrad", "wgrad"):
        assert 0.0 < summary[g]["lhs_rel_err"] < 0.5
        assert 0.9 < summary[g]["cosine"] <= 1.0


@pytest.mark.slow  # ~30 s on 2 free cores: two compilations of a quantized Llama step
def test_llama_scan_stats_and_unchanged_loss():
    from flax import nnx

    from models.llama import Llama, LlamaConfig

    cfg = LlamaConfig.tiny(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=2,
                           ffn_dim=64, max_seq_len=16, scan_layers=True)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    pol = policies.get("mxfp4_all")
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 64)

    def loss(p, tokens):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1], policy=pol)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
        return jnp.mean(ce), {}

    (l0, _), g0 = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, tokens)
    (l1, aux), g1 = jax.jit(D.value_and_grad_with_stats(loss))(params, tokens)
    assert float(l0) == float(l1)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), g0, g1)
    stats = np.asarray(aux["gemm_stats"])
    assert stats.shape[0] == 7  # q, k, v, o, gate, up, down: one call site each under scan
    np.testing.assert_array_equal(stats[:, :, D.GEMM_FIELDS.index("count")], 2.0)


def test_summarize_probes_without_quantized_call_sites():
    """A pass-through policy (bf16) yields an empty probe array: an empty summary, not an error."""
    for empty in (np.zeros((0,)), np.zeros((0, 3, D.N_GEMM_FIELDS))):
        s = D.summarize_probes(empty, [])
        assert s == {"per_slot": {}, "per_gemm": {}, "flat": {}}


# --------------------------------------------------------------------------- block_mean_share
def _np_block_mean_share(x, axis, block):
    """numpy float64: zero-pad along axis to a multiple of block, energy of block means."""
    xm = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    pad = (-xm.shape[-1]) % block
    xm = np.concatenate([xm, np.zeros(xm.shape[:-1] + (pad,))], axis=-1)
    xb = xm.reshape(xm.shape[:-1] + (-1, block))
    common = np.sum(block * np.mean(xb, axis=-1) ** 2)
    total = np.sum(xb ** 2)
    return 0.0 if total == 0 else common / total


@pytest.mark.parametrize("shape,axis,block", [((3, 48), -1, 16), ((5, 40), -1, 16),
                                              ((37, 4), 0, 16), ((2, 3, 7), 1, 16),
                                              ((4, 96), -1, 32), ((6, 10), 1, 3)])
def test_block_mean_share_matches_numpy(shape, axis, block):
    rng = np.random.default_rng(sum(shape) + block)
    f = jax.jit(D.block_mean_share, static_argnames=("axis", "block"))
    for offset in (0.0, 1.5):  # zero-mean and strongly common inputs
        x = (rng.standard_normal(shape) + offset).astype(np.float32)
        got = float(f(jnp.asarray(x), axis=axis, block=block))
        assert got == pytest.approx(_np_block_mean_share(x, axis, block), rel=2e-6, abs=1e-7)


def test_block_mean_share_extremes():
    f = D.block_mean_share
    assert float(f(jnp.zeros((4, 32)))) == 0.0  # all zero: 0, not NaN
    assert float(f(jnp.full((4, 32), -3.0))) == pytest.approx(1.0, rel=1e-6)  # constant blocks
    # a Hadamard row other than the first has zero block mean
    alt = np.tile(np.array([1.0, -1.0], np.float32), 16)[None]
    assert float(f(jnp.asarray(alt))) == 0.0
    # 20 ones: one full block (share 16) + a padded one holding 4 ones (4^2 / 16 = 1)
    assert float(f(jnp.ones((20,)))) == pytest.approx(17 / 20, rel=1e-6)
    assert np.isnan(float(f(jnp.asarray([1.0, np.nan]))))
    with pytest.raises(ValueError, match="block"):
        f(jnp.ones((4,)), block=0)
    with pytest.raises(ValueError, match="axis"):
        f(jnp.ones((4,)), axis=1)
