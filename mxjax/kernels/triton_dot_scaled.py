"""The `@triton.jit` body of the 'triton' backend's MXFP4 GEMM (imports triton).

Kept apart from triton_gemm (which imports triton only when it launches) so the
kernel is a module-level function: Triton's interpreter finds `tl` in the
kernel's module globals, so tests run this very function on CPU
(tests/mxjax/kernels/test_triton_interpret.py) and jax-triton launches it on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["mxfp4_dot_scaled_kernel"]


@triton.jit
def mxfp4_dot_scaled_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr,
    K_BYTES: tl.constexpr, N_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[Mp, N_OUT] f32 = A @ B for MXFP4 operands padded to whole tiles (no masking).

    a u8[Mp, K_BYTES] packed along K, sa u8[Mp, K_BYTES/16]; b u8[K_BYTES, N_OUT]
    packed along K, sb u8[N_OUT, K_BYTES/16] (tl.dot_scaled's [N, K/32] layout).
    Grid (Mp / BLOCK_M, N_OUT / BLOCK_N); all arrays row-major and contiguous.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 32)
    k_scales = K_BYTES // 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(K_BYTES // (BLOCK_K // 2)):
        kb = k * (BLOCK_K // 2) + offs_kb
        ks = k * (BLOCK_K // 32) + offs_ks
        a = tl.load(a_ptr + offs_m[:, None] * K_BYTES + kb[None, :])
        b = tl.load(b_ptr + kb[:, None] * N_OUT + offs_n[None, :])
        sa = tl.load(sa_ptr + offs_m[:, None] * k_scales + ks[None, :])
        sb = tl.load(sb_ptr + offs_n[:, None] * k_scales + ks[None, :])
        acc = tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc)
    tl.store(c_ptr + offs_m[:, None] * N_OUT + offs_n[None, :], acc)
