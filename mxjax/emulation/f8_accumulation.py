"""How an FP8 GEMM accumulates on NVIDIA tensor cores: the precision mxjax asks XLA for, per GEMM.

XLA turns an f8 x f8 ``dot_general`` into an FP8 GEMM on H100/H200/B200 by one of two
paths (found by deviceless compiles, ``tests/accelerators/test_deviceless_fp8_gemm.py``;
XLA's sources as cited):

* cuBLASLt (``__cublas$lt$matmul$f8``): the dot's operand precision is kept in the custom
  call's ``precision_config``; XLA sets ``CUBLASLT_MATMUL_DESC_FAST_ACCUM`` when it is
  DEFAULT and leaves it off otherwise (``IsFastAccumEnabled``,
  xla/stream_executor/cuda/cuda_blas_lt.cc; openxla/xla#6599). Off, cuBLAS promotes the
  tensor core's partial sums into an f32 accumulator every 128 K elements ("promoted"
  accumulation, Transformer Engine's ``use_split_accumulator``); on, one tensor-core
  accumulation runs over the whole K ("fast" accumulation).
* XLA's Triton GEMM fusions (the default, ``xla_gpu_enable_triton_gemm``): XLA emits every
  f8 ``tt.dot`` with ``maxNumImpreciseAcc`` = INT_MAX, "to mimick cuBLAS", whatever the
  precision (xla/backends/gpu/codegen/triton, ``EmitDotAlgUnset``): fast accumulation
  always. Which path runs a GEMM on a device is the autotuner's choice.

Transformer Engine's recipe: fast accumulation in the forward GEMM, promoted accumulation in
the two backward GEMMs, whose gradients (E5M2) span a wider range. mxjax asks for the same:
`f8_dot_precision` gives DEFAULT for the forward GEMM and HIGHEST for dgrad and wgrad. What
each accumulation keeps (the tensor-core model and the bound) is docs/NUMERICS.md's "FP8
GEMMs on FP8 tensor cores"; `accumulation_bound` states the bound.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

__all__ = ["GEMM_NAMES", "MMA_FRACTION_BITS", "MMA_STEP", "PROMOTION_INTERVAL",
           "accumulation_bound", "f8_dot_precision", "is_fast_accumulation"]

GEMM_NAMES = ("fprop", "dgrad", "wgrad")
# K elements between cuBLAS's promotions of the tensor core's partial sums (fast accumulation
# off): measured on an H100 (mmaemu 0.1.0's 'hopper' preset, cuBLASLt 12.8.3.14); DeepSeek-V3
# (arXiv 2412.19437, section 3.3.2) promotes at the same interval.
PROMOTION_INTERVAL = 128
# Products per tensor-core accumulation step (Hopper wgmma, K = 32 for 8-bit inputs) and
# fraction bits kept below the step's largest exponent (Khattak and Mikaitis, "Accurate
# Models of NVIDIA Tensor Cores", arXiv 2512.07004; mmaemu 0.1.0's 'hopper' preset).
MMA_STEP = 32
MMA_FRACTION_BITS = 13
_U = 2.0 ** -24  # f32 unit roundoff


def is_fast_accumulation(gemm_name: str | None, lhs_dtype, rhs_dtype) -> bool:
    """Whether the GEMM asks for fast accumulation (the forward GEMM's recipe).

    Args:
      gemm_name: 'fprop', 'dgrad' or 'wgrad', or None where the caller does not say; then
        the operands say: E4M3 x E4M3 (the forward pair of every FP8 recipe here) is the
        forward GEMM, a GEMM with an E5M2 operand (a gradient) a backward one.
      lhs_dtype, rhs_dtype: the f8 operands' dtypes.
    """
    if gemm_name is not None:
        if gemm_name not in GEMM_NAMES:
            raise ValueError(f"gemm_name: expected one of {GEMM_NAMES} or None, got {gemm_name!r}")
        return gemm_name == "fprop"
    e5m2 = jnp.dtype(jnp.float8_e5m2)
    return jnp.dtype(lhs_dtype) != e5m2 and jnp.dtype(rhs_dtype) != e5m2


def f8_dot_precision(gemm_name: str | None, lhs_dtype, rhs_dtype) -> lax.Precision:
    """The ``precision`` of the GEMM's f8 ``dot_general``: DEFAULT (cuBLAS fast accumulation)
    for the forward GEMM, HIGHEST (promoted accumulation) for dgrad and wgrad.

    See `is_fast_accumulation` for how the GEMM is known. Under XLA's Triton GEMMs both give
    fast accumulation (module docstring).
    """
    fast = is_fast_accumulation(gemm_name, lhs_dtype, rhs_dtype)
    return lax.Precision.DEFAULT if fast else lax.Precision.HIGHEST


def accumulation_bound(k: int, *, fast: bool, subnormal_bits: int = 0) -> float:
    """docs/NUMERICS.md's bound factor ``b``: ``|C - A_q B_q| <= b * (|A_q| |B_q|)`` for an FP8
    GEMM over ``k`` on a Hopper tensor core, its f32 epilogue (the two tensor scales) included.

    One accumulation chain of ``n`` steps (32 products and the running sum, aligned to the
    largest exponent and truncated to 13 fraction bits, the sum truncated to 13 fraction
    bits) loses at most ``(34 n + 33 (2^subnormal_bits - 1)) 2^-13`` of the absolute sum it
    covers. Fast accumulation is one chain over ``k``; promoted accumulation a chain per
    128 elements (n <= 4) whose results are added in f32 (``ceil(k / 128)`` roundings), and
    cuBLAS's split-K adds its splits' results the same way. Three f32 roundings cover the
    epilogue.

    Args:
      k: the contraction length.
      fast: fast (one chain) or promoted accumulation.
      subnormal_bits: 0 when no operand value is subnormal in its FP8 format; else the sum
        of the mantissa bits of the operand formats holding subnormals (E4M3 3, E5M2 2),
        for a subnormal's exponent is read as the format's smallest normal one.
    """
    if k < 1:
        raise ValueError(f"k: expected a positive contraction length, got {k}")
    if subnormal_bits < 0:
        raise ValueError(f"subnormal_bits: expected >= 0, got {subnormal_bits}")
    steps = math.ceil(k / MMA_STEP)
    if not fast:
        steps = min(steps, PROMOTION_INTERVAL // MMA_STEP)
    chain = (34 * steps + 33 * (2 ** subnormal_bits - 1)) * 2.0 ** -MMA_FRACTION_BITS
    return chain + (math.ceil(k / PROMOTION_INTERVAL) + 3) * _U
