"""train.study_probe: the mechanism probe's numbers, and the implementation check it rests on.

The central test (`test_h16_every_gemm_equals_an_independent_reference`) takes
every GEMM of a tiny Llama under the paper's recipe (``mxfp4_all_h16``) as the
model really runs it (every projection of every layer; fprop, dgrad and wgrad)
and rebuilds it from its unquantized operands with the numpy reference of
tests/reference.py (Sylvester rotation in float64, the reference MXFP4
quantizer, a float64 product). Agreement to fp32 accumulation error rules out an
implementation fault in the rotated GEMMs.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mxjax
from models.llama import Llama, LlamaConfig
from mxjax import diagnostics as D
from mxjax import policies
from mxjax.formats import MXFP4, ScaleRule
from mxjax.recipes import GemmRecipe, Hadamard, OperandRecipe
from study import probe as S
from study.probe import capture
from tests import reference as ref

U32 = 2.0 ** -24  # fp32 unit roundoff
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CFG = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192,
                  max_seq_len=64)


@pytest.fixture(scope="module")
def params():
    return nnx.to_pure_dict(nnx.state(Llama(CFG, rngs=nnx.Rngs(0)), nnx.Param))


def _batch(seed, b=4, t=32):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, (b, t + 1)).astype(np.int32)


@pytest.fixture(scope="module")
def h16_capture(params):
    """(loss, captures, grads) of one batch under mxfp4_all_h16 (one compile)."""
    pol = policies.get("mxfp4_all_h16")
    sink = capture.Sink()
    fn = capture.loss_and_grad(capture.probe_config(CFG), pol, sink)
    tokens = _batch(0)
    loss, caps = S.capture_gemms(CFG, params, tokens, pol, _fn=fn, _sink=sink)
    _, grads = fn(params, jnp.asarray(tokens), jax.random.key(0))
    return loss, caps, grads


# --------------------------------------------------------------------------- capture
@pytest.mark.slow
def test_capture_sees_every_projection_of_every_layer(h16_capture, params):
    loss, caps, grads = h16_capture
    want = {(f"L{i}.{p}", k) for i in range(CFG.n_layers) for p in PROJ
            for k in ("fprop", "dgrad", "wgrad")}
    assert {(c.label, c.kind) for c in caps} == want and len(caps) == len(want)
    assert math.isfinite(loss)
    for c in caps:
        layer, proj = int(c.label[1]), c.label.split(".")[1]
        w = np.asarray(params["layers"][proj]["kernel"][layer])  # [in, out]
        assert c.a.ndim == 2 and c.b.ndim == 2 and c.a.shape[1] == c.b.shape[1]
        assert c.out.shape == (c.a.shape[0], c.b.shape[0])
        if c.kind == "fprop":  # (X [tokens, in], W^T [out, in])
            np.testing.assert_array_equal(c.b, w.T)
        elif c.kind == "dgrad":  # (dY [tokens, out], W [in, out])
            np.testing.assert_array_equal(c.b, w)
        else:  # wgrad: (dY^T [out, tokens], X^T [in, tokens]); its output is the gradient^T
            assert c.a.shape[1] == 4 * 32
            g = np.asarray(grads["layers"][proj]["kernel"][layer])
            np.testing.assert_array_equal(c.out.T, g)
    # the three GEMMs of one call site share their operands
    by = {(c.label, c.kind): c for c in caps}
    for i in range(CFG.n_layers):
        for p in PROJ:
            f, d, w = (by[(f"L{i}.{p}", k)] for k in ("fprop", "dgrad", "wgrad"))
            np.testing.assert_array_equal(w.b, f.a.T)  # X
            np.testing.assert_array_equal(w.a, d.a.T)  # dY


def _ref_quantize(x32):
    """The paper's operand quantizer (MXFP4, EVEN scales, RNE) along the last axis, numpy."""
    return ref.fake_quantize(x32, "mxfp4", -1, scale_rule="even",
                             rounding="nearest_even").astype(np.float64)


def _pad16(x):
    pad = (-x.shape[-1]) % 16
    return np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), x.dtype)], -1) if pad else x


_lib_rotate = jax.jit(lambda x: mxjax.hadamard(x, 16, axis=-1))
_lib_fq = jax.jit(lambda x: mxjax.fake_quantize(x, MXFP4, -1, scale_rule=ScaleRule.EVEN))


@pytest.mark.slow
def test_h16_every_gemm_equals_an_independent_reference(h16_capture):
    """Every GEMM of the model under mxfp4_all_h16 equals Q(H a)·Q(H b)ᵀ built in numpy."""
    _, caps, _ = h16_capture
    flips = total = 0
    for c in caps:
        assert c.recipe.hadamard == Hadamard(block_size=16)
        assert c.lhs_key is None and c.rhs_key is None and c.signs is None
        a, b = (_pad16(np.asarray(x, np.float32)) for x in (c.a, c.b))
        k = a.shape[-1]
        ra64, rb64 = ref.hadamard(a, 16), ref.hadamard(b, 16)  # float64, dense Sylvester
        # 1. the library's fp32 rotation (the values the GEMM quantizes) is the float64
        #    rotation to a few fp32 ulps of each block
        ra, rb = np.asarray(_lib_rotate(a)), np.asarray(_lib_rotate(b))
        for r32, r64, x in ((ra, ra64, a), (rb, rb64, b)):
            blk = np.sqrt(np.sum(x.astype(np.float64).reshape(x.shape[0], -1, 16) ** 2, -1))
            bound = 8 * U32 * np.repeat(blk, 16, axis=-1)
            assert np.all(np.abs(r32 - r64) <= bound), c.label
        # 2. the quantizer on the model's real operands: bit for bit the numpy reference
        qa, qb = _ref_quantize(ra), _ref_quantize(rb)
        np.testing.assert_array_equal(np.asarray(_lib_fq(ra)), qa.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(_lib_fq(rb)), qb.astype(np.float32))
        # 3. the policy's GEMM output = float64 product of the reference operands, within
        #    the fp32 accumulation error bound (K terms): an operand element one grid step
        #    off, a missing rotation or a wrong block axis is orders of magnitude larger
        want = qa @ qb.T
        bound = k * U32 * (np.abs(qa) @ np.abs(qb).T) + 1e-30
        dev = np.abs(np.asarray(c.out, np.float64) - want)
        assert np.all(dev <= bound), (c.label, c.kind, float(np.max(dev / bound)))
        assert np.max(np.abs(want)) > 0
        # 4. quantizing the float64 rotation instead changes at most a rare element that
        #    sits on a rounding boundary within an ulp
        qa64 = _ref_quantize(ra64.astype(np.float32))
        flips += int(np.sum(qa64 != qa))
        total += qa.size
    assert flips <= 1e-4 * total, (flips, total)


def test_h16_rotation_only_gemms_equal_the_exact_product(h16_capture):
    """BF16 operands + the policy's H16 through mxjax's GEMM (the record's run of that
    variant on the same operands): the rotation cancels."""
    _, caps, _ = h16_capture
    for c in caps:
        a, b = np.asarray(c.a, np.float64), np.asarray(c.b, np.float64)
        got = np.asarray(c.rot_only, np.float64)
        k = _pad16(c.a).shape[-1]
        # rotation (a few ulp per block norm) + K-term fp32 accumulation, Cauchy-Schwarz
        bound = (k + 32) * U32 * np.outer(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1))
        assert np.all(np.abs(got - a @ b.T) <= bound + 1e-30), (c.label, c.kind)


def test_analyze_gemm_checks_can_fail(h16_capture):
    """The probe's own implementation checks: ~0 on the real GEMMs, large on a wrong one."""
    _, caps, _ = h16_capture
    for c in caps[:6]:
        res = S.analyze_gemm(c)
        assert res["ref32_dev"] <= 1e-6 and res["rot_only_dev"] <= 1e-5, (c.label, c.kind)
        # the float64-rotation route differs only by rare boundary elements
        assert res["ref_flips"] <= 1e-3 and res["ref_dev"] <= 0.05
    c = caps[0]
    plain = GemmRecipe(lhs=c.recipe.lhs, rhs=c.recipe.rhs)  # claims no rotation
    wrong = S.analyze_gemm(S.GemmCapture(label=c.label, kind=c.kind, a=c.a, b=c.b, out=c.out,
                                         recipe=plain))
    assert wrong["ref_dev"] > 1e-3
    assert wrong["ref32_dev"] is None  # no rotation claimed: no fp32-rotation route


# --------------------------------------------------------------------------- numbers
def _cap(a, b, out, recipe):
    return S.GemmCapture(label="t", kind="fprop", a=np.asarray(a, np.float32),
                         b=np.asarray(b, np.float32), out=np.asarray(out, np.float32),
                         recipe=recipe)


MX = OperandRecipe(fmt=MXFP4, scale_rule=ScaleRule.EVEN)


def test_output_fields_on_known_inputs():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 32)).astype(np.float32)
    b = rng.standard_normal((5, 32)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    for t in (0.25, -0.5):  # a shrunk (or grown) product: gain 1 - t, error along -exact
        res = S.analyze_gemm(_cap(a, b, (1 - t) * exact, GemmRecipe(lhs=MX, rhs=MX)),
                             impl_check=False)
        row = S.summarize_row(res["sums"], None)
        assert row["gain"] == pytest.approx(1 - t, rel=1e-6)
        assert row["rel_err"] == pytest.approx(abs(t), rel=1e-6)
        assert row["err_cos"] == pytest.approx(-np.sign(t), rel=1e-6)
        assert row["err_corr_batches"] is None
    e = rng.standard_normal((8, 5))
    f = rng.standard_normal((8, 5))
    assert S.summarize_row(res["sums"], S.error_correlation_sums([e, 2 * e]))[
        "err_corr_batches"] == pytest.approx(1.0)
    assert S.summarize_row(res["sums"], S.error_correlation_sums([e, -e]))[
        "err_corr_batches"] == pytest.approx(-1.0)
    want = np.sum(e * f) / math.sqrt(np.sum(e * e) * np.sum(f * f))
    assert S.summarize_row(res["sums"], S.error_correlation_sums([e, f]))[
        "err_corr_batches"] == pytest.approx(want)


def test_operand_fields_hand_computed():
    """x = [1, 0.05, 0...] under plain MXFP4 (EVEN): scale 2^-2, 0.05 -> 0 (flushed), 1 exact."""
    x = np.zeros((1, 32), np.float32)
    x[0, :2] = [1.0, 0.05]
    w = np.ones((1, 32), np.float32)
    res = S.analyze_gemm(_cap(x, w, [[1.0]], GemmRecipe(lhs=MX, rhs=MX)), impl_check=False)
    row = S.summarize_row(res["sums"], None)
    x64 = x.astype(np.float64)[0]
    d = np.zeros(32)
    d[1] = -np.float64(np.float32(0.05))
    n2 = np.sum(x64 ** 2)
    assert row["lhs_rel_err"] == pytest.approx(abs(d[1]) / math.sqrt(n2), rel=1e-9)
    assert row["lhs_flush"] == 0.5 and row["lhs_flushed_energy"] == pytest.approx(d[1] ** 2 / n2)
    m = x64[:16].mean()
    assert row["lhs_common_share"] == pytest.approx(16 * m ** 2 / n2, rel=1e-9)
    dm = d[:16].mean()
    assert row["lhs_noncommon_err"] == pytest.approx(
        math.sqrt(np.sum(d ** 2) - 16 * dm ** 2) / math.sqrt(n2 - 16 * m ** 2), rel=1e-9)
    assert row["lhs_common_err"] == pytest.approx(abs(dm) / abs(m), rel=1e-9)
    # w = ones: exactly representable, all common
    assert row["rhs_rel_err"] == 0.0 and row["rhs_common_share"] == pytest.approx(1.0)
    assert row["rhs_noncommon_err"] is None  # no non-common part
    assert row["gain"] == pytest.approx(1 / 1.05, rel=1e-6)


def test_h16_puts_a_constant_block_into_one_coefficient():
    """Constant 16-blocks rotate to one nonzero coefficient each; undoing the rotation
    gives back the operand's quantization in the original basis."""
    x = np.repeat(np.array([[0.3, -1.7, 2.0, 0.01]], np.float32), 16, axis=1)  # [1, 64]
    t = S.operand_treatment(x, MX, Hadamard(block_size=16), None)
    rot = t["rot"].reshape(4, 16)
    np.testing.assert_allclose(rot[:, 0], 4 * x[0, ::16], rtol=1e-12)
    assert np.all(rot[:, 1:] == 0)
    np.testing.assert_allclose(t["eff"], (t["q"].reshape(4, 16) @ S.sylvester(16) / 4)
                               .reshape(1, 64), rtol=1e-12)
    assert float(D.block_mean_share(jnp.asarray(x))) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_array_equal(S.sylvester(16), ref.sylvester(16))


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow  # ~25-50 s: compiles the instrumented step for two policies
def test_mechanism_probe_end_to_end(params):
    """Same batch twice: a deterministic policy's error repeats exactly (err_corr 1);
    a randomized one's does not. Every check is at rounding level; common_share is
    mxjax.diagnostics.block_mean_share of the captured operands."""
    tokens = _batch(1)
    pols = {"h16": policies.get("mxfp4_all_h16"), "rht16": policies.get("mxfp4_all_rht16")}
    out = S.mechanism_probe(CFG, params, [tokens, tokens], pols)
    h16, rht = out["policies"]["h16"], out["policies"]["rht16"]
    assert h16["loss"][0] == h16["loss"][1]
    for kind in ("fprop", "dgrad", "wgrad"):
        assert h16["aggregate"][kind]["err_corr_batches"] == pytest.approx(1.0, abs=1e-9)
        assert rht["aggregate"][kind]["err_corr_batches"] < 0.5
        for p in (h16, rht):
            row = p["aggregate"][kind]
            assert 0.01 < row["rel_err"] < 0.5 and 0.8 < row["gain"] < 1.2
            assert 0.0 <= row["lhs_common_share"] <= 1.0 and 0.0 <= row["lhs_flush"] <= 1.0
    for p in (h16, rht):
        assert p["impl_check"]["max_ref32_dev"] <= 1e-6
        assert p["impl_check"]["max_ref_flips"] <= 1e-3 and p["impl_check"]["max_ref_dev"] < 0.05
        assert p["impl_check"]["max_rot_only_dev"] <= 1e-5
        assert len(p["per_gemm"]) == CFG.n_layers * len(PROJ)
    # common_share per call site = block_mean_share of the captured operand
    _, caps = S.capture_gemms(CFG, params, tokens, pols["h16"])
    c = next(c for c in caps if c.label == "L1.up_proj" and c.kind == "wgrad")
    want = float(D.block_mean_share(jnp.asarray(c.a), axis=-1, block=16))
    assert h16["per_gemm"]["L1.up_proj"]["wgrad"]["lhs_common_share"] == pytest.approx(
        want, rel=1e-4)
    json.dumps(out)  # JSON-able


def test_bad_input_is_named(params):
    with pytest.raises(ValueError, match="batches"):
        S.mechanism_probe(CFG, params, [], {"a": policies.get("mxfp4_all")})
    with pytest.raises(ValueError, match=r"batches\[1\]"):
        S.mechanism_probe(CFG, params, [_batch(0), _batch(0, t=16)],
                          {"a": policies.get("mxfp4_all")})
    with pytest.raises(TypeError, match="policies"):
        S.mechanism_probe(CFG, params, [_batch(0)], {"a": "mxfp4_all"})
    with pytest.raises(TypeError, match="model_config"):
        S.mechanism_probe({}, params, [_batch(0)], {"a": policies.get("mxfp4_all")})


def test_format_table_lists_every_policy_and_gemm():
    row = dict.fromkeys(("rel_err", "gain", "err_cos", "err_corr_batches"), 0.5)
    for side in ("lhs", "rhs"):
        row.update({f"{side}_{f}": 0.25 for f in ("rel_err", "common_share", "common_err",
                                                   "noncommon_err", "flush")})
    row["err_corr_batches"] = None
    probe = {"policies": {"a_long_policy_name": {"aggregate": {"fprop": row, "wgrad": row}}}}
    lines = S.format_table(probe).splitlines()
    assert len(lines) == 3 and lines[1].startswith("a_long_policy_name fprop")
    assert " - " in lines[2] and "0.2500" in lines[2]
