"""Backend choice and the MXFP4 GEMM entry point used by the interceptor.

Backends are chosen for the chip a program is compiled for
(:func:`mxjax.kernels.capabilities.target_chip`), once per lowering platform:
:func:`backends_per_platform` answers for 'cpu', 'gpu' and 'tpu', and the GEMM
(`mxjax.gemm`) puts one branch per platform under ``jax.lax.platform_dependent``,
so lowering keeps the branch of the platform it lowers for. A branch whose explicit
backend cannot run there is an op that raises when lowered (:func:`unavailable`),
naming the reason; it is never replaced by the emulation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir

from mxjax import formats as F
from mxjax import measurements
from mxjax.kernels import _common as C
from mxjax.kernels.capabilities import Capabilities, capabilities
from mxjax.kernels.fp8_gemm import mxfp4_matmul_fp8
from mxjax.kernels.pallas_gemm import mxfp4_matmul_pallas
from mxjax.kernels.reference import mx_dot_reference
from mxjax.kernels.triton_gemm import mxfp4_matmul_triton
from mxjax.layout import canonical_dimension_numbers
from mxjax.quantization import MXArray, dequantize
from mxjax.recipes import BACKENDS
from mxjax.routes import xla_fp8

__all__ = [
    "AUTO_CHOICES",
    "BACKENDS",
    "PLATFORM_FORMS",
    "AutoChoice",
    "BackendUnavailableError",
    "auto_backend",
    "auto_choice",
    "backend_for_formats",
    "backends_per_platform",
    "mx_dot",
    "resolve_backend",
    "supports",
    "unavailable",
]

# The lowering platforms a GEMM is resolved for (mxjax._platform.FORMS' order).
PLATFORM_FORMS = ("cpu", "gpu", "tpu")


class BackendUnavailableError(RuntimeError):
    """An explicit backend cannot run on the chip compiled for (raised when lowering)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoChoice:
    """What backend 'auto' picks on a class of chips, and the evidence behind it.

    ``platform``: 'cpu', 'gpu' or 'tpu'. ``min_compute_capability``: on NVIDIA GPUs, the
    choice applies from this compute capability up (the first matching row of
    :data:`AUTO_CHOICES` wins); None matches any chip of the platform. ``evidence``: the
    keys of the figures behind the choice in ``mxjax/measurements.json``
    (:attr:`figures` reads them). 'auto' never takes a route estimated slower than the
    emulation ('xla') on that chip; a row's backend that cannot run on a chip gives 'xla'.
    """

    platform: str
    min_compute_capability: tuple[int, int] | None = None
    backend: str
    evidence: tuple[str, ...]

    def __post_init__(self):
        if (not isinstance(self.evidence, tuple) or not self.evidence
                or not all(isinstance(k, str) for k in self.evidence)):
            raise ValueError(f"AutoChoice.evidence: expected a non-empty tuple of keys of "
                             f"mxjax/measurements.json, got {self.evidence!r}")

    @property
    def figures(self) -> tuple[measurements.Figure, ...]:
        """The evidence's figures, read from the measurements file."""
        return tuple(measurements.figure(key) for key in self.evidence)


AUTO_CHOICES: tuple[AutoChoice, ...] = (
    # Blackwell: 'xla_fp4' (cuDNN's FP4 MMA in every GEMM) estimated fastest, ahead of
    # 'xla_fp8', 'triton' and the emulation.
    AutoChoice(platform="gpu", min_compute_capability=(10, 0), backend="xla_fp4",
               evidence=("layer_8b.b200.rates_roofline",
                         "layer_8b.b200.triton_rates_roofline")),
    # Hopper: 'xla_fp8' (MXFP4 carried exactly in FP8) faster than the emulation, measured
    # and estimated.
    AutoChoice(platform="gpu", min_compute_capability=(9, 0), backend="xla_fp8",
               evidence=("layer_8b.h200.rates_roofline", "layer_8b.h200.measured")),
    AutoChoice(platform="gpu", backend="xla", evidence=("auto.gpu.other",)),
    AutoChoice(platform="tpu", backend="xla", evidence=("auto.tpu",)),
    AutoChoice(platform="cpu", backend="xla", evidence=("auto.cpu",)),
)


def auto_choice(caps: Capabilities) -> AutoChoice:
    """The :data:`AUTO_CHOICES` row for a chip."""
    for row in AUTO_CHOICES:
        if row.platform != caps.platform:
            continue
        if row.min_compute_capability is None or (
                caps.compute_capability is not None
                and caps.compute_capability >= row.min_compute_capability):
            return row
    raise ValueError(f"no AUTO_CHOICES row for platform {caps.platform!r}")


def auto_backend(caps: Capabilities) -> str:
    """The backend 'auto' picks on a chip: its :data:`AUTO_CHOICES` row's, when that can
    run there, else 'xla' (which runs everywhere)."""
    backend = auto_choice(caps).backend
    return backend if caps.can_run(backend) else "xla"


def resolve_backend(name: str, caps: Capabilities | None = None) -> str:
    """Maps a backend name to a concrete backend that can run on the chip compiled for.

    'auto' picks with `auto_backend`. An explicit backend that cannot run on the chip
    raises :class:`BackendUnavailableError` (a RuntimeError) with the reason (no silent
    fallback). ``caps``: the chip's capabilities (default: :func:`capabilities`, the
    target of the trace in progress).
    """
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend: unknown {name!r}; expected one of {BACKENDS}")
    caps = capabilities() if caps is None else caps
    if name == "auto":
        return auto_backend(caps)
    why = caps.reason(name)
    if why:
        kind = caps.device_kind or f"an unknown {caps.platform}"
        raise BackendUnavailableError(f"backend {name!r} cannot run on {kind!r}: {why}")
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


def backends_per_platform(backend: str, lhs_fmt, rhs_fmt, *,
                          where: str = "backend") -> dict[str, tuple[str, str]]:
    """{platform: (concrete backend, '') or ('', why it cannot run)} for 'cpu', 'gpu', 'tpu'.

    Each platform is resolved for its chip compiled for (:func:`capabilities` of that
    platform). A request that is wrong on every chip (an unknown backend, a kernel
    that lacks the formats) raises ValueError at once.
    """
    out = {}
    for platform in PLATFORM_FORMS:
        try:
            out[platform] = (backend_for_formats(backend, lhs_fmt, rhs_fmt, where=where,
                                                 caps=capabilities(platform)), "")
        except BackendUnavailableError as e:
            out[platform] = ("", f"{where}: {e}")
    return out


# An op standing for a GEMM that cannot run on the platform it is lowered for: it
# traces (every platform's branch is traced) and raises when lowered.
_unavailable_p = Primitive("mxjax_backend_unavailable")


def _unavailable_abstract_eval(*args, shape, dtype, reason):
    del args, reason
    return ShapedArray(shape, dtype)


def _unavailable_lowering(ctx, *args, shape, dtype, reason):
    del ctx, args, shape, dtype
    raise BackendUnavailableError(reason)


_unavailable_p.def_abstract_eval(_unavailable_abstract_eval)
mlir.register_lowering(_unavailable_p, _unavailable_lowering)


def unavailable(reason: str, shape: tuple[int, ...], dtype, *deps) -> jax.Array:
    """An array of `shape` and `dtype` whose lowering raises BackendUnavailableError(reason).

    ``deps``: arrays the op takes as operands (so that it sits where the GEMM would).
    """
    return _unavailable_p.bind(*deps, shape=tuple(shape), dtype=jnp.dtype(dtype),
                               reason=str(reason))


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
           platform: str | None = None, **tiles) -> jnp.ndarray:
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
      backend: 'xla' | 'xla_fp8' | 'pallas' | 'pallas_fp8' | 'triton' | 'auto' ('xla_fp4'
        raises: it is a GEMM recipe's backend only). 'auto' uses
        `auto_backend` and, for formats the chosen kernel lacks, 'xla'. An
        explicit kernel backend raises if it cannot run here or lacks the formats.
      interpret: force (or forbid) the Pallas interpreter; default: interpret unless
        compiling for a GPU.
      platform: the lowering platform this call is traced for ('cpu', 'gpu', 'tpu'; a
        branch of ``jax.lax.platform_dependent``); None: the chip compiled for.
      **tiles: block_m / block_n / block_k overrides for the kernel.
    """
    _check(lhs_q, rhs_q)
    caps = capabilities(platform)
    backend = backend_for_formats(backend, lhs_q.fmt, rhs_q.fmt, where="mx_dot", caps=caps)
    if interpret is None:
        interpret = caps.platform != "gpu"
    if len(lhs_q.shape) > 2 and backend not in ("xla_fp8", "xla_fp4"):
        return _batched(lhs_q, rhs_q, backend, interpret, tiles)
    if backend == "xla":
        return mx_dot_reference(lhs_q, rhs_q)
    if backend == "xla_fp8":
        return xla_fp8.mx_dot_fp8(lhs_q, rhs_q)
    if backend == "xla_fp4":
        raise ValueError("mx_dot: backend 'xla_fp4' quantizes canonical operands itself; it "
                         "runs as a GEMM recipe's backend (mxjax.dot_general), not on "
                         "MXArrays: use backend='xla' or 'xla_fp8' here")
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
