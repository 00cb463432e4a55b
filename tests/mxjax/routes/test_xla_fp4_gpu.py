"""MXFP4 on NVFP4's block-scaled dot (mxjax/routes/xla_fp4.py) on a CUDA GPU.

What only a device can check: on Blackwell (B200) XLA runs the exact branch on cuDNN's
block-scaled FP4 MMA (``__cudnn$blockScaledDot``), whose scales include E4M3's
subnormals (2^-9 .. 2^-7) at the bottom of the window; on Hopper it expands the same
call into a dequantize and an f32 GEMM. Asserted: the branch taken is the MMA, and the
GEMM is within docs/NUMERICS.md's device bound of the exact product of the quantized
operands, ``|C - A_q B_q| <= b (|A_q| |B_q|)`` (``b``: test_fp8_units_gpu's ``device_bound``)
(a flushed subnormal scale would zero whole rows, far outside it). The measured ratio
is printed. Not yet in bench/device/gpu.py's list.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import mxjax
from mxjax.quantization import quantize_with
from mxjax.routes import xla_fp4
from tests.mxjax.emulation.test_fp8_units_gpu import U32, device_bound
from tests.mxjax.routes.test_xla_fp4 import MXFP4, RECIPE, _on_mma, full_window_operands

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu",
                       reason="needs a CUDA GPU (bench/device/gpu.py runs these on a GPU)"),
]

@pytest.mark.parametrize("k", [256, 4096])
@pytest.mark.parametrize("case", ["gaussian", "full_window"])
def test_fp4_block_scaled_dot_on_the_gpu_is_within_the_device_bound(k, case):
    if case == "full_window":
        a3, b3 = full_window_operands(k, rows=512, cols=384, seed=k)
    else:
        rng = np.random.default_rng(k)
        a3 = jax.numpy.asarray(rng.standard_normal((1, 512, k)), jax.numpy.float32)
        b3 = jax.numpy.asarray(rng.standard_normal((1, 384, k))
                               * np.exp(rng.uniform(-3, 3, (1, 384, 1))), jax.numpy.float32)
    assert _on_mma(a3, b3)
    fn = jax.jit(xla_fp4.fp4_block_scaled_dot, static_argnums=2)
    text = fn.lower(a3, b3, RECIPE, None, None).compile().as_text()
    kind = jax.devices()[0].device_kind
    on_cudnn = "__cudnn$blockScaledDot" in text
    c = np.asarray(fn(a3, b3, RECIPE, None, None), np.float64)
    aq = np.asarray(mxjax.dequantize(quantize_with(a3, MXFP4)), np.float64)
    bq = np.asarray(mxjax.dequantize(quantize_with(b3, MXFP4)), np.float64)
    exact = np.einsum("bik,bjk->bij", aq, bq)
    mag = np.einsum("bik,bjk->bij", np.abs(aq), np.abs(bq))
    err = np.abs(c - exact)
    ratio = float(np.max(err / mag))
    print(f"{kind} ({'cuDNN block-scaled MMA' if on_cudnn else 'XLA expansion'}) {case} "
          f"K={k}: max |C - A_q B_q| / (|A_q| |B_q|) = {ratio:.3g} "
          f"(bound {device_bound(k):.3g}; f32 accumulation alone: {(k + 4) * U32:.3g})")
    assert np.all(err <= device_bound(k) * mag), ratio
    if "B200" in kind or "GB200" in kind:
        assert on_cudnn
