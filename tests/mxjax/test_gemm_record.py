"""The interceptor's GEMM records (mxjax.gemm_record.GemmRecord) for observers.

Every field is checked against something computed here independently: the
canonical operands against numpy transposes, the keys against jax.random.split
in the documented order, the backward dimension numbers against JAX's own
gradient of lax.dot_general, the quantizer inputs against mxjax.hadamard, and
``run`` against quantize -> dequantize -> dot of those inputs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mxjax
from mxjax import interceptor as DG
from mxjax import policies
from mxjax.dimensions import Dims
from mxjax.formats import BF16
from mxjax.gemm_record import GemmKeys, GemmRecord
from mxjax.quantization import dequantize, quantize_with
from mxjax.recipes import GemmRecipe, Hadamard, OperandRecipe

# (lhs shape, rhs shape, dims): batched with two contracting dims and a
# non-trailing contraction on the rhs; K = 6 * 10 = 60 (not a multiple of 32).
CASE = ((2, 5, 6, 10), (2, 10, 7, 6), (((2, 3), (3, 1)), ((0,), (0,))))


def _records(policy):
    """(records' arrays by name, key, (x, w, g), y, (dx, dw)) of one jitted call of `policy`."""
    lshape, rshape, dims = CASE
    x = jax.random.normal(jax.random.key(0), lshape, jnp.float32)
    w = jax.random.normal(jax.random.key(1), rshape, jnp.float32)
    key = jax.random.key(5)
    out_shape = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dims), x, w).shape
    g = jax.random.normal(jax.random.key(2), out_shape, jnp.float32)
    seen: dict[str, dict] = {}

    def on_gemm(r: GemmRecord):
        assert r.name not in seen, "each GEMM is recorded once"
        pt = GemmRecipe(lhs=BF16, rhs=BF16)
        seen[r.name] = {"record": r, "a": r.operands[0], "b": r.operands[1], "out": r.out,
                        "run": r.run(), "run_pt": r.run(pt), "qa": r.quantizer_inputs()[0],
                        "qb": r.quantizer_inputs()[1], "keys": r.keys,
                        "signs": r.hadamard_signs(), "out_c": r.out_canonical}

    def hook(call):
        return call(call.lhs, call.rhs, call.key, on_gemm=on_gemm)

    def f(x, w, g, key):
        with DG.observe(hook):
            y, vjp = jax.vjp(lambda a, b: mxjax.dot_general(a, b, dims, policy=policy, key=key),
                             x, w)
            return y, vjp(g)

    # The arrays leave the trace as outputs (records live at trace time only).
    def traced(x, w, g, key):
        seen.clear()
        y, cts = f(x, w, g, key)
        arrays = {n: {k: v for k, v in d.items() if k != "record"} for n, d in seen.items()}
        return y, cts, arrays

    y, cts, arrays = jax.jit(traced)(x, w, g, key)
    for n in arrays:
        arrays[n]["record"] = seen[n]["record"]
    return arrays, key, (x, w, g), y, cts


def _np_canonical(a, batch, contract):
    free = [i for i in range(a.ndim) if i not in set(batch) | set(contract)]
    t = np.transpose(np.asarray(a), tuple(batch) + tuple(free) + tuple(contract))
    nb = len(batch)
    return t.reshape(t.shape[:nb] + (math.prod(t.shape[nb:nb + len(free)]), -1))


def _rotated(canon, signs):
    """K zero-padded to 16, then mxjax.hadamard (the rotation the quantizer sees)."""
    pad = (-canon.shape[-1]) % 16
    padded = jnp.pad(canon, [(0, 0)] * (canon.ndim - 1) + [(0, pad)])
    return mxjax.hadamard(padded, 16, axis=-1, signs=signs)


def _quantized_dot(qa, qb, recipe, k_lhs, k_rhs):
    """quantize -> dequantize -> dot at HIGHEST (the CPU form of the emulated GEMM)."""
    a = dequantize(quantize_with(qa, recipe.lhs, -1, key=k_lhs))
    b = dequantize(quantize_with(qb, recipe.rhs, -1, key=k_rhs))
    nb = a.ndim - 2
    return lax.dot_general(a, b, (((nb + 1,), (nb + 1,)), (tuple(range(nb)),) * 2),
                           precision=lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnums=(0,))
def _expected(policy, key, x, w, g, canon):
    """Everything the records should hold, computed independently (one compile)."""
    out = {}
    for name, gk in zip(("fprop", "dgrad", "wgrad"), jax.random.split(key, 3), strict=True):
        keys = jax.random.split(gk, 3)
        signs = mxjax.random_signs(keys[2], 16)
        qa, qb = _rotated(canon[name][0], signs), _rotated(canon[name][1], signs)
        recipe = getattr(policy, name)
        out[name] = {"keys": jax.random.key_data(keys), "signs": signs, "qa": qa, "qb": qb,
                     "run": _quantized_dot(qa, qb, recipe, keys[0], keys[1])}
    _, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, CASE[2], precision=lax.Precision.HIGHEST),
                     x, w)
    out["dgrad"]["exact"], out["wgrad"]["exact"] = vjp(g)
    return out


@pytest.mark.slow
def test_records_of_the_three_gemms():
    policy = policies.get("mxfp4_all_rht16")  # randomized H16: every key is used
    recs, key, (x, w, g), y, (dx, dw) = _records(policy)
    assert sorted(recs) == ["dgrad", "fprop", "wgrad"]
    operands = {"fprop": (x, w), "dgrad": (g, w), "wgrad": (g, x)}
    canon = {}
    for name, (lhs, rhs) in operands.items():
        r = recs[name]["record"]
        assert r.recipe == getattr(policy, name) and r.call_dims == Dims(*CASE[2])
        # canonical operands, from numpy transposes of this GEMM's operands
        (ca, cb), (ba, bb) = r.dims
        canon[name] = (_np_canonical(lhs, ba, ca), _np_canonical(rhs, bb, cb))
        np.testing.assert_array_equal(np.asarray(recs[name]["a"]), canon[name][0])
        np.testing.assert_array_equal(np.asarray(recs[name]["b"]), canon[name][1])
    want = _expected(policy, key, x, w, g, canon)
    for name, d in recs.items():
        e = want[name]
        # keys: the call's key split (fprop, dgrad, wgrad), each split (lhs, rhs, signs)
        assert isinstance(d["keys"], GemmKeys)
        np.testing.assert_array_equal(np.stack([jax.random.key_data(k) for k in d["keys"]]),
                                      np.asarray(e["keys"]))
        # the rotation the quantizer sees: K zero-padded to 16, then mxjax.hadamard
        for field in ("signs", "qa", "qb", "run"):  # run: bit for bit, the CPU form
            np.testing.assert_array_equal(np.asarray(d[field]), np.asarray(e[field]))
        np.testing.assert_array_equal(np.asarray(d["run"]), np.asarray(d["out_c"]))
    # out is the result the interceptor returned (forward) or transposed (backward)
    np.testing.assert_array_equal(np.asarray(recs["fprop"]["out"]), np.asarray(y))
    for name, ct in (("dgrad", dx), ("wgrad", dw)):
        perm = recs[name]["record"].out_perm
        np.testing.assert_array_equal(np.transpose(np.asarray(recs[name]["out"]), perm),
                                      np.asarray(ct))
        # The backward dims and out_perm, against JAX's own gradient of lax.dot_general:
        # the pass-through variant on the same operands is the exact cotangent.
        got = np.transpose(np.asarray(recs[name]["run_pt"]).reshape(recs[name]["out"].shape),
                           perm)
        np.testing.assert_allclose(got, np.asarray(want[name]["exact"]), rtol=2e-6, atol=2e-5)


def test_pass_through_gemms_of_a_quantized_policy_are_recorded_too():
    recs, *_ = _records(policies.get("mxfp4_fprop"))
    for name in ("dgrad", "wgrad"):
        assert recs[name]["record"].recipe.is_passthrough
        # lax.dot_general of the canonical operands vs of the GEMM's own layout
        np.testing.assert_allclose(np.asarray(recs[name]["run"]),
                                   np.asarray(recs[name]["out_c"]), rtol=1e-5, atol=1e-5)


def test_records_outside_jit_and_without_a_key():
    """Eager (op by op, so a small 2-D call: square, so that each op compiles once for all
    six operands) and a policy that needs no key."""
    x = jnp.asarray(np.linspace(-2, 2, 32 * 32, dtype=np.float32).reshape(32, 32))
    w = jnp.asarray(np.linspace(1, -1, 32 * 32, dtype=np.float32).reshape(32, 32))
    seen = {}

    def hook(call):
        return call(call.lhs, call.rhs, call.key, on_gemm=lambda r: seen.setdefault(r.name, r))

    with DG.observe(hook):
        y, vjp = jax.vjp(lambda a, b: mxjax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                                        policy="mxfp4_all"), x, w)
        dx, _ = vjp(jnp.ones_like(y))
    assert sorted(seen) == ["dgrad", "fprop", "wgrad"]
    np.testing.assert_array_equal(np.asarray(seen["fprop"].out), np.asarray(y))
    np.testing.assert_array_equal(np.transpose(np.asarray(seen["dgrad"].out),
                                               seen["dgrad"].out_perm), np.asarray(dx))
    r = seen["fprop"]
    assert r.key is None and r.keys == GemmKeys(None, None, None)
    sr = GemmRecipe(lhs=OperandRecipe(fmt="mxfp4", rounding="stochastic"), rhs="mxfp4")
    with pytest.raises(ValueError, match="needs a PRNG key"):
        r.run(sr)
    with pytest.raises(TypeError, match="recipe: expected a GemmRecipe"):
        r.run("mxfp4")
    assert r.hadamard_signs() is None  # no Hadamard
    assert r.hadamard_signs(GemmRecipe(lhs="mxfp4", rhs="mxfp4",
                                       hadamard=Hadamard(block_size=32, seed=3))) is not None


def test_on_gemm_must_be_callable():
    pol = policies.get("mxfp4_all")
    x = jnp.ones((4, 32))

    def hook(call):
        return call(call.lhs, call.rhs, call.key, on_gemm="no")

    with DG.observe(hook), pytest.raises(TypeError, match="on_gemm: expected a callable"):
        mxjax.dot_general(x, x.T, (((1,), (0,)), ((), ())), policy=pol)
