"""A numpy model of how a Hopper (sm_90) tensor core accumulates an FP8 GEMM, for CPU tests.

The facts it models, and where each comes from:

* one accumulation step takes 32 products (wgmma's K for 8-bit inputs) and the running sum
  ``c``; the products are exact; every term is aligned to the step's largest exponent
  ``E`` and truncated toward zero to 13 fraction bits below ``2^E``; a product's exponent
  is the sum of its inputs' exponents, each read as at least its format's smallest normal
  exponent (E4M3 -6, E5M2 -14); zero products take no part in ``E``; ``E`` is at least -132;
  the aligned terms are summed exactly and the sum is truncated toward zero to 13 fraction
  bits below its own leading bit (Khattak and Mikaitis, "Accurate Models of NVIDIA Tensor
  Cores", arXiv 2512.07004; the same parameters as mmaemu 0.1.0's 'hopper' preset, which
  its authors report bit-exact against cuBLASLt 12.8.3.14 FP8 GEMMs on an H100 PCIe);
* fast accumulation: one chain of steps over the whole K, from +0;
* promoted accumulation (cuBLAS without ``CUBLASLT_MATMUL_DESC_FAST_ACCUM``): a chain per
  128 consecutive K elements, from +0, each chain's result added in K order into an f32
  accumulator, rounded to nearest even (mmaemu 0.1.0's GEMM-level model of the same
  cuBLASLt; DeepSeek-V3, arXiv 2412.19437 section 3.3.2, promotes at the same interval).

Written for this project from those descriptions (no code taken from them). Every step is
exact in float64: FP8 products have at most 8 significant bits and the aligned sums are
integers below 2^53.
"""

from __future__ import annotations

import numpy as np

STEP = 32
FRACTION_BITS = 13
PROMOTION_INTERVAL = 128
MIN_EXP = -132
EMIN = {"e4m3": -6, "e5m2": -14}


def _exponent(x: np.ndarray, emin: int) -> np.ndarray:
    """floor(log2|x|), at least ``emin`` (exact: frexp)."""
    return np.maximum(np.frexp(x)[1] - 1, emin)


def _truncate(x: np.ndarray, grid_exp: np.ndarray) -> np.ndarray:
    """x truncated toward zero to a multiple of 2^grid_exp (exact)."""
    return np.trunc(np.ldexp(x, -grid_exp)) * np.ldexp(1.0, grid_exp)


def mma_step(a: np.ndarray, b: np.ndarray, c: np.ndarray, formats: tuple[str, str]) -> np.ndarray:
    """One accumulation step: ``a``, ``b`` [..., n <= 32] FP8 values (float64), ``c`` [...]."""
    prod = a * b
    live = prod != 0
    ep = _exponent(a, EMIN[formats[0]]) + _exponent(b, EMIN[formats[1]])
    ep = np.where(live, ep, MIN_EXP)
    ec = np.where(c != 0, np.frexp(c)[1] - 1, MIN_EXP)
    e = np.maximum(np.maximum(ep.max(axis=-1), ec), MIN_EXP)
    grid = e - FRACTION_BITS
    s = _truncate(prod, grid[..., None]).sum(axis=-1) + _truncate(c, grid)
    lead = np.where(s != 0, np.frexp(s)[1] - 1, 0)
    return np.where(s != 0, _truncate(s, lead - FRACTION_BITS), 0.0)


def chain(a: np.ndarray, b: np.ndarray, formats: tuple[str, str]) -> np.ndarray:
    """Steps over the last axis of ``a`` [M, K] and ``b`` [N, K] from +0: [M, N]."""
    acc = np.zeros((a.shape[0], b.shape[0]))
    for k0 in range(0, a.shape[1], STEP):
        acc = mma_step(a[:, None, k0:k0 + STEP], b[None, :, k0:k0 + STEP], acc, formats)
    return acc


def fp8_gemm(a: np.ndarray, b: np.ndarray, *, fast: bool,
             formats: tuple[str, str] = ("e4m3", "e4m3")) -> np.ndarray:
    """The modelled FP8 GEMM ``a @ b.T`` (f32 values, float64 dtype).

    Args:
      a: [M, K] and b: [N, K], FP8 values (of ``formats``) as float64 (the GEMM's operands
        before the tensor scales, which the epilogue applies).
      fast: one chain over K (fast accumulation), else promoted every 128 elements.
    """
    if fast:
        return chain(a, b, formats)
    acc = np.zeros((a.shape[0], b.shape[0]), np.float32)
    for k0 in range(0, a.shape[1], PROMOTION_INTERVAL):
        part = chain(a[:, k0:k0 + PROMOTION_INTERVAL], b[:, k0:k0 + PROMOTION_INTERVAL], formats)
        acc = acc + part.astype(np.float32)  # exact cast: <= 14 significant bits
    return acc.astype(np.float64)
