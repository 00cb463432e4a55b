"""FP8 GEMMs on a CUDA GPU's FP8 tensor cores: what only a device can check. Run by
bench/device/gpu.py.

* The f8 operands the GPU form computes (the accelerator branch of the per-tensor
  division, f32 subnormals kept by the GPU) are the numpy / ml_dtypes reference bits.
* ``fp8``'s GEMM as the tensor cores run it is within docs/NUMERICS.md's device bound of
  the exact product of the quantized operands:
  ``|C - A_q B_q| <= (ceil(K / 32) * 2^-13 + (K + 4) * 2^-24) * (|A_q| |B_q|)``
  (the accumulation model: each 32-deep MMA step keeps about 14 significant bits,
  DeepSeek-V3, arXiv 2412.19437, section 3.3.2). The measured ratio is printed.
* ``mxfp8`` (Hopper: XLA's dequantize + f32 GEMM; Blackwell: cuDNN's block-scaled MMA)
  within the same bound.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxjax
from mxjax import policies
from mxjax.quantization import fake_quantize_with
from tests.mxjax.emulation.test_fp8_units import FP8, OPERAND_CASES, check_f8_operand_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu",
                       reason="needs a CUDA GPU (bench/device/gpu.py runs these on a GPU)"),
]

U32 = 2.0 ** -24


def device_bound(k: int) -> float:
    """docs/NUMERICS.md's bound factor for an FP8 tensor-core GEMM over K."""
    return math.ceil(k / 32) * 2.0 ** -13 + (k + 4) * U32


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
