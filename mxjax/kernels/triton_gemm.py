"""MXFP4 GEMM through jax-triton and Triton's `tl.dot_scaled` ("e2m1" operands, E8M0 scales).

Native block-scaled MMA on Blackwell (sm_100+) and AMD MI355X; on Hopper Triton
emulates it (upcast to bf16, then a bf16 dot). jax-triton and triton are
imported lazily: this module imports on CPU, and `available()` says whether the
kernel can be launched. There is no CPU fallback here; dispatch raises instead.
The @triton.jit body lives in triton_dot_scaled; `launch_plan` (tiles, padding,
grid) is shared with tests/mxjax/kernels/test_triton_interpret.py, which runs both in
Triton's CPU interpreter.

Layouts (tl.dot_scaled's): lhs uint8[M, K/2] packed along K with its scales
uint8[M, K/32]; rhs uint8[K/2, N] packed along K with its scales uint8[N, K/32].
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp

from mxjax.kernels import _common as C

__all__ = ["PTX_VERSION", "LaunchPlan", "available", "jax_triton_mismatch", "launch_plan",
           "mxfp4_dot_triton",
           "mxfp4_matmul_triton", "unavailable_reason"]

# The PTX ISA version the kernel is written in (Triton's `ptx_version` option, NVIDIA only).
# Triton 3.9 otherwise takes its bundled ptxas's (CUDA 13.4: PTX 9.4), which the ptxas
# XLA compiles the kernel with rejects when it is older (CUDA 12.9: 8.8, CUDA 13.0: 9.0).
# 8.8 is the oldest that has tcgen05's block-scaled MMA with 32-element scale blocks
# (`.block32`; 8.7 fails in ptxas), and every ptxas since CUDA 12.9 takes it.
PTX_VERSION = 88
# jax-triton releases whose DCE rule takes jax < 0.12's signature (used_outputs, eqn);
# jax 0.12 calls it with (used_outputs, live_inputs, eqn): tracing a train step fails
# with "takes 2 positional arguments but 3 were given". 'mxjax[gpu]' pins a working pair.
_JAX_TRITON_BEFORE_JAX_0_12 = ("0.3.0", "0.3.1", "0.4.0", "0.4.1")


def jax_triton_mismatch(jax_version: str, jax_triton_version: str) -> str | None:
    """None if jax-triton `jax_triton_version` lowers with jax `jax_version`, else why not."""
    def release(v):
        return tuple(int(p) for p in v.split(".")[:2])

    if release(jax_version) >= (0, 12) and jax_triton_version in _JAX_TRITON_BEFORE_JAX_0_12:
        return (f"jax-triton {jax_triton_version} does not lower with jax {jax_version} (its "
                "DCE rule predates jax 0.12's signature); pip install 'mxjax[gpu]' installs "
                "a pair that does (jax 0.11, jax-triton 0.4.1)")
    return None


def unavailable_reason(platform: str | None = None) -> str | None:
    """None if the Triton kernel can be built for `platform` (None: jax.default_backend()),
    else why not."""
    platform = jax.default_backend() if platform is None else platform
    if platform not in ("gpu", "cuda"):
        return f"needs a GPU backend (compiling for {platform!r})"
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
        import jax_triton
    except (ImportError, RuntimeError, OSError, ValueError) as e:  # pragma: no cover - GPU image
        return f"jax_triton does not import: {e}"
    return jax_triton_mismatch(jax.__version__, getattr(jax_triton, "__version__", ""))


def available() -> bool:
    return unavailable_reason() is None


def _kernel():
    """The @triton.jit kernel (mxjax.kernels.triton_dot_scaled; importing it imports triton)."""
    from mxjax.kernels.triton_dot_scaled import mxfp4_dot_scaled_kernel

    return mxfp4_dot_scaled_kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """One launch of the kernel: padded operands, grid and compile-time constants.

    `args` are (a_codes u8[Mp, Kp/2], a_scales u8[Mp, Kp/32], b_codes u8[Kp/2, Np],
    b_scales_t u8[Np, Kp/32]) with Mp, Np, Kp multiples of the tiles (zero codes,
    scale byte 127 in the padding); the output is f32[Mp, Np], sliced to [m, n].
    """

    args: tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray, jnp.ndarray]
    grid: tuple[int, int]
    out_shape: tuple[int, int]
    constants: dict[str, int]


def launch_plan(
    a_codes: jnp.ndarray,
    a_scales: jnp.ndarray,
    b_codes: jnp.ndarray,
    b_scales: jnp.ndarray,
    *,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 128,
) -> LaunchPlan:
    """Pads the kernel's layout (see the module docstring) to whole tiles for `_kernel()`."""
    if b_codes.shape[0] != a_codes.shape[1]:
        raise ValueError(
            f"b_codes: packed K {b_codes.shape[0]} does not match a_codes' {a_codes.shape[1]}"
        )
    bm = C.tile(a_codes.shape[0], block_m, 16)
    bn = C.tile(b_codes.shape[1], block_n, 16)
    bk = C.tile(a_codes.shape[1] * 2, block_k, 64)
    mp, np_ = C.round_up(a_codes.shape[0], bm), C.round_up(b_codes.shape[1], bn)
    kp = C.round_up(a_codes.shape[1] * 2, bk)
    args = (
        C.pad2(a_codes, mp, kp // 2),
        C.pad2(a_scales, mp, kp // 32, 127),
        C.pad2(b_codes, kp // 2, np_),
        C.pad2(b_scales, kp // 32, np_, 127).T,  # tl.dot_scaled wants [N, K/32]
    )
    return LaunchPlan(
        args=args,
        grid=(mp // bm, np_ // bn),
        out_shape=(mp, np_),
        constants={"K_BYTES": kp // 2, "N_OUT": np_, "BLOCK_M": bm, "BLOCK_N": bn,
                   "BLOCK_K": bk},
    )


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
    """f32[m, n] from MXFP4 operands in the kernel's layout (see the module docstring)."""
    reason = unavailable_reason("gpu")  # the dispatcher checked the target chip
    if reason is not None:
        raise RuntimeError(f"backend 'triton' cannot run: {reason}")
    import jax_triton as jt

    plan = launch_plan(a_codes, a_scales, b_codes, b_scales,
                       block_m=block_m, block_n=block_n, block_k=block_k)
    out = jt.triton_call(
        *plan.args,
        kernel=_kernel(),
        out_shape=jax.ShapeDtypeStruct(plan.out_shape, jnp.float32),
        grid=plan.grid,
        num_warps=num_warps,
        num_stages=num_stages,
        backend_options={"ptx_version": PTX_VERSION},  # ignored by Triton's AMD backend
        **plan.constants,
    )
    return out[:m, :n]


def mxfp4_dot_triton(lhs_q, rhs_q, **tiles) -> jnp.ndarray:
    """f32[M, N] of two 2-D MXFP4 MXArrays (contracting their block axes) by the kernel.

    ``tiles``: block_m / block_n / block_k (and num_warps / num_stages) overrides."""
    a, sa, b, sb, (m, n, _) = C.canonical_operands(lhs_q, rhs_q)
    return mxfp4_matmul_triton(a, sa, b, sb, m=m, n=n, **tiles)
