"""'xla_mxfp8' with its rhs given quantized (a quantized residual), checked on this CPU machine.

* ``Route.packed_rhs_gemm`` is the route's GEMM of the primal bit for bit: the in-place XLA
  form (what a CPU lowering takes) and the GPU form with the lhs by the one-pass kernel
  (Pallas interpreter), dgrad- and wgrad-shaped, an f32 rhs cast to bf16, K not a multiple
  of 32, a contraction not last.
* ``Route.pack_rhs`` (a GPU's kernel, from the pair call the forward GEMM makes) is
  `mxjax.residuals`' canonical pack, MXArray for MXArray.
* Through `mxjax.dot_general`, the gradients under ``mxfp8@xla_mxfp8`` are those of the bf16
  residuals, bit for bit, and X is saved as f8 codes.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import policies
from mxjax.residuals import _canonical_pack, _PackSpec
from mxjax.routes import xla_mxfp8
from tests.mxjax.routes._packed_rhs_testutil import assert_packed_gradients_are_the_bf16_residuals

ROUTE = xla_mxfp8.ROUTE
_MM = (((1,), (0,)), ((), ()))
RECIPE = policies.get("mxfp8@xla_mxfp8").dgrad  # E4M3, RCEIL, no Hadamard


def _ab(shape_a, shape_b, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape_a), jnp.bfloat16),
            jnp.asarray(rng.standard_normal(shape_b) * 3.0, jnp.float32))


def _both(a, b, dims, recipe, *, gpu):
    """(the route's GEMM of the primal, its packed-rhs GEMM), the rhs cast to bf16."""
    kw = {"dims": dims, "recipe": recipe, "key": None, "gemm_name": "dgrad",
          "operand_dtypes": (None, jnp.bfloat16), "out_dtype": jnp.float32}
    if gpu:  # the GPU form, its kernel in the interpreter
        from mxjax.routes.spec import in_place_route_gemm

        want = in_place_route_gemm(
            lambda *args, **k: xla_mxfp8.mxfp8_gemm(*args, kernel=True, interpret=True, **k),
            a, b, dims=dims, recipe=recipe, key=None, operand_dtypes=(None, jnp.bfloat16),
            out_dtype=jnp.float32)
    else:
        want = ROUTE.gemm(a, b, platform="cpu", **kw)
    q = _canonical_pack(b, None, _PackSpec(dims, recipe, jnp.bfloat16))
    got = ROUTE.packed_rhs_gemm(a, q, b_shape=b.shape, platform="cpu", interpret=gpu, **kw)
    return want, got


# The GPU forms (the Pallas interpreter, ~10 s each on 2 cores) under make test-slow.
@pytest.mark.parametrize("shape_a,shape_b,gpu", [
    ((64, 96), (96, 48), False),        # dgrad-like: dY [M, N] . W^T
    pytest.param((40, 100), (100, 64), True, marks=pytest.mark.slow),  # K = 100: padded
    pytest.param((64, 96), (96, 48), True, marks=pytest.mark.slow)])
def test_the_packed_rhs_gemm_is_the_routes_gemm_bit_for_bit(shape_a, shape_b, gpu):
    a, b = _ab(shape_a, shape_b)
    want, got = jax.jit(_both, static_argnames=("dims", "recipe", "gpu"))(
        a, b, _MM, RECIPE, gpu=gpu)
    assert np.isfinite(np.asarray(want)).all()
    chex.assert_trees_all_equal(want, got)


def test_a_contraction_not_last():
    a, b = _ab((2, 40, 24), (40, 5, 6))
    want, got = jax.jit(_both, static_argnames=("dims", "recipe", "gpu"))(
        a, b, (((1,), (0,)), ((), ())), RECIPE, gpu=False)
    chex.assert_trees_all_equal(want, got)


@pytest.mark.parametrize("shape,dims", [  # make test-slow: the Pallas interpreter
    pytest.param((64, 96), (((1,), (1,)), ((), ())), marks=pytest.mark.slow),  # pair
    pytest.param((48, 40), (((0,), (0,)), ((), ())), marks=pytest.mark.slow)])  # one axis
def test_the_routes_kernel_pack_is_the_canonical_pack(shape, dims):
    b = jnp.asarray(np.random.default_rng(5).standard_normal(shape) * 3.0, jnp.float32)
    got = jax.jit(lambda b: ROUTE.pack_rhs(b, dims=dims, recipe=RECIPE, key=None,
                                           operand_dtype=jnp.bfloat16, interpret=True))(b)
    want = jax.jit(lambda b: _canonical_pack(b, None, _PackSpec(dims, RECIPE,
                                                                 jnp.bfloat16)))(b)
    assert got is not None
    chex.assert_trees_all_equal(got, want)


def test_the_kernel_pack_declines_stochastic_rounding():
    sr_op = mxjax.OperandRecipe(fmt=mxjax.MXFP8_E4M3, rounding="stochastic")
    sr = RECIPE.__class__(lhs=sr_op, rhs=sr_op, backend="xla_mxfp8")
    b = jnp.ones((64, 64), jnp.bfloat16)
    assert ROUTE.pack_rhs(b, dims=_MM, recipe=sr, key=jax.random.key(0),
                          interpret=True) is None
    with pytest.raises(ValueError, match="q: expected an MXFP8 MXArray"):
        xla_mxfp8.packed_operand(mxjax.quantize(jnp.ones((4, 32)), mxjax.MXFP4, axis=1))


def test_dot_generals_gradients_on_the_route_are_the_same_with_packed_residuals(monkeypatch):
    x, w = _ab((3, 37, 50), (50, 45))
    assert_packed_gradients_are_the_bf16_residuals(
        policies.get("mxfp8@xla_mxfp8"), x, w, (((2,), (0,)), ((), ())), None, monkeypatch)
