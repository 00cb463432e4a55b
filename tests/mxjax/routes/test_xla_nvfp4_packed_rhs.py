"""'xla_nvfp4' with its rhs given quantized (a quantized residual), checked on this CPU machine.

* ``Route.packed_rhs_gemm`` is the route's GEMM of the primal bit for bit: the XLA form
  (what a CPU lowering takes) and the GPU form with the lhs by the one-pass kernel (Pallas
  interpreter), with and without the wgrad's H16, SR with its key, a contraction not last.
* ``Route.pack_rhs`` (a GPU's kernel: its tensor scale by one reduction, codes and scales
  by one read) is `mxjax.residuals`' canonical pack, MXArray for MXArray, K a multiple of
  16 but not of 32 included.
* Through `mxjax.dot_general`, the gradients under ``nvfp4@xla_nvfp4`` are those of the
  bf16 residuals, bit for bit, and X is saved as codes.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import policies
from mxjax.operands import rotation_signs, split_key
from mxjax.residuals import _canonical_pack, _PackSpec
from mxjax.routes import xla_nvfp4
from tests.mxjax.routes._packed_rhs_testutil import assert_packed_gradients_are_the_bf16_residuals

ROUTE = xla_nvfp4.ROUTE
_MM = (((1,), (0,)), ((), ()))


def _recipe(gemm):
    return getattr(policies.get("nvfp4@xla_nvfp4"), gemm)


def _ab(shape_a, shape_b, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape_a), jnp.bfloat16),
            jnp.asarray(rng.standard_normal(shape_b), jnp.float32))


def _both(a, b, dims, recipe, key, *, gpu):
    """(the route's GEMM of the primal, its packed-rhs GEMM), the rhs cast to bf16."""
    kw = {"dims": dims, "recipe": recipe, "key": key, "gemm_name": "dgrad",
          "operand_dtypes": (None, jnp.bfloat16)}
    if gpu:  # the GPU form, its kernel in the interpreter
        k_lhs, k_rhs, k_had = split_key(key if recipe.needs_key else None)
        signs = None if recipe.hadamard is None else rotation_signs(recipe.hadamard, k_had)
        want = xla_nvfp4.nvfp4_kernel_gemm(a, b, dims, recipe, k_lhs, k_rhs, signs,
                                           operand_dtypes=(None, jnp.bfloat16),
                                           interpret=True).reshape(a.shape[0], b.shape[1])
    else:
        want = ROUTE.gemm(a, b, platform="cpu", **kw)
    q = _canonical_pack(b, key if recipe.needs_key else None,
                        _PackSpec(dims, recipe, jnp.bfloat16))
    got = ROUTE.packed_rhs_gemm(a, q, b_shape=b.shape, platform="cpu", interpret=gpu, **kw)
    return want, got


@pytest.mark.parametrize("gemm,gpu", [("dgrad", False), ("wgrad", False),
                                      pytest.param("wgrad", True, marks=pytest.mark.slow),
                                      pytest.param("dgrad", True, marks=pytest.mark.slow)])
def test_the_packed_rhs_gemm_is_the_routes_gemm_bit_for_bit(gemm, gpu):
    # dgrad: SR lhs (dY), no Hadamard; wgrad: SR lhs, H16 on both (fixed signs).
    a, b = _ab((64, 96), (96, 48))
    want, got = jax.jit(_both, static_argnames=("dims", "recipe", "gpu"))(
        a, b, _MM, _recipe(gemm), jax.random.key(3), gpu=gpu)
    chex.assert_trees_all_equal(want, got)


def test_a_contraction_not_last():
    a, b = _ab((2, 40, 24), (40, 5, 6))
    dims = (((1,), (0,)), ((), ()))
    want, got = jax.jit(_both, static_argnames=("dims", "recipe", "gpu"))(
        a, b, dims, _recipe("wgrad"), jax.random.key(4), gpu=False)
    chex.assert_trees_all_equal(want, got)


@pytest.mark.slow
@pytest.mark.parametrize("shape,dims", [
    ((64, 96), (((1,), (1,)), ((), ()))), ((48, 40), (((0,), (0,)), ((), ())))])
def test_the_routes_kernel_pack_is_the_canonical_pack(shape, dims):
    # W-like f32 cast to bf16, contracted along either axis; 48 rows: K % 32 == 16.
    recipe = _recipe("wgrad")  # H16 with fixed signs, round to nearest even
    b = jnp.asarray(np.random.default_rng(5).standard_normal(shape), jnp.float32)
    got = jax.jit(lambda b: ROUTE.pack_rhs(b, dims=dims, recipe=recipe, key=None,
                                           operand_dtype=jnp.bfloat16, interpret=True))(b)
    want = jax.jit(lambda b: _canonical_pack(b, None, _PackSpec(dims, recipe,
                                                                 jnp.bfloat16)))(b)
    assert got is not None
    chex.assert_trees_all_equal(got, want)


def test_the_kernel_pack_declines_stochastic_rounding():
    recipe = _recipe("dgrad")
    sr = recipe.__class__(lhs=recipe.rhs.__class__(fmt=mxjax.NVFP4, rounding="stochastic"),
                          rhs=recipe.rhs.__class__(fmt=mxjax.NVFP4, rounding="stochastic"),
                          backend="xla_nvfp4")
    b = jnp.ones((64, 64), jnp.bfloat16)
    assert ROUTE.pack_rhs(b, dims=_MM, recipe=sr, key=jax.random.key(0),
                          interpret=True) is None


@pytest.mark.slow
def test_dot_generals_gradients_on_the_route_are_the_same_with_packed_residuals(monkeypatch):
    x, w = _ab((3, 37, 50), (50, 45))
    assert_packed_gradients_are_the_bf16_residuals(
        policies.get("nvfp4@xla_nvfp4"), x, w, (((2,), (0,)), ((), ())), jax.random.key(1),
        monkeypatch)
