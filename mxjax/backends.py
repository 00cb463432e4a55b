"""The backends of a quantized GEMM: one registry of routes, and the one place that chooses.

Each backend is a route (`mxjax.routes`: 'xla' the emulation, 'xla_fp8', 'xla_fp4',
'xla_nvfp4', 'xla_mxfp8', 'triton'), whose module states which formats and chips it
serves, its GEMM and where its evidence is (`mxjax.routes.spec.Route`). :data:`ROUTES`
lists them; ``GemmRecipe.backend`` is one of :data:`BACKENDS` (their names and 'auto').

:func:`route_for` answers "which route runs this GEMM on this chip", and nothing else
does: 'auto' takes the chip's first :data:`AUTO_CHOICES` row whose route serves the
GEMM's formats (its evidence read from ``mxjax/measurements.json``), an explicit
backend that cannot run on the chip raises :class:`BackendUnavailableError` naming the
reason, and one that lacks the GEMM's formats raises ValueError; there is no silent
fallback. The chip is the one a program is compiled for (`mxjax.chips.target_chip`),
once per lowering platform: :func:`run_gemm` puts one branch per platform under
``jax.lax.platform_dependent``, so lowering keeps the branch of the platform it lowers
for, and a branch whose explicit backend cannot run there is an op that raises when
lowered (:func:`unavailable`). :func:`run_packed_rhs_gemm` does the same for a GEMM
whose rhs the forward pass quantized (``Route.packed_rhs_gemm``, `mxjax.residuals`).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir

from mxjax import formats as F
from mxjax import measurements
from mxjax._platform import per_platform
from mxjax.chips import PLATFORMS, Chip, target_chip
from mxjax.quantization import MXArray
from mxjax.routes import triton, xla, xla_fp4, xla_fp8, xla_mxfp8, xla_nvfp4
from mxjax.routes.spec import Route

__all__ = [
    "AUTO_CHOICES",
    "BACKENDS",
    "REMOVED_BACKENDS",
    "ROUTES",
    "AutoChoice",
    "BackendUnavailableError",
    "Capabilities",
    "auto_backend",
    "auto_choice",
    "capabilities",
    "capabilities_for",
    "check_backend_name",
    "chip_name",
    "mx_dot",
    "no_speedup_reason",
    "resolve_backend",
    "route_for",
    "routes_per_platform",
    "run_gemm",
    "run_packed_rhs_gemm",
    "unavailable",
]

ROUTES: dict[str, Route] = {r.name: r for r in (xla.ROUTE, xla_fp8.ROUTE, xla_fp4.ROUTE,
                                                xla_nvfp4.ROUTE, xla_mxfp8.ROUTE,
                                                triton.ROUTE)}
# Every name a GemmRecipe's backend may take: the routes' and 'auto' (the chip's choice).
BACKENDS: tuple[str, ...] = (*ROUTES, "auto")


# Backends that were removed, and why (docs/CHANGELOG.md has their figures).
REMOVED_BACKENDS: dict[str, str] = {
    "pallas": "the Pallas bf16 GEMM kernel was slower than the emulation on every chip",
    "pallas_fp8": "the Pallas FP8 GEMM kernel was slower than the emulation and 'xla_fp8'",
}


class BackendUnavailableError(RuntimeError):
    """An explicit backend cannot run on the chip compiled for (raised when lowering)."""


def check_backend_name(name, where: str = "backend") -> None:
    """ValueError unless `name` is one of :data:`BACKENDS` (the message, prefixed with
    `where`, names them, and says why a removed backend went)."""
    if isinstance(name, str) and name in BACKENDS:
        return
    if isinstance(name, str) and name in REMOVED_BACKENDS:
        raise ValueError(f"{where}: backend {name!r} was removed ({REMOVED_BACKENDS[name]}; "
                         f"docs/CHANGELOG.md); expected one of {BACKENDS}")
    raise ValueError(f"{where}: expected one of {BACKENDS}, got {name!r}")



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
               evidence=("layer_8b.b200.calibrated", "layer_8b.b200.rates_roofline",
                         "layer_8b.b200.triton_rates_roofline")),
    # Blackwell, NVFP4 and MXFP8 GEMMs (the rows above serve MXFP4 only): their own
    # formats on cuDNN's block-scaled MMA, estimated faster than the emulation.
    AutoChoice(platform="gpu", min_compute_capability=(10, 0), backend="xla_nvfp4",
               evidence=("layer_8b.b200.nvfp4_rates_roofline",)),
    AutoChoice(platform="gpu", min_compute_capability=(10, 0), backend="xla_mxfp8",
               evidence=("layer_8b.b200.mxfp8_rates_roofline",)),
    # Hopper: 'xla_fp8' (MXFP4 carried exactly in FP8) faster than the emulation, measured
    # and estimated.
    AutoChoice(platform="gpu", min_compute_capability=(9, 0), backend="xla_fp8",
               evidence=("layer_8b.h200.calibrated", "layer_8b.h200.measured",
                         "layer_8b.h200.rates_roofline")),
    AutoChoice(platform="gpu", backend="xla", evidence=("auto.gpu.other",)),
    AutoChoice(platform="tpu", backend="xla", evidence=("auto.tpu",)),
    AutoChoice(platform="cpu", backend="xla", evidence=("auto.cpu",)),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What one chip can run.

    Attributes:
      platform: 'cpu', 'gpu' or 'tpu'.
      device_kind: e.g. 'NVIDIA H200', 'cpu' ('' for an unknown GPU).
      compute_capability: (major, minor) on NVIDIA GPUs, else None.
      native_fp4: the device has block-scaled FP4 matrix units (Blackwell sm_100+,
        AMD MI355X / gfx950).
      fp8_tensor_cores: FP8 matrix units (sm_89+, or an FP4-capable part).
      jax_triton: jax_triton and triton are importable (the 'triton' route's packages).
      backends: (route name, reason) pairs, one per route of :data:`ROUTES`; reason is ''
        when the route can run here.
    """

    platform: str
    device_kind: str
    compute_capability: tuple[int, int] | None
    native_fp4: bool
    fp8_tensor_cores: bool
    jax_triton: bool
    backends: tuple[tuple[str, str], ...]

    def can_run(self, backend: str) -> bool:
        """Whether route `backend` can run here."""
        return self.reason(backend) == ""

    def reason(self, backend: str) -> str:
        """'' if route `backend` can run here, else why not."""
        for name, why in self.backends:
            if name == backend:
                return why
        raise ValueError(f"backend: unknown {backend!r}; expected one of {tuple(ROUTES)}")

    @property
    def runnable(self) -> tuple[str, ...]:
        """The routes that can run here."""
        return tuple(name for name, why in self.backends if not why)


def capabilities_for(chip: Chip) -> Capabilities:
    """What `chip` can run: each route's own answer (``Route.runs_on``)."""
    return Capabilities(
        platform=chip.platform,
        device_kind=chip.device_kind,
        compute_capability=chip.compute_capability,
        native_fp4=chip.native_fp4,
        fp8_tensor_cores=chip.fp8_units,
        jax_triton=all(importlib.util.find_spec(m) is not None
                       for m in ("triton", "jax_triton")),
        backends=tuple((name, route.runs_on(chip)) for name, route in ROUTES.items()),
    )


def capabilities(platform: str | None = None) -> Capabilities:
    """What the chip compiled for (`mxjax.chips.target_chip`) can run, on lowering
    `platform` ('cpu', 'gpu', 'cuda', 'rocm', 'tpu'; None: the target's own platform)."""
    return capabilities_for(target_chip(platform))


def auto_choice(caps: Capabilities, lhs_fmt=None, rhs_fmt=None) -> AutoChoice:
    """The :data:`AUTO_CHOICES` row for a chip: the first that matches it and, given the
    GEMM's operand formats, whose route serves them (``Route.serves``; 'xla' serves
    every format). Without formats, the chip's first row."""
    formats = lhs_fmt is not None and rhs_fmt is not None
    for row in AUTO_CHOICES:
        if row.platform != caps.platform:
            continue
        if row.min_compute_capability is None or (
                caps.compute_capability is not None
                and caps.compute_capability >= row.min_compute_capability):
            if formats and not ROUTES[row.backend].serves(lhs_fmt, rhs_fmt):
                continue
            return row
    raise ValueError(f"no AUTO_CHOICES row for platform {caps.platform!r}")


def auto_backend(caps: Capabilities, lhs_fmt=None, rhs_fmt=None) -> str:
    """The backend 'auto' picks on a chip (for a GEMM of these operand formats, if
    given): its :data:`AUTO_CHOICES` row's, when that can run there, else 'xla' (which
    runs everywhere)."""
    backend = auto_choice(caps, lhs_fmt, rhs_fmt).backend
    return backend if caps.can_run(backend) else "xla"


def resolve_backend(name: str, caps: Capabilities | None = None, lhs_fmt=None,
                    rhs_fmt=None) -> str:
    """Maps a backend name to a route that can run on the chip compiled for.

    'auto' picks with `auto_backend` (for the GEMM's operand formats, when given). An
    explicit backend that cannot run on the chip raises :class:`BackendUnavailableError`
    (a RuntimeError) with the reason (no silent fallback). ``caps``: the chip's
    capabilities (default: :func:`capabilities`, the target of the trace in progress).
    """
    check_backend_name(name)
    caps = capabilities() if caps is None else caps
    if name == "auto":
        return auto_backend(caps, lhs_fmt, rhs_fmt)
    why = caps.reason(name)
    if why:
        kind = caps.device_kind or f"an unknown {caps.platform}"
        raise BackendUnavailableError(f"backend {name!r} cannot run on {kind!r}: {why}")
    return name


def route_for(backend: str, lhs_fmt, rhs_fmt, *, where: str = "backend",
              caps: Capabilities | None = None) -> Route:
    """The route that runs an ``lhs_fmt x rhs_fmt`` GEMM under `backend` on a chip.

    Resolves `backend` (:func:`resolve_backend`; ``caps`` default: the chip compiled
    for). 'auto' takes the chip's first :data:`AUTO_CHOICES` row whose route implements
    the formats (``Route.serves``; the 'xla' rows serve every format). An explicit route
    that does not implement them raises ValueError (message prefixed with `where`) when it
    was asked for explicitly: no silent fallback.
    """
    check_backend_name(backend)
    if backend == "xla":  # runs everything everywhere: no chip to ask
        return ROUTES["xla"]
    if backend == "auto":  # the chip's row for these formats
        return ROUTES[resolve_backend(backend, caps, lhs_fmt, rhs_fmt)]
    route = ROUTES[resolve_backend(backend, caps)]
    if route.serves(lhs_fmt, rhs_fmt):
        return route
    each = " | ".join(f.upper() for f in route.formats)
    pairs = f"{each} x {each}" if len(route.formats) == 1 else f"({each}) x ({each})"
    raise ValueError(
        f"{where}: backend {backend!r} implements {pairs} only, "
        f"got {F.get(lhs_fmt).name} x {F.get(rhs_fmt).name}; use backend='xla' or 'auto'"
    )


def chip_name(caps: Capabilities) -> str:
    """The chip in words for messages: its device kind ('NVIDIA B200', 'cpu'), or 'an
    unknown <platform>'."""
    return caps.device_kind or f"an unknown {caps.platform}"


def _where_auto_takes(backend: str) -> str:
    rows = [r for r in AUTO_CHOICES if r.backend == backend]
    if not rows:
        return f"no chip's 'auto' takes {backend!r}"
    return "it pays off where 'auto' takes it: " + "; ".join(
        f"{r.platform.upper()}s" + (
            f" of compute capability {r.min_compute_capability[0]}.{r.min_compute_capability[1]}"
            " and up" if r.min_compute_capability else "") for r in rows)


def no_speedup_reason(backend: str, lhs_fmt, rhs_fmt, *, caps: Capabilities | None = None,
                      where: str = "backend") -> str:
    """'' unless an explicit `backend` runs an ``lhs_fmt x rhs_fmt`` GEMM on a route other
    than the emulation on a chip whose 'auto' takes the emulation ('xla') for that GEMM;
    otherwise why it gives no speed-up there and what to use (one paragraph).

    There the route computes what the emulation computes, no faster: e.g. on a CPU the FP8
    and FP4 routes run XLA:CPU's expansion of their dots (that is how their numerics are
    tested). `mxjax.dot_general` runs such a backend as asked; the training CLI refuses it
    (`train.plan`), where the only point of a route is speed. A backend that cannot run at
    all raises as :func:`route_for` does. ``caps``: the chip (default: the one compiled for).
    """
    if backend in ("xla", "auto"):
        return ""
    caps = capabilities() if caps is None else caps
    route = route_for(backend, lhs_fmt, rhs_fmt, where=where, caps=caps)
    auto = route_for("auto", lhs_fmt, rhs_fmt, caps=caps)
    if route is ROUTES["xla"] or auto is not ROUTES["xla"]:
        return ""
    evidence = ", ".join(auto_choice(caps, lhs_fmt, rhs_fmt).evidence)
    return (f"{where}: backend {backend!r} gives no speed-up on {chip_name(caps)!r}: "
            "'auto' takes the emulation ('xla') for this GEMM there "
            f"(mxjax.backends.AUTO_CHOICES, evidence {evidence}), and "
            f"{backend!r} would compute the same values no faster"
            + (" (XLA:CPU expands its FP8/FP4 dot into ordinary arithmetic)"
               if caps.platform == "cpu" else "")
            + f". Use backend 'auto' (the chip's fastest exact route) or 'xla' here; "
            f"{_where_auto_takes(backend)}.")


def routes_per_platform(backend: str, lhs_fmt, rhs_fmt, *,
                        where: str = "backend") -> dict[str, tuple[Route | None, str]]:
    """{platform: (route, '') or (None, why it cannot run)} for 'cpu', 'gpu', 'tpu'.

    Each platform is resolved for its chip compiled for (:func:`capabilities` of that
    platform). A request that is wrong on every chip (an unknown backend, a route that
    lacks the formats) raises ValueError at once.
    """
    out = {}
    for platform in PLATFORMS:
        try:
            out[platform] = (route_for(backend, lhs_fmt, rhs_fmt, where=where,
                                       caps=capabilities(platform)), "")
        except BackendUnavailableError as e:
            out[platform] = (None, f"{where}: {e}")
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


def run_gemm(a: jax.Array, b: jax.Array, *, dims, recipe, key, gemm_name: str,
             operand_dtypes=None, out_dtype=None) -> jax.Array:
    """One quantized GEMM on the route `recipe.backend` resolves to, per lowering platform.

    Same operands, keys and rotation on every route. ``dims``: the GEMM's `Dims`;
    ``key``: the GEMM's key (None unless the recipe needs one); ``gemm_name``: 'fprop',
    'dgrad' or 'wgrad' (error messages name it, and a route may choose by it: 'xla_fp8'
    asks for fast accumulation in fprop only); ``operand_dtypes``: the GEMM is that of the
    operands cast to these (or None); ``out_dtype``: the result's dtype (None: f32).
    Returns ``[batch..., Fa, Fb]`` (free axes flattened). Where every platform resolves
    to the emulation it runs alone; otherwise each platform gets its route's GEMM, or an
    op that raises when lowered where the explicit backend cannot run.
    """
    return _run_per_platform("gemm", a, b, dims=dims, recipe=recipe, key=key,
                             gemm_name=gemm_name, operand_dtypes=operand_dtypes,
                             out_dtype=out_dtype)


def run_packed_rhs_gemm(a: jax.Array, packed_q: MXArray, *, b_shape, dims, recipe, key,
                        gemm_name: str, operand_dtypes=None, out_dtype=None) -> jax.Array:
    """:func:`run_gemm` with the rhs given quantized (``Route.packed_rhs_gemm``), per
    lowering platform.

    ``packed_q``: the canonical MXArray of the rhs (`mxjax.residuals.pack_rhs`;
    ``operand_dtypes[1]`` already applied); ``b_shape``: the rhs's shape. Every platform's
    route must have a ``packed_rhs_gemm`` (`mxjax.residuals.saves_packed` packs only then):
    ValueError otherwise. The same result as :func:`run_gemm` of the primal rhs.
    """
    return _run_per_platform("packed_rhs_gemm", a, packed_q, b_shape=tuple(b_shape),
                             dims=dims, recipe=recipe, key=key, gemm_name=gemm_name,
                             operand_dtypes=operand_dtypes, out_dtype=out_dtype)


def _route_fn(route: Route, field: str, gemm_name: str):
    fn = getattr(route, field)
    if fn is None:
        raise ValueError(f"{gemm_name}: route {route.name!r} has no {field} "
                         f"(mxjax.routes.spec.Route.{field})")
    return fn


def _run_per_platform(field: str, a, b, *, recipe, gemm_name: str, **kw) -> jax.Array:
    """``Route.<field>(a, b, **kw)`` ('gemm' or 'packed_rhs_gemm') of the route each lowering
    platform resolves to (the emulation alone where every platform takes it)."""
    kw = {"recipe": recipe, "gemm_name": gemm_name, **kw}

    def emulation(a, b, **kw):
        return _route_fn(ROUTES["xla"], field, gemm_name)(a, b, **kw)

    if recipe.backend == "xla":
        return emulation(a, b, **kw)
    choices = routes_per_platform(recipe.backend, recipe.lhs.fmt, recipe.rhs.fmt,
                                  where=gemm_name)
    if all(route is ROUTES["xla"] for route, _ in choices.values()):
        return emulation(a, b, **kw)
    out = jax.eval_shape(lambda a, b: emulation(a, b, **kw), a, b)

    def branch(platform):
        route, why = choices[platform]
        if why:
            return lambda a, b: unavailable(why, out.shape, out.dtype,
                                            *jax.tree.leaves((a, b)))
        fn = _route_fn(route, field, gemm_name)
        return lambda a, b: fn(a, b, platform=platform, **kw)

    return per_platform(a, b, cpu=branch("cpu"), gpu=branch("gpu"), tpu=branch("tpu"))


def _check_operands(lhs_q, rhs_q):
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


def mx_dot(lhs_q: MXArray, rhs_q: MXArray, *, backend: str = "xla",
           platform: str | None = None, **tiles) -> jax.Array:
    """f32[lhs free, rhs free]: contracts the block axes of two 2-D quantized operands.

    The contraction runs along lhs_q.axis and rhs_q.axis (each operand's block
    axis): lhs (M, K) with axis=1 or (K, M) with axis=0; rhs (K, N) with axis=0
    or (N, K) with axis=1. The result is (M, N) f32 and equals (up to fp32
    summation order, see ``mxjax.kernels.GEMM_TOLERANCE_DOC``) the dot of the
    dequantized operands. Batched operands [batch..., M, K] and [batch..., N, K] (same
    batch shape, blocked along the last axis) give f32[batch..., M, N].

    Args:
      lhs_q, rhs_q: MXArrays from mxjax.quantize / mxjax.kernels.fused_quantize. 'xla'
        takes any quantized format; the other routes MXFP4 x MXFP4.
      backend: a route with a packed-operand dot ('xla', 'xla_fp8', 'triton') or 'auto'
        (the chip's route, and 'xla' for formats it lacks). 'xla_fp4' raises: it
        quantizes its own operands. An explicit route raises if it cannot run here or
        lacks the formats.
      platform: the lowering platform this call is traced for ('cpu', 'gpu', 'tpu'; a
        branch of ``jax.lax.platform_dependent``); None: the chip compiled for.
      **tiles: block_m / block_n / block_k overrides for the Triton kernel.
    """
    _check_operands(lhs_q, rhs_q)
    route = route_for(backend, lhs_q.fmt, rhs_q.fmt, where="mx_dot",
                      caps=capabilities(platform))
    if route.packed_dot is None:
        with_dot = tuple(name for name, r in ROUTES.items() if r.packed_dot is not None)
        raise ValueError(f"mx_dot: backend {route.name!r} quantizes canonical operands "
                         "itself; it runs as a GEMM recipe's backend (mxjax.dot_general), "
                         f"not on MXArrays: use one of {with_dot} here")
    return route.packed_dot(lhs_q, rhs_q, platform=platform, **tiles)
