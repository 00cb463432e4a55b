"""Backend choice and the MXFP4 GEMM entry point used by the interceptor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mxjax import formats as F
from mxjax.kernels import _common as C
from mxjax.kernels.capabilities import Capabilities, capabilities
from mxjax.kernels.fp8_gemm import mxfp4_matmul_fp8
from mxjax.kernels.pallas_gemm import mxfp4_matmul_pallas
from mxjax.kernels.reference import mx_dot_reference
from mxjax.kernels.triton_gemm import mxfp4_matmul_triton
from mxjax.layout import canonical_dimension_numbers
from mxjax.quantization import MXArray, dequantize
from mxjax.recipes import BACKENDS

__all__ = [
    "BACKENDS",
    "auto_backend",
    "backend_for_formats",
    "mx_dot",
    "resolve_backend",
    "supports",
]


def auto_backend(caps: Capabilities) -> str:
    """The backend 'auto' picks on a device (a static preference, to be confirmed by bench/gpu.py).

    CPU/TPU: 'xla' (the interpreter is far slower than XLA). Native FP4 GPUs
    (Blackwell, MI355X) with jax-triton: 'triton' (tl.dot_scaled runs on the FP4
    units). NVIDIA GPUs with FP8 tensor cores (Hopper, Ada): 'pallas_fp8'
    (twice the bf16 rate). Other GPUs: 'pallas' (bf16 dots from packed codes).
    """
    if caps.platform != "gpu":
        return "xla"
    if caps.native_fp4 and caps.can_run("triton"):
        return "triton"
    if caps.can_run("pallas_fp8"):
        return "pallas_fp8"
    if caps.can_run("pallas"):
        return "pallas"
    return "xla"


def resolve_backend(name: str, caps: Capabilities | None = None) -> str:
    """Maps a backend name to a concrete backend that can run here.

    'auto' picks with `auto_backend`. An explicit backend that cannot run on this
    device raises RuntimeError with the reason (no silent fallback).
    """
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend: unknown {name!r}; expected one of {BACKENDS}")
    caps = capabilities() if caps is None else caps
    if name == "auto":
        return auto_backend(caps)
    why = caps.reason(name)
    if why:
        raise RuntimeError(f"backend {name!r} cannot run on {caps.device_kind!r}: {why}")
    return name


def supports(backend: str, lhs_fmt, rhs_fmt) -> bool:
    """Whether a concrete backend implements a GEMM of these two operand formats.

    'xla' handles every quantized format; the kernels need MXFP4 x MXFP4.
    """
    if backend == "xla":
        return True
    return F.get(lhs_fmt) is F.MXFP4 and F.get(rhs_fmt) is F.MXFP4


def backend_for_formats(backend: str, lhs_fmt, rhs_fmt, *, where: str = "backend",
                        caps: Capabilities | None = None) -> str:
    """The concrete backend that runs an ``lhs_fmt x rhs_fmt`` GEMM under `backend`.

    Resolves `backend` (:func:`resolve_backend`). A kernel that does not
    implement the formats (:func:`supports`) gives 'xla' when `backend` is
    'auto' and raises ValueError (message prefixed with `where`) when it was
    asked for explicitly: no silent fallback.
    """
    concrete = resolve_backend(backend, caps)
    if supports(concrete, lhs_fmt, rhs_fmt):
        return concrete
    if backend != "auto":
        raise ValueError(
            f"{where}: backend {backend!r} implements MXFP4 x MXFP4 only, got "
            f"{F.get(lhs_fmt).name} x {F.get(rhs_fmt).name}; use backend='xla' or 'auto'"
        )
    return "xla"


def _check(lhs_q, rhs_q):
    for name, q in (("lhs_q", lhs_q), ("rhs_q", rhs_q)):
        if not isinstance(q, MXArray):
            raise TypeError(f"{name}: expected an MXArray, got {type(q).__name__}")
        if len(q.shape) < 2:
            raise ValueError(f"{name}: expected a 2-D (or batched) MXArray, got shape {q.shape}")
        if len(q.shape) > 2 and q.axis != len(q.shape) - 1:
            raise ValueError(
                f"{name}: a batched operand [batch..., F, K] must be blocked along its last "
                f"axis, got axis {q.axis} of shape {q.shape}"
            )
    if len(lhs_q.shape) != len(rhs_q.shape) or (
        len(lhs_q.shape) > 2 and lhs_q.shape[:-2] != rhs_q.shape[:-2]
    ):
        raise ValueError(
            f"lhs_q, rhs_q: batch dimensions differ: {lhs_q.shape} vs {rhs_q.shape}"
        )
    if lhs_q.shape[lhs_q.axis] != rhs_q.shape[rhs_q.axis]:
        raise ValueError(
            f"lhs_q, rhs_q: contraction lengths differ: {lhs_q.shape[lhs_q.axis]} "
            f"(lhs axis {lhs_q.axis}) vs {rhs_q.shape[rhs_q.axis]} (rhs axis {rhs_q.axis})"
        )


def mx_dot(lhs_q: MXArray, rhs_q: MXArray, *, backend: str = "xla", interpret: bool | None = None,
           **tiles) -> jnp.ndarray:
    """f32[lhs free, rhs free]: contracts the block axes of two 2-D quantized operands.

    The contraction runs along lhs_q.axis and rhs_q.axis (each operand's block
    axis): lhs (M, K) with axis=1 or (K, M) with axis=0; rhs (K, N) with axis=0
    or (N, K) with axis=1. The result is (M, N) f32 and equals (up to fp32
    summation order, see GEMM_TOLERANCE_DOC) the dot of the dequantized operands.
    Batched operands [batch..., M, K] and [batch..., N, K] (same batch shape,
    blocked along the last axis) give f32[batch..., M, N] (Pallas backends via
    vmap, Triton via lax.map, XLA directly).

    Args:
      lhs_q, rhs_q: MXArrays from mxjax.quantize / fused_quantize. 'xla' takes
        any quantized format; the kernel backends take MXFP4 x MXFP4.
      backend: 'xla' | 'pallas' | 'pallas_fp8' | 'triton' | 'auto'. 'auto' uses
        `auto_backend` and, for formats the chosen kernel lacks, 'xla'. An
        explicit kernel backend raises if it cannot run here or lacks the formats.
      interpret: force (or forbid) the Pallas interpreter; default: interpret off-GPU.
      **tiles: block_m / block_n / block_k overrides for the kernel.
    """
    _check(lhs_q, rhs_q)
    backend = backend_for_formats(backend, lhs_q.fmt, rhs_q.fmt, where="mx_dot")
    if len(lhs_q.shape) > 2:
        return _batched(lhs_q, rhs_q, backend, interpret, tiles)
    if backend == "xla":
        return mx_dot_reference(lhs_q, rhs_q)
    a, sa, b, sb, (m, n, _) = C.canonical_operands(lhs_q, rhs_q)
    return _kernel(backend, a, sa, b, sb, m, n, interpret, tiles)


def _kernel(backend, a, sa, b, sb, m, n, interpret, tiles):
    tiles = dict(tiles)
    if backend == "pallas":
        return mxfp4_matmul_pallas(a, sa, b, sb, m=m, n=n, interpret=interpret, **tiles)
    if backend == "pallas_fp8":
        tiles.pop("block_k", None)  # the FP8 path steps K by CHUNK
        return mxfp4_matmul_fp8(a, sa, b, sb, m=m, n=n, interpret=interpret, **tiles)
    return mxfp4_matmul_triton(a, sa, b, sb, m=m, n=n, **tiles)


def _batched(lhs_q: MXArray, rhs_q: MXArray, backend, interpret, tiles):
    """[batch..., M, K] x [batch..., N, K] -> f32[batch..., M, N] (both blocked along K)."""
    batch = lhs_q.shape[:-2]
    m, n = lhs_q.shape[-2], rhs_q.shape[-2]
    if backend == "xla":
        a = dequantize(lhs_q, jnp.float32)
        b = dequantize(rhs_q, jnp.float32)
        return lax.dot_general(a, b, canonical_dimension_numbers(len(batch)),
                               precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)

    def flat(x):
        return x.reshape((-1,) + x.shape[-2:])

    def one(ac, asc, bc, bsc):
        return _kernel(backend, ac, asc, bc.T, bsc.T, m, n, interpret, tiles)

    args = (flat(lhs_q.codes), flat(lhs_q.scales), flat(rhs_q.codes), flat(rhs_q.scales))
    if backend == "triton":  # jax-triton has no batching rule
        out = lax.map(lambda t: one(*t), args)
    else:
        out = jax.vmap(one)(*args)
    return out.reshape(batch + (m, n))
