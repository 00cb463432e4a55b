"""GPU-free checks that the kernels compile for GPUs.

1. The Pallas quantize kernel lowers to Triton IR for an abstract NVIDIA H200 (jax.export
   with an AbstractDevice; no GPU needed). This catches primitives without a
   Pallas-Triton lowering; Triton's own compiler runs later, inside XLA, on a GPU.
2. If `triton` is importable (not a CPU dependency), the tl.dot_scaled kernel of
   the 'triton' backend is compiled to PTX for sm_90 (Hopper: bf16 emulation)
   and sm_100 (Blackwell: native FP4 MMA).
"""

from __future__ import annotations

import importlib.util
import warnings

import jax
import jax.numpy as jnp
import pytest

from mxjax.kernels import QuantSpec, fused_quantize
from tests.mxjax.kernels._kernel_testutil import BLOCKED_BY_LAX_ROUND

_TRITON_CALL = "__gpu$xla.gpu.triton"


def _lower_for_h200(fn, *args) -> str:
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=dev)
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend
        exp = jax.export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)],
        )(*args)
    return exp.mlir_module()


S = jax.ShapeDtypeStruct


@BLOCKED_BY_LAX_ROUND
@pytest.mark.parametrize("specs", [
    {"row": QuantSpec(hadamard=16), "col": QuantSpec(hadamard=16)},
    {"row": QuantSpec(recipe="mxfp8_e4m3")},
])
def test_fused_quantize_lowers_to_triton_for_h200(specs):
    text = _lower_for_h200(lambda x: fused_quantize(x, interpret=False, **specs),
                           S((256, 256), jnp.bfloat16))
    assert text.count(_TRITON_CALL) == 1


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (GPU extra); the kernel source is not compiled")
@pytest.mark.parametrize(("cc", "marker"), [(90, "wgmma"), (100, "tcgen05")])
def test_dot_scaled_kernel_compiles_to_ptx(cc, marker):
    import triton
    from triton.backends.compiler import GPUTarget

    from mxjax.kernels.triton_gemm import _kernel

    sig = {"a_ptr": "*u8", "sa_ptr": "*u8", "b_ptr": "*u8", "sb_ptr": "*u8", "c_ptr": "*fp32"}
    consts = {"K_BYTES": 1024, "N_OUT": 256, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}
    sig.update({k: "constexpr" for k in consts})
    src = triton.compiler.ASTSource(fn=_kernel(), signature=sig, constexprs=consts)
    out = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                         options={"num_warps": 8, "num_stages": 3})
    assert marker in out.asm["ptx"]


@pytest.mark.parametrize("jax_version,jax_triton_version,lowers", [
    ("0.11.2", "0.4.1", True),   # the pair 'mxjax[gpu]' pins (make test-gpu-extra)
    ("0.12.0.1", "0.4.1", False),
    ("0.12.0", "0.3.1", False),
    ("0.13.0", "0.4.1", False),
    ("0.12.0.1", "0.5.0", True),  # a later release is not refused by this list
])
def test_jax_triton_mismatch_names_the_pairs_that_do_not_lower(jax_version,
                                                               jax_triton_version, lowers):
    from mxjax.kernels.triton_gemm import jax_triton_mismatch

    why = jax_triton_mismatch(jax_version, jax_triton_version)
    if lowers:
        assert why is None
    else:
        assert jax_triton_version in why and jax_version in why and "mxjax[gpu]" in why
