"""MXFP4 on Blackwell's block-scaled FP4 MMA through XLA's NVFP4 dot (mxjax/routes/xla_fp4.py).

Deviceless compiles (bench/costmodel/aot.py). What XLA does with ``jax.nn.scaled_matmul`` on
``float4_e2m1fn`` operands (contraction last on both):

* NVFP4 (``float8_e4m3fn`` scales per 16): on B200, cuDNN's block-scaled MMA
  (``__cudnn$blockScaledDot``, f4e2m1fn operands), for a batch axis, K not a multiple of
  128 (XLA pads the scales to its 128 x 4 tile), the Llama-3.1-8B projections' shapes,
  f32 or bf16 results; a global factor multiplied on the result stays a separate
  elementwise kernel.
* MXFP4 (``float8_e8m0fnu`` scales per 32): XLA's block-scaling rewriter matches only
  MXFP8 and NVFP4, so on B200 too it expands the call into a dequantize (f4 and E8M0
  converted to f32, multiplied) and an f32 dot: no FP4 tensor core.
* On H200 (no block-scaled MMA) both expand into f32 dots.

``fp4_block_scaled_dot`` (MXFP4 re-encoded as NVFP4): on B200 its fast branch is the
cuDNN call on f4e2m1fn operands and its fallback (operands spanning more than 18
binades) an f32 dot, the two branches of one conditional; on H200 both are f32 dots.
"""

from __future__ import annotations

import collections
import functools

import pytest

from bench.costmodel import aot
from bench.costmodel import hlo_kernels as hk
from tests.accelerators.conftest import require

pytestmark = pytest.mark.accelerators

CUDNN = "__cudnn$blockScaledDot"
F4 = ("f4e2m1fn", "f4e2m1fn")


@functools.cache
def _raw_gemms(target: str, scale: str, b: int, m: int, n: int, k: int, out: str = "f32",
               factor: bool = False):
    """(GEMMs, kernel count) of one scaled_matmul [b, m, k] x [b, n, k] on f4 operands."""
    import jax
    import jax.numpy as jnp

    block, sdt = {"e8m0": (32, jnp.float8_e8m0fnu), "e4m3": (16, jnp.float8_e4m3fn)}[scale]

    out_dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[out]

    def fn(x, y, sx, sy, g):
        r = jax.nn.scaled_matmul(x, y, sx, sy, preferred_element_type=out_dtype)
        return r * g.astype(r.dtype) if factor else r

    S = jax.ShapeDtypeStruct
    args = (S((b, m, k), jnp.float4_e2m1fn), S((b, n, k), jnp.float4_e2m1fn),
            S((b, m, k // block), sdt), S((b, n, k // block), sdt), S((), jnp.float32))
    text = aot.compile_for(fn, args, require(target)).as_text()
    return tuple((g[1], g[2]) for g in hk.gemm_operand_types(text)), len(hk.kernels(text))


@pytest.mark.parametrize("out", ["f32", "bf16"])
@pytest.mark.parametrize("factor", [False, True])
def test_nvfp4_scaled_matmul_is_cudnn_block_scaled_on_b200(out, factor):
    gemms, n_kernels = _raw_gemms("b200", "e4m3", 1, 4096, 4096, 4096, out, factor)
    assert gemms == ((CUDNN, F4),)
    # The two scale swizzles and the call; the global factor is one more kernel.
    assert n_kernels == 3 + factor


@pytest.mark.parametrize("b,m,n,k", [
    (4, 1024, 1024, 1024),  # batch > 1
    (1, 4096, 4096, 4048),  # K a multiple of 16, not of 32, 128 or 256
    (1, 4096, 4096, 4128),  # K = 128 x 32 + 32
    (1, 8192, 4096, 112),   # short K
    (1, 8192, 4096, 4096),  # Llama-3.1-8B q/o projections (8192 tokens)
    (1, 8192, 1024, 4096),  # k/v projections
    (1, 8192, 14336, 4096),  # gate/up
    (1, 8192, 4096, 14336),  # down
    (2, 8192, 14336, 4096),
])
def test_nvfp4_scaled_matmul_shapes_lower_to_cudnn_on_b200(b, m, n, k):
    assert _raw_gemms("b200", "e4m3", b, m, n, k)[0] == ((CUDNN, F4),)


@pytest.mark.parametrize("b,m,n,k", [(1, 4096, 4096, 4096), (4, 1024, 1024, 1024)])
def test_mxfp4_scaled_matmul_is_expanded_to_an_f32_dot_even_on_b200(b, m, n, k):
    for target in ("b200", "h200"):
        assert _raw_gemms(target, "e8m0", b, m, n, k)[0] == (("fusion", ("f32", "f32")),), target
    assert _raw_gemms("h200", "e4m3", b, m, n, k)[0] == (("fusion", ("f32", "f32")),)


@functools.cache
def _fp4_dot_gemms(target: str, b: int, m: int, n: int, k: int):
    import jax
    import jax.numpy as jnp

    from mxjax.recipes import GemmRecipe
    from mxjax.routes import xla_fp4

    recipe = GemmRecipe(lhs="mxfp4", rhs="mxfp4")
    S = jax.ShapeDtypeStruct
    text = aot.compile_for(
        lambda a, w: xla_fp4.fp4_block_scaled_dot(a, w, recipe, None, None),
        (S((b, m, k), jnp.bfloat16), S((b, n, k), jnp.bfloat16)), require(target)).as_text()
    module = hk.parse_module(text)
    conds = [i for c in module.computations.values() for i in c if i.opcode == "conditional"]
    # gemm_operand_types charges a lax.cond's true branch (the MMA); the false branch (the
    # fallback) is read here: its dots, fused or not.
    fallback = [dot for cond in conds for name in cond.called if name not in cond.charged
                for dot, _ in hk._inner_dots(module, name)]
    return (tuple((g[1], g[2]) for g in hk.gemm_operand_types(text)), len(conds),
            len(fallback))


@pytest.mark.parametrize("b,m,n,k", [(1, 4096, 4096, 4096), (2, 512, 384, 1000),
                                     (1, 8192, 14336, 4096)])
def test_fp4_block_scaled_dot_is_the_cudnn_fp4_mma_on_b200_and_f32_on_h200(b, m, n, k):
    gemms, conditionals, fallback = _fp4_dot_gemms("b200", b, m, n, k)
    # One conditional: the cuDNN FP4 MMA (exact operands, charged) or the f32 emulation.
    assert conditionals == 1 and fallback == 1
    assert collections.Counter(gemms) == {(CUDNN, F4): 1}, gemms
    h200, h_conditionals, h_fallback = _fp4_dot_gemms("h200", b, m, n, k)
    print(f"h200 {b}x{m}x{n}x{k}: {h200}")
    assert h_conditionals == 1 and h_fallback == 1
    assert h200 == (("fusion", ("f32", "f32")),), h200
