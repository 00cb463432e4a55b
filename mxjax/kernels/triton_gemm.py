"""MXFP4 GEMM through jax-triton and Triton's `tl.dot_scaled` ("e2m1" operands, E8M0 scales).

Native block-scaled MMA on Blackwell (sm_100+) and AMD MI355X; on Hopper Triton
emulates it (upcast to bf16, then a bf16 dot). jax-triton and triton are
imported lazily: this module imports on CPU, and `available()` says whether the
kernel can be launched. There is no CPU fallback here; dispatch raises instead.

Layouts (tl.dot_scaled's): lhs uint8[M, K/2] packed along K with its scales
uint8[M, K/32]; rhs uint8[K/2, N] packed along K with its scales uint8[N, K/32].
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp

from mxjax.kernels import _common as C

__all__ = ["available", "mxfp4_matmul_triton", "unavailable_reason"]


def unavailable_reason() -> str | None:
    """None if the Triton kernel can run here, else why not."""
    if jax.default_backend() != "gpu":
        return f"needs a GPU backend (jax.default_backend() is {jax.default_backend()!r})"
    for mod in ("triton", "jax_triton"):
        if importlib.util.find_spec(mod) is None:
            return (
                f"{mod} is not installed (pip install 'mxjax[gpu]'; on the H200 image carry "
                "a jax-triton wheel matching its triton)"
            )
    try:
        import triton.language as tl
    except (ImportError, RuntimeError, OSError) as e:  # pragma: no cover - GPU image
        return f"triton does not import: {e}"
    if not hasattr(tl, "dot_scaled"):
        return "this triton has no tl.dot_scaled (needs triton >= 3.2)"
    try:
        import jax_triton  # noqa: F401
    except (ImportError, RuntimeError, OSError, ValueError) as e:  # pragma: no cover - GPU image
        return f"jax_triton does not import: {e}"
    return None


def available() -> bool:
    return unavailable_reason() is None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def mxfp4_dot_scaled_kernel(
        a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr,
        K_BYTES: tl.constexpr, N_OUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Row-major operands; K_BYTES = K/2 (packed bytes per row of A).
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

    return mxfp4_dot_scaled_kernel


def mxfp4_matmul_triton(
    a_codes: jnp.ndarray,
    a_scales: jnp.ndarray,
    b_codes: jnp.ndarray,
    b_scales: jnp.ndarray,
    *,
    m: int,
    n: int,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 128,
    num_warps: int = 8,
    num_stages: int = 3,
) -> jnp.ndarray:
    """f32[m, n] from MXFP4 operands in the kernels' layout (see mxfp4_matmul_pallas)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"backend 'triton' cannot run: {reason}")
    import jax_triton as jt

    if b_codes.shape[0] != a_codes.shape[1]:
        raise ValueError(
            f"b_codes: packed K {b_codes.shape[0]} does not match a_codes' {a_codes.shape[1]}"
        )
    bm = C.tile(a_codes.shape[0], block_m, 16)
    bn = C.tile(b_codes.shape[1], block_n, 16)
    bk = C.tile(a_codes.shape[1] * 2, block_k, 64)
    mp, np_ = C.round_up(a_codes.shape[0], bm), C.round_up(b_codes.shape[1], bn)
    kp = C.round_up(a_codes.shape[1] * 2, bk)
    a_codes = C.pad2(a_codes, mp, kp // 2)
    a_scales = C.pad2(a_scales, mp, kp // 32, 127)
    b_codes = C.pad2(b_codes, kp // 2, np_)
    b_scales_t = C.pad2(b_scales, kp // 32, np_, 127).T  # tl.dot_scaled wants [N, K/32]
    out = jt.triton_call(
        a_codes, a_scales, b_codes, b_scales_t,
        kernel=_kernel(),
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        grid=(mp // bm, np_ // bn),
        num_warps=num_warps,
        num_stages=num_stages,
        K_BYTES=kp // 2, N_OUT=np_, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )
    return out[:m, :n]
