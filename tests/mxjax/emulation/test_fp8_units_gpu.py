"""FP8 GEMMs on a CUDA GPU's FP8 tensor cores: what only a device can check. Run by
bench/device/gpu.py.

* The f8 operands the GPU form computes (the accelerator branch of the per-tensor
  division, f32 subnormals kept by the GPU) are the numpy / ml_dtypes reference bits.
* ``fp8``'s forward GEMM as the tensor cores run it (fast accumulation: precision DEFAULT,
  mxjax.emulation.f8_accumulation) is within docs/NUMERICS.md's device bound of the exact
  product of the quantized operands, ``|C - A_q B_q| <= b * (|A_q| |B_q|)`` with
  ``b = accumulation_bound(K, fast=True, subnormal_bits=6)`` (the Hopper tensor-core model
  of tests/mxjax/emulation/fp8_mma_model.py). The measured ratio is printed.
* ``mxfp8`` (Hopper: XLA's dequantize + f32 GEMM; Blackwell: cuDNN's block-scaled MMA)
  within the same bound.
* The GEMM settings: an 8192^3 FP8 GEMM (E4M3 x E4M3, E5M2 x E4M3) timed at precision
  DEFAULT and HIGHEST under XLA's default GEMM path (autotuned: Triton or cuBLAS) and under
  cuBLAS alone (``xla_gpu_enable_triton_gemm=false``), TFLOP/s printed beside bf16's; the
  forward GEMM's setting (DEFAULT) must not be slower than HIGHEST under cuBLAS, and the
  promoted accumulation (HIGHEST, cuBLAS) must be more precise than the fast one.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import policies
from mxjax.emulation.f8_accumulation import accumulation_bound
from mxjax.quantization import fake_quantize_with
from tests.mxjax.emulation.test_fp8_units import FP8, OPERAND_CASES, check_f8_operand_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu",
                       reason="needs a CUDA GPU (bench/device/gpu.py runs these on a GPU)"),
]

U32 = 2.0 ** -24


def device_bound(k: int) -> float:
    """docs/NUMERICS.md's bound factor for an FP8 tensor-core GEMM over K (fast accumulation,
    subnormals in both E4M3 operands allowed)."""
    return accumulation_bound(k, fast=True, subnormal_bits=6)


@pytest.mark.parametrize("name", sorted(FP8))
@pytest.mark.parametrize("case", OPERAND_CASES)
def test_f8_operands_on_the_gpu_are_the_reference_bits(name, case):
    check_f8_operand_bits(name, case)  # the same checks, here on the GPU


@pytest.mark.parametrize("name", ["fp8", "mxfp8"])
@pytest.mark.parametrize("k", [256, 4096])
def test_tensor_core_gemm_is_within_the_device_bound(name, k):
    rng = np.random.default_rng(k)
    a = rng.standard_normal((512, k)).astype(np.float32)
    b = (rng.standard_normal((k, 384)) * np.exp(rng.uniform(-3, 3, (1, 384)))).astype(np.float32)
    policy = policies.get(name)
    c = jax.jit(lambda a, b: mxjax.dot_general(
        a, b, (((1,), (0,)), ((), ())), policy=policy, preferred_element_type=jnp.float32))(
        jnp.asarray(a), jnp.asarray(b))
    recipe = policy.fprop
    aq = np.asarray(jax.jit(lambda x: fake_quantize_with(x, recipe.lhs, -1))(jnp.asarray(a)),
                    np.float64)
    bq = np.asarray(jax.jit(lambda x: fake_quantize_with(x, recipe.rhs, -1))(jnp.asarray(b.T)),
                    np.float64).T
    exact = aq @ bq
    mag = np.abs(aq) @ np.abs(bq)
    err = np.abs(np.asarray(c, np.float64) - exact)
    ratio = float(np.max(err / mag))
    print(f"{name} K={k}: max |C - A_q B_q| / (|A_q| |B_q|) = {ratio:.3g} "
          f"(bound {device_bound(k):.3g}; f32 accumulation alone: {(k + 4) * U32:.3g})")
    assert np.all(err <= device_bound(k) * mag), ratio


GEMM_PATHS = {"default": {}, "cublas": {"xla_gpu_enable_triton_gemm": False}}
PRECISIONS = {"DEFAULT": jax.lax.Precision.DEFAULT, "HIGHEST": jax.lax.Precision.HIGHEST}


def _f8_gemm(precision, path: str, lhs_dtype, n: int):
    """The compiled ``dot(a, b) * ta * tb`` of f8 operands (fp8_units.f8_dot's pattern)."""
    def gemm(a, b, ta, tb):
        out = jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                                  preferred_element_type=jnp.float32)
        return out * ta * tb

    args = (jax.ShapeDtypeStruct((n, n), lhs_dtype),
            jax.ShapeDtypeStruct((n, n), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))
    return jax.jit(gemm).lower(*args).compile(GEMM_PATHS[path] or None)


def _tflops(fn, args, n: int, repeats: int = 20) -> float:
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - start) / repeats)
    return 2 * n ** 3 / best / 1e12


def test_fp8_gemm_settings_rates():
    """TFLOP/s of each setting at 8192^3 (printed; bench/gpu.py shows it with -s)."""
    n = 8192
    key_a, key_b = jax.random.split(jax.random.key(0))
    bf16 = (jax.random.normal(key_a, (n, n), jnp.bfloat16),
            jax.random.normal(key_b, (n, n), jnp.bfloat16))
    rates = {"bf16": _tflops(jax.jit(jnp.dot), bf16, n)}
    for lhs_name, lhs_dtype in (("e4m3", jnp.float8_e4m3fn), ("e5m2", jnp.float8_e5m2)):
        args = (bf16[0].astype(lhs_dtype), bf16[1].astype(jnp.float8_e4m3fn),
                jnp.float32(1.0), jnp.float32(1.0))
        for path in GEMM_PATHS:
            for pname, precision in PRECISIONS.items():
                fn = _f8_gemm(precision, path, lhs_dtype, n)
                rates[f"{lhs_name}xe4m3 {path} {pname}"] = _tflops(fn, args, n)
    for name, rate in rates.items():
        print(f"FP8 GEMM 8192^3 {name}: {rate:.0f} TFLOP/s ({rate / rates['bf16']:.2f}x bf16)")
    # The forward GEMM's setting is chosen for speed: it must not lose to HIGHEST (5% noise).
    assert rates["e4m3xe4m3 cublas DEFAULT"] >= 0.95 * rates["e4m3xe4m3 cublas HIGHEST"], rates


def test_promoted_accumulation_is_more_precise_than_fast():
    """cuBLAS at HIGHEST promotes every 128 elements; at DEFAULT (fast accumulation) it does
    not: a sum that swamps small products (fp8_mma_model's adversarial case: 32 large
    products, then 504s below the running sum's grid) loses more at DEFAULT on Hopper."""
    k, n = 4096, 128
    a = np.full((n, k), 1.125, np.float32)
    a[:, :32] = 448.0
    b = np.full((k, n), 448.0, np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    a8, b8 = jnp.asarray(a, jnp.float8_e4m3fn), jnp.asarray(b, jnp.float8_e4m3fn)
    errors = {}
    for pname, precision in PRECISIONS.items():
        def gemm(a, b, p=precision):
            return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=p,
                                       preferred_element_type=jnp.float32)
        out = jax.jit(gemm).lower(a8, b8).compile(GEMM_PATHS["cublas"])(a8, b8)
        errors[pname] = float(np.max(np.abs(np.asarray(out, np.float64) - exact) / exact))
    print(f"swamping K={k}: relative error DEFAULT (fast) {errors['DEFAULT']:.3g}, "
          f"HIGHEST (promoted) {errors['HIGHEST']:.3g} on {jax.devices()[0].device_kind}")
    assert errors["DEFAULT"] <= accumulation_bound(k, fast=True), errors
    assert errors["HIGHEST"] <= accumulation_bound(k, fast=False), errors
    if jax.devices()[0].compute_capability.startswith("9."):  # Hopper: the modelled unit
        assert errors["HIGHEST"] < errors["DEFAULT"], errors
