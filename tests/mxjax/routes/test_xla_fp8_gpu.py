"""The 'xla_fp8' backend on a CUDA GPU: what only a device checks. Run by bench/device/gpu.py.

* The one-pass Pallas quantizer, compiled by Triton for the GPU, writes mxjax.quantize's
  codes and scale bytes (value_dtype=float32: the GEMMs' f32 canonical values), row-wise
  and column-wise, with the paper's H16.
* The GEMM on the FP8 tensor cores (E5M2 x E4M3, the operands' exact carriers) is within
  docs/NUMERICS.md's device bound of the exact product of the quantized operands, like
  the ``fp8`` preset's; an operand past its carrier's window takes the emulation's result.
* A bf16 result is rounded once by the GEMM (cuBLAS writes bf16, then the exact
  2^(t_a + t_b)): within the device bound plus half a bf16 ulp of the exact product.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import policies
from mxjax.emulation import in_place
from mxjax.kernels import QuantSpec, fused_quantize
from mxjax.quantization import fake_quantize_with, quantize_with
from mxjax.routes import xla_fp8 as M
from tests.mxjax.emulation.test_fp8_units_gpu import U32, device_bound

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu",
                       reason="needs a CUDA GPU (bench/device/gpu.py runs these on a GPU)"),
]

RECIPE = dataclasses.replace(policies.get("mxfp4_all_h16").fprop, backend="xla_fp8")
SIGNS = mxjax.fixed_signs(0, 16)


def test_pallas_quantizer_on_the_gpu_writes_mxjax_quantize_bytes():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((512, 768)) * np.exp(rng.uniform(-8, 8, (512, 1))),
                    jnp.bfloat16)
    spec = QuantSpec(recipe=RECIPE.lhs, hadamard=16)
    row, col = jax.jit(lambda v: fused_quantize(v, row=spec, col=spec, row_signs=SIGNS,
                                                col_signs=SIGNS, value_dtype=jnp.float32))(x)
    x32 = x.astype(jnp.float32)
    for q, axis in ((row, 1), (col, 0)):
        want = jax.jit(lambda v, axis=axis: quantize_with(
            mxjax.hadamard(v, 16, axis=axis, signs=SIGNS), RECIPE.lhs, axis))(x32)
        np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(want.codes))
        np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(want.scales))


@pytest.mark.parametrize("k", [256, 4096])
def test_fp8_route_is_within_the_device_bound(k):
    rng = np.random.default_rng(k)
    a = rng.standard_normal((512, k)).astype(np.float32)
    b = (rng.standard_normal((k, 384)) * np.exp(rng.uniform(-3, 3, (1, 384)))).astype(np.float32)
    dims = (((1,), (0,)), ((), ()))
    c = jax.jit(lambda a, b: M.mx_gemm_fp8(a, b, dims, RECIPE, None, None, SIGNS))(
        jnp.asarray(a), jnp.asarray(b))
    aq, bq = _quantized(a), _quantized(b.T).T
    exact, mag = aq @ bq, np.abs(aq) @ np.abs(bq)
    err = np.abs(np.asarray(c, np.float64) - exact)
    ratio = float(np.max(err / mag))
    print(f"xla_fp8 K={k}: max |C - A_q B_q| / (|A_q| |B_q|) = {ratio:.3g} "
          f"(bound {device_bound(k):.3g}; f32 accumulation alone: {(k + 4) * U32:.3g})")
    assert np.all(err <= device_bound(k) * mag), ratio


@pytest.mark.parametrize("k", [256, 4096])
def test_bf16_result_is_rounded_once_on_the_gpu(k):
    rng = np.random.default_rng(k + 1)
    a = rng.standard_normal((512, k)).astype(np.float32)
    b = (rng.standard_normal((k, 384)) * np.exp(rng.uniform(-3, 3, (1, 384)))).astype(np.float32)
    dims = (((1,), (0,)), ((), ()))
    c = jax.jit(lambda a, b: M.mx_gemm_fp8(a, b, dims, RECIPE, None, None, SIGNS,
                                           out_dtype=jnp.bfloat16))(jnp.asarray(a), jnp.asarray(b))
    assert c.dtype == jnp.bfloat16
    aq, bq = _quantized(a), _quantized(b.T).T
    exact, mag = aq @ bq, np.abs(aq) @ np.abs(bq)
    err = np.abs(np.asarray(c, np.float64) - exact)
    # the f32 sum's device bound, then one rounding to bf16 (8 significant bits)
    bound = device_bound(k) * mag * (1 + 2.0**-8) + np.abs(exact) * 2.0**-8
    print(f"xla_fp8 bf16 result K={k}: max err / bound = {float(np.max(err / bound)):.3g}")
    assert np.all(err <= bound)


def test_past_the_window_the_route_is_the_emulation_on_the_gpu():
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((256, 512)), jnp.float32).at[0, :32].multiply(2.0**40)
    b = jnp.asarray(rng.standard_normal((512, 128)), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    route = jax.jit(lambda a, b: M.mx_gemm_fp8(a, b, dims, RECIPE, None, None, SIGNS))(a, b)
    emu = jax.jit(lambda a, b: in_place.mx_gemm(a, b, dims, RECIPE, None, None, SIGNS))(a, b)
    # Two programs may get different GEMM algorithms: equal up to f32 summation order.
    aq, bq = _quantized(a), _quantized(b.T).T
    mag = np.abs(aq) @ np.abs(bq)
    assert np.all(np.abs(np.asarray(route, np.float64) - np.asarray(emu, np.float64))
                  <= 2 * (512 + 4) * U32 * mag)


def _quantized(x) -> np.ndarray:
    """float64 values of x's rows rotated by H16 and quantized (the GEMM's operand)."""
    rot = jax.jit(lambda v: fake_quantize_with(mxjax.hadamard(v, 16, axis=-1, signs=SIGNS),
                                               RECIPE.lhs, -1))
    return np.asarray(rot(jnp.asarray(x, jnp.float32)), np.float64)
