"""Numerics diagnostics: what quantization does to each GEMM, and to training.

Three parts, all opt-in:

1. **Quantization statistics** (pure ``jnp``, jit-friendly). For one operand
   ``x`` and its quantization ``q`` (an :class:`mxjax.MXArray`), see
   :func:`operand_stats`:

   ``rel_err``
       ``‖Q(x) − x‖₂ / ‖x‖₂`` over all elements (0 when ``x`` is all zero).
   ``underflow``
       fraction of the nonzero elements of ``x`` whose quantized value is zero
       (±0). "Nonzero" is decided on the bit pattern, so fp32 subnormals count.
   ``saturation``
       fraction of the nonzero elements of ``x`` that are *clipped*: the scaled
       value the element rounding sees, ``|y| = |x| / d`` (times 3/4 with the SR
       pre-scale), lies strictly above the element format's max normal (6 for
       E2M1), so the quantizer returns ±max_normal·d instead of rounding. ``d``
       is the block's decode scale (``2^s`` for E8M0 scales, ``block_scale ·
       tensor_scale`` for NVFP4, ``tensor_scale`` for per-tensor FP8). A value
       that merely rounds *to* max_normal (E2M1: 5 < |y| ≤ 6) is not saturated.
       With the FLOOR scale rule |y| < 8, so the values in (6, 8) of a block
       clip; EVEN clips (6, 7); CEIL and RCEIL never clip.
   ``scale_log2_min/max/mean/std``
       statistics of ``log2 d`` over the blocks that hold a nonzero value and
       have a finite nonzero ``d`` (for E8M0: the exact integer exponent
       ``byte − 127``; a per-tensor format has one block, std 0).

   Denominators that would be zero give 0. NaN/Inf inputs propagate into
   ``rel_err`` and the scale statistics (a NaN block's scale is NaN).

2. **Collection inside the jitted step** (no ``jax.debug.print``, no host
   callbacks). Each quantized ``dot_general`` call gets an extra, otherwise
   unused, differentiable *probe* ``f32[3, N_GEMM_FIELDS]`` (zeros):
   :func:`probed_call` wraps the interceptor's custom-VJP GEMM in a second
   custom VJP whose forward records the fprop stats and whose backward records
   the dgrad/wgrad stats (the GEMM backend calls :func:`record_gemm` with the
   operands it is about to quantize) and returns ``stack([fprop, dgrad,
   wgrad])`` as the probe's cotangent. The gradient of the loss with respect
   to the probes is then the stats of every GEMM of the step, an auxiliary
   output of the same ``value_and_grad`` (:func:`value_and_grad_with_stats`),
   through ``scan`` (summed over layers), ``remat`` and gradient accumulation
   (summed over micro-batches). Every row carries ``count = 1`` so sums divide
   back into means. The stats only *read* the GEMM's inputs (they re-quantize
   them bit-identically, and compute the cosine from that copy), so the
   GEMM's own program is unchanged and losses and gradients are bit-identical
   with diagnostics on. With diagnostics off there is no probe, and
   :func:`next_probe`/:func:`record_gemm` add nothing to the program: the
   interceptor traces exactly what it traces without this module.

   Protocol: the caller wraps its loss function with :func:`instrument` (or
   uses :func:`value_and_grad_with_stats`), which makes a ``probes
   f32[n_slots, 3, N_GEMM_FIELDS]`` argument available while the loss is
   traced; the interceptor calls :func:`next_probe` once per ``dot_general``
   call (``None`` when diagnostics are off) and then :func:`probed_call`.
   Slots are handed out in trace order; :func:`count_slots` finds ``n_slots``
   with an abstract trace. A GEMM traced once inside ``scan`` gets one slot
   for all iterations (its stats are summed over layers; ``count`` says how
   many).

3. **Training dynamics** (host or device): per-layer gradient norms
   (:func:`layer_norms`), gradient-collapse rate (:func:`collapse_rate`, layers
   with grad norm < 1e-6), weight-update size relative to the weight
   (:func:`relative_update`), and the instability detector
   (:class:`InstabilityDetector`, a pure state machine driven from the host).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mxjax import _bits
from mxjax import formats as F
from mxjax.quantization import SR_PRESCALE, MXArray, decode_magnitude, dequantize, quantize

__all__ = [
    "GEMM_FIELDS",
    "GEMM_NAMES",
    "N_GEMM_FIELDS",
    "OPERAND_STATS",
    "DiagnosticsConfig",
    "InstabilityConfig",
    "InstabilityDetector",
    "InstabilityState",
    "collapse_rate",
    "collect",
    "cosine_similarity",
    "count_slots",
    "expand_layers",
    "gemm_stats",
    "init_probes",
    "instrument",
    "layer_norms",
    "next_probe",
    "operand_stats",
    "operand_stats_vector",
    "probed_call",
    "quantized_operand_stats",
    "record_gemm",
    "relative_update",
    "summarize_probes",
    "value_and_grad_with_stats",
]

# --------------------------------------------------------------------------- #
# 1. Quantization statistics
# --------------------------------------------------------------------------- #
OPERAND_STATS: tuple[str, ...] = (
    "rel_err",
    "underflow",
    "saturation",
    "scale_log2_min",
    "scale_log2_max",
    "scale_log2_mean",
    "scale_log2_std",
)
GEMM_NAMES: tuple[str, ...] = ("fprop", "dgrad", "wgrad")
# One row per GEMM: a call count, the lhs and rhs operand stats, the output cosine.
GEMM_FIELDS: tuple[str, ...] = (
    ("count",)
    + tuple(f"lhs_{s}" for s in OPERAND_STATS)
    + tuple(f"rhs_{s}" for s in OPERAND_STATS)
    + ("cosine",)
)
N_GEMM_FIELDS = len(GEMM_FIELDS)


def _safe_ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, 0 where den == 0; NaN propagates."""
    zero = den == 0
    return jnp.where(zero, 0.0, num / jnp.where(zero, 1.0, den)).astype(jnp.float32)


def _blocks_last(a: jax.Array, axis: int, block: int) -> jax.Array:
    """Moves `axis` last, zero-pads it to a multiple of `block`, splits [..., nb, block]."""
    am = jnp.moveaxis(a, axis, -1)
    pad = (-am.shape[-1]) % block
    if pad:
        am = jnp.pad(am, [(0, 0)] * (am.ndim - 1) + [(0, pad)])
    return am.reshape(am.shape[:-1] + (am.shape[-1] // block, block))


def _nonzero(a: jax.Array) -> jax.Array:
    """|a| != 0 on the f32 bit pattern (subnormals count as nonzero)."""
    return (_bits.f32_bits(a) & _bits.ABS_MASK) != 0


def _scale_summary(log2d: jax.Array, valid: jax.Array) -> list[jax.Array]:
    """min/max/mean/std of log2d over `valid` entries (0s when there are none)."""
    # One materialized value for every consumer (XLA may otherwise evaluate log2 once
    # per fusion, with slightly different approximations).
    log2d, valid = jax.lax.optimization_barrier((log2d.astype(jnp.float32), valid))
    n = jnp.sum(valid.astype(jnp.float32))
    big = jnp.float32(3.0e38)
    lo = jnp.min(jnp.where(valid, log2d, big))
    hi = jnp.max(jnp.where(valid, log2d, -big))
    v = jnp.where(valid, log2d, 0.0)
    mean = _safe_ratio(jnp.sum(v), n)
    var = _safe_ratio(jnp.sum(jnp.where(valid, jnp.square(log2d - mean), 0.0)), n)
    has = n > 0
    return [jnp.where(has, lo, 0.0), jnp.where(has, hi, 0.0), mean, jnp.sqrt(var)]


def operand_stats(x: jax.Array, q: MXArray, xq: jax.Array | None = None) -> dict[str, jax.Array]:
    """Quantization statistics of one operand (definitions in the module docstring).

    Args:
      x: f32/bf16/f16 array, the values that were quantized (any shape).
      q: ``mxjax.quantize(x, ...)``: its codes, scales and tensor scale.
      xq: ``dequantize(q)`` if already at hand (f32, x's shape); computed otherwise.
    Returns:
      dict name -> f32 scalar, keys :data:`OPERAND_STATS`.
    """
    if not isinstance(q, MXArray):
        raise TypeError(f"q: expected an MXArray, got {type(q).__name__}")
    if tuple(x.shape) != tuple(q.shape):
        raise ValueError(f"x: shape {tuple(x.shape)} differs from the quantized shape {q.shape}")
    fmt, elem = q.fmt, q.fmt.element
    xf = x.astype(jnp.float32)
    if xq is None:
        xq = dequantize(q, jnp.float32)
    xq = xq.astype(jnp.float32)
    nz = _nonzero(xf)
    n_nz = jnp.sum(nz.astype(jnp.float32))
    rel_err = _safe_ratio(jnp.sqrt(jnp.sum(jnp.square(xq - xf))), jnp.sqrt(jnp.sum(jnp.square(xf))))
    underflow = _safe_ratio(jnp.sum((nz & ~_nonzero(xq)).astype(jnp.float32)), n_nz)
    prescale = jnp.float32(SR_PRESCALE) if q.sr_prescale else None
    max_normal = jnp.float32(elem.max_normal)

    if fmt.is_per_tensor:
        t = q.tensor_scale.astype(jnp.float32)
        y = jnp.abs(_bits.exact_div(xf, jnp.where(jnp.isfinite(t), t, 1.0)))
        if prescale is not None:
            y = y * prescale
        clipped = nz & (y > max_normal)
        log2d = jnp.log2(t)[None]
        valid = (n_nz > 0)[None]
    else:
        xb = _blocks_last(xf, q.axis, fmt.block_size)  # [..., nb, block]
        sb = jnp.moveaxis(q.scales, q.axis, -1).astype(jnp.int32)  # [..., nb]
        valid = jnp.any(_nonzero(xb), axis=-1)  # blocks holding a nonzero (or NaN) value
        if fmt.scale == "e8m0":
            s = sb - 127
            y = jnp.abs(_bits.ldexp(xb, -s[..., None]))
            log2d = jnp.where(sb == 255, jnp.float32(jnp.nan), s.astype(jnp.float32))
        else:  # NVFP4: E4M3 block scale times the fp32 tensor scale
            d = decode_magnitude(sb, F.E4M3) * q.tensor_scale.astype(jnp.float32)
            pos = d > 0
            y = jnp.abs(_bits.exact_div(xb, jnp.where(pos, d, 1.0)[..., None]))
            y = jnp.where(pos[..., None], y, 0.0)  # d == 0: everything underflows
            log2d = jnp.where(pos, jnp.log2(jnp.where(pos, d, 1.0)), d)  # NaN stays NaN
            valid = valid & (pos | jnp.isnan(d))
        if prescale is not None:
            y = y * prescale
        clipped = _nonzero(xb) & (y > max_normal)
    saturation = _safe_ratio(jnp.sum(clipped.astype(jnp.float32)), n_nz)
    lo, hi, mean, std = _scale_summary(log2d, valid)
    return dict(zip(OPERAND_STATS, (rel_err, underflow, saturation, lo, hi, mean, std)))


def operand_stats_vector(x: jax.Array, q: MXArray, xq: jax.Array | None = None) -> jax.Array:
    """:func:`operand_stats` as f32[len(OPERAND_STATS)] in that order."""
    d = operand_stats(x, q, xq)
    return jnp.stack([d[k] for k in OPERAND_STATS]).astype(jnp.float32)


def _requantize(x: jax.Array, recipe: Any, axis: int, key: jax.Array | None):
    """(MXArray | None, dequantized f32) of ``x`` under an OperandRecipe (None: pass-through)."""
    fmt = F.get(recipe.fmt)
    if fmt.is_passthrough:
        return None, x.astype(jnp.float32)
    q = quantize(x, fmt, axis, scale_rule=recipe.scale_rule, rounding=recipe.rounding,
                 key=key if recipe.rounding is F.Rounding.STOCHASTIC else None,
                 sr_prescale=recipe.sr_prescale)
    return q, dequantize(q, jnp.float32)


def quantized_operand_stats(x: jax.Array, recipe: Any, axis: int, key: jax.Array | None = None
                            ) -> jax.Array:
    """Stats vector of ``x`` quantized under an operand recipe (re-quantizes ``x``).

    Args:
      x: the operand exactly as the GEMM hands it to the quantizer (after any
        Hadamard rotation; padding with zeros does not change the stats).
      recipe: an ``mxjax.policy.OperandRecipe`` (fmt, scale_rule, rounding,
        sr_prescale). A pass-through (BF16) recipe gives all zeros.
      axis: the block axis used by the GEMM.
      key: the same PRNG key the GEMM used (STOCHASTIC rounding), so the
        re-quantization reproduces the GEMM's values bit for bit.
    Returns:
      f32[len(OPERAND_STATS)].
    """
    q, xq = _requantize(x, recipe, axis, key)
    if q is None:
        return jnp.zeros((len(OPERAND_STATS),), jnp.float32)
    return operand_stats_vector(x, q, xq)


def cosine_similarity(a: jax.Array, b: jax.Array) -> jax.Array:
    """Cosine of the angle between flattened ``a`` and ``b`` (f32 scalar).

    1 when both are all zero, 0 when exactly one is.
    """
    af = a.astype(jnp.float32).ravel()
    bf = b.astype(jnp.float32).ravel()
    na = jnp.sqrt(jnp.sum(af * af))
    nb = jnp.sqrt(jnp.sum(bf * bf))
    both_zero = (na == 0) & (nb == 0)
    cos = _safe_ratio(jnp.sum(af * bf), na * nb)
    return jnp.where(both_zero, jnp.float32(1.0), cos)


def _gemm_last(a: jax.Array, b: jax.Array) -> jax.Array:
    """[batch..., Fa, K] x [batch..., Fb, K] -> [batch..., Fa, Fb], f32, HIGHEST."""
    nb = a.ndim - 2
    dims = (((nb + 1,), (nb + 1,)), (tuple(range(nb)), tuple(range(nb))))
    return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


def gemm_stats(
    *,
    lhs: jax.Array,
    rhs: jax.Array,
    lhs_recipe: Any,
    rhs_recipe: Any,
    lhs_key: jax.Array | None = None,
    rhs_key: jax.Array | None = None,
    cosine: bool = True,
) -> jax.Array:
    """One GEMM's row of stats, f32[N_GEMM_FIELDS] (layout :data:`GEMM_FIELDS`).

    Args:
      lhs, rhs: the operands as handed to the quantizer, in the canonical GEMM
        layout ``[batch..., F, K]`` (same batch dims, contraction K last, after
        any Hadamard rotation); blocks run along K.
      lhs_recipe, rhs_recipe: their ``OperandRecipe``.
      lhs_key, rhs_key: the PRNG keys the GEMM used for their rounding (or None).
      cosine: also compute the cosine between the quantized product and the
        exact one (two extra GEMMs at HIGHEST precision, computed from this
        function's own bit-identical re-quantization so the GEMM's own output is
        never touched). The exact product of rotated operands equals that of the
        unrotated ones (the rotation is orthogonal). 0 when not computed.
    """
    if lhs.ndim < 2 or lhs.ndim != rhs.ndim or lhs.shape[-1] != rhs.shape[-1] \
            or lhs.shape[:-2] != rhs.shape[:-2]:
        raise ValueError(f"lhs, rhs: expected [batch..., F, K] operands with the same batch "
                         f"dims and K, got {tuple(lhs.shape)} and {tuple(rhs.shape)}")
    lq, lxq = _requantize(lhs, lhs_recipe, -1, lhs_key)
    rq, rxq = _requantize(rhs, rhs_recipe, -1, rhs_key)
    zeros = jnp.zeros((len(OPERAND_STATS),), jnp.float32)
    ls = zeros if lq is None else operand_stats_vector(lhs, lq, lxq)
    rs = zeros if rq is None else operand_stats_vector(rhs, rq, rxq)
    if cosine:
        cos = cosine_similarity(_gemm_last(lxq, rxq), _gemm_last(lhs, rhs))
    else:
        cos = jnp.float32(0.0)
    return jnp.concatenate([jnp.ones((1,), jnp.float32), ls, rs, cos[None]])


# --------------------------------------------------------------------------- #
# 2. Collection: probes threaded through the interceptor's custom VJP
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True, kw_only=True)
class DiagnosticsConfig:
    """What the instrumented step records.

    Attributes:
      cosine: also compute each GEMM's output cosine vs the exact product (two
        extra high-precision GEMMs per quantized GEMM, see :func:`gemm_stats`).
    """

    cosine: bool = True

    def __post_init__(self):
        if not isinstance(self.cosine, bool):
            raise TypeError(f"DiagnosticsConfig: cosine must be a bool, got {self.cosine!r}")


class _Recorder:
    def __init__(self, probes: jax.Array | None, config: DiagnosticsConfig):
        self.probes = probes
        self.config = config
        self.n = 0


_ACTIVE: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    "mxjax_diagnostics_recorder", default=None)


@contextlib.contextmanager
def collect(probes: jax.Array | None, config: DiagnosticsConfig | None = None):
    """Makes ``probes`` (f32[n_slots, 3, N_GEMM_FIELDS]) available to :func:`next_probe`.

    Enter it *inside* the function being traced and differentiated (that is
    what :func:`instrument` does), so jit caches key on the probes argument.
    ``probes=None`` is counting mode: slots are handed out as fresh zeros
    (used by :func:`count_slots` under ``jax.eval_shape``).
    """
    config = DiagnosticsConfig() if config is None else config
    if probes is not None and (probes.ndim != 3 or tuple(probes.shape[1:]) != (3, N_GEMM_FIELDS)):
        raise ValueError(
            f"probes: expected shape [n_slots, 3, {N_GEMM_FIELDS}], got {tuple(probes.shape)}")
    rec = _Recorder(probes, config)
    token = _ACTIVE.set(rec)
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)


def next_probe() -> tuple[jax.Array, DiagnosticsConfig] | None:
    """For the interceptor: the next probe slot, or None when diagnostics are off.

    Call it once per quantized ``dot_general`` call, at trace time, outside any
    inner ``jit``. Returns ``(probe f32[3, N_GEMM_FIELDS], config)``: pass the
    probe into the ``custom_vjp`` as an extra differentiable argument (ignored
    by the forward), and return ``stack([fprop, dgrad, wgrad])`` rows from
    :func:`gemm_stats` as its cotangent. Keep ``config`` static (closure).
    """
    rec = _ACTIVE.get()
    if rec is None:
        return None
    i = rec.n
    rec.n += 1
    if rec.probes is None:
        return jnp.zeros((3, N_GEMM_FIELDS), jnp.float32), rec.config
    if i >= rec.probes.shape[0]:
        raise RuntimeError(
            f"diagnostics: the step traced more quantized GEMMs ({i + 1}) than probe slots "
            f"({rec.probes.shape[0]}); size the probes with count_slots() on the same function")
    return rec.probes[i], rec.config


class _Sink:
    """Rows recorded by :func:`record_gemm` while a probed call's fwd or bwd is traced."""

    def __init__(self, config: DiagnosticsConfig):
        self.config = config
        self.rows: dict[str, jax.Array] = {}

    def row(self, gemm_name: str) -> jax.Array:
        return self.rows.get(gemm_name, jnp.zeros((N_GEMM_FIELDS,), jnp.float32))


_SINK: contextvars.ContextVar[_Sink | None] = contextvars.ContextVar(
    "mxjax_diagnostics_sink", default=None)


@contextlib.contextmanager
def _sink(config: DiagnosticsConfig):
    s = _Sink(config)
    token = _SINK.set(s)
    try:
        yield s
    finally:
        _SINK.reset(token)


def record_gemm(gemm_name: str, lhs: jax.Array, rhs: jax.Array, recipe: Any,
                lhs_key: jax.Array | None, rhs_key: jax.Array | None) -> None:
    """For a GEMM backend: record this GEMM's stats if a probed call is being traced.

    A no-op (adds nothing to the program) unless called while :func:`probed_call`
    traces its forward or backward. ``gemm_name``: 'fprop', 'dgrad' or 'wgrad';
    ``lhs``/``rhs``: the operands as handed to the quantizer, ``[batch..., F,
    K]`` with blocks along K (after Hadamard); ``recipe``: the ``GemmRecipe``;
    the keys: those of the two roundings (None unless STOCHASTIC). Only reads
    its inputs (never the GEMM's output), so XLA compiles the GEMM itself the
    same way with or without diagnostics.
    """
    s = _SINK.get()
    if s is None:
        return
    if gemm_name not in GEMM_NAMES:
        raise ValueError(f"gemm_name: expected one of {GEMM_NAMES}, got {gemm_name!r}")
    row = gemm_stats(lhs=lhs, rhs=rhs, lhs_recipe=recipe.lhs, rhs_recipe=recipe.rhs,
                     lhs_key=lhs_key, rhs_key=rhs_key, cosine=s.config.cosine)
    s.rows[gemm_name] = s.row(gemm_name) + row


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _probed(fn, config, probe, args):
    del probe, config
    return fn(*args)


def _probed_fwd(fn, config, probe, args):
    del probe
    with _sink(config) as s:
        y, vjp = jax.vjp(fn, *args)
    return y, (vjp, s.row("fprop"))


def _probed_bwd(fn, config, res, g):
    vjp, fprop = res
    with _sink(config) as s:
        cts = vjp(g)
    stats = jnp.stack([fprop, s.row("dgrad"), s.row("wgrad")])
    return stats, tuple(cts)


_probed.defvjp(_probed_fwd, _probed_bwd)


def probed_call(fn: Callable[..., jax.Array], slot: tuple[jax.Array, DiagnosticsConfig],
                *args: jax.Array) -> jax.Array:
    """For the interceptor: ``fn(*args)`` whose GEMM stats flow into the probe's cotangent.

    ``fn`` is the quantized GEMM with a custom VJP (its backends call
    :func:`record_gemm`); ``slot`` comes from :func:`next_probe`; ``args`` are
    all of its array arguments, PRNG keys included (``fn`` may close over
    static Python values only: a closed-over array of an inner trace, e.g. a
    key folded inside ``scan``, would leak into the backward pass). The value
    is ``fn(*args)`` unchanged and so are the cotangents of ``args``; the
    probe's cotangent is ``stack([fprop, dgrad, wgrad])`` rows (zeros for a GEMM
    that recorded nothing, e.g. a pass-through one).
    """
    probe, config = slot
    return _probed(fn, config, probe, tuple(args))


def instrument(fn: Callable[..., Any], config: DiagnosticsConfig | None = None
               ) -> Callable[..., Any]:
    """``fn(*a, **k)`` -> ``g(probes, *a, **k)`` that traces ``fn`` with probes active.

    Differentiate ``g`` with respect to ``probes`` as well as the parameters:
    ``d loss / d probes`` (f32[n_slots, 3, N_GEMM_FIELDS]) holds the stats of
    every quantized GEMM of the call. ``g`` returns exactly what ``fn`` returns.
    """
    def g(probes, *args, **kwargs):
        with collect(probes, config):
            return fn(*args, **kwargs)

    g.__name__ = getattr(fn, "__name__", "instrumented")
    return g


def value_and_grad_with_stats(loss_fn: Callable[..., tuple[jax.Array, Any]],
                              config: DiagnosticsConfig | None = None, *,
                              aux_key: str = "gemm_stats") -> Callable[..., Any]:
    """``jax.value_and_grad(loss_fn, has_aux=True)`` plus the stats of every quantized GEMM.

    ``loss_fn(params, *args) -> (loss, aux)`` with ``aux`` a dict. The returned
    function has the same signature and result structure,
    ``((loss, aux), grads)``, with ``aux[aux_key] = f32[n_slots, 3,
    N_GEMM_FIELDS]`` added (summed stats; divide by the ``count`` field). The
    probes are sized by an abstract trace of ``loss_fn`` at trace time, so it
    works inside ``jit``/``scan`` without knowing the model. Loss and grads are
    those of the plain ``value_and_grad``.
    """
    def vg(params, *args, **kwargs):
        def plain(p):
            return loss_fn(p, *args, **kwargs)

        probes = init_probes(count_slots(plain, params))
        inst = instrument(plain, config)
        (loss, aux), (g_probes, grads) = jax.value_and_grad(inst, argnums=(0, 1), has_aux=True)(
            probes, params)
        if not isinstance(aux, Mapping):
            raise TypeError(f"loss_fn: aux must be a dict to carry {aux_key!r}, got "
                            f"{type(aux).__name__}")
        if aux_key in aux:
            raise ValueError(f"aux_key: loss_fn's aux already has a {aux_key!r} entry")
        return (loss, {**aux, aux_key: g_probes}), grads

    return vg


def count_slots(fn: Callable[..., Any], *args, **kwargs) -> int:
    """Number of probe slots ``fn(*args, **kwargs)`` uses (abstract trace, no compute)."""
    box = {}

    def counting(*a, **k):
        with collect(None) as rec:
            out = fn(*a, **k)
        box["n"] = rec.n
        return out

    jax.eval_shape(counting, *args, **kwargs)
    return int(box["n"])


def init_probes(n_slots: int) -> jax.Array:
    """Zero probes f32[n_slots, 3, N_GEMM_FIELDS]."""
    if not isinstance(n_slots, int) or n_slots < 0:
        raise ValueError(f"n_slots: expected a non-negative int, got {n_slots!r}")
    return jnp.zeros((n_slots, 3, N_GEMM_FIELDS), jnp.float32)


def summarize_probes(stats: Any, labels: Sequence[str] | None = None, *,
                     cosine: bool = True) -> dict[str, Any]:
    """Host-side summary of probe cotangents (summed stats) into means.

    Args:
      stats: array-like [n_slots, 3, N_GEMM_FIELDS] (the gradient w.r.t. probes).
      labels: one name per slot (default ``gemm0, gemm1, ...``).
      cosine: whether the cosine field was computed (omitted otherwise).
    Returns:
      {"per_slot": {label: {gemm: {field: mean}}},
       "per_gemm": {gemm: {field: mean over slots}}, "flat": {"fprop/lhs_rel_err": ...}}.
      Slots with count 0 (never called) are omitted; ``count`` is the raw count.
    """
    a = np.asarray(stats, dtype=np.float64)
    if a.size == 0:  # no quantized call site (e.g. a pass-through policy)
        a = a.reshape(0, 3, N_GEMM_FIELDS)
    if a.ndim != 3 or a.shape[1:] != (3, N_GEMM_FIELDS):
        raise ValueError(f"stats: expected shape [n, 3, {N_GEMM_FIELDS}], got {a.shape}")
    if labels is None:
        labels = [f"gemm{i}" for i in range(a.shape[0])]
    if len(labels) != a.shape[0]:
        raise ValueError(f"labels: {len(labels)} names for {a.shape[0]} slots")
    fields = [f for f in GEMM_FIELDS if f != "count" and (cosine or f != "cosine")]
    idx = {f: GEMM_FIELDS.index(f) for f in GEMM_FIELDS}
    per_slot: dict[str, dict[str, dict[str, float]]] = {}
    acc: dict[str, dict[str, list[float]]] = {g: {f: [] for f in fields} for g in GEMM_NAMES}
    for s, label in enumerate(labels):
        entry = {}
        for gi, g in enumerate(GEMM_NAMES):
            cnt = a[s, gi, idx["count"]]
            if cnt <= 0:
                continue
            row = {"count": float(cnt)}
            for f in fields:
                row[f] = float(a[s, gi, idx[f]] / cnt)
                acc[g][f].append(row[f])
            entry[g] = row
        if entry:
            per_slot[label] = entry
    per_gemm = {g: {f: float(np.mean(v)) for f, v in acc[g].items() if v} for g in GEMM_NAMES}
    per_gemm = {g: v for g, v in per_gemm.items() if v}
    flat = {f"{g}/{f}": v for g, row in per_gemm.items() for f, v in row.items()}
    return {"per_slot": per_slot, "per_gemm": per_gemm, "flat": flat}


# --------------------------------------------------------------------------- #
# 3. Training dynamics
# --------------------------------------------------------------------------- #
def _path_name(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def layer_norms(tree: Any, *, stacked: Sequence[str] = ("layers",)) -> dict[str, jax.Array]:
    """L2 norm of every leaf of a pytree (e.g. gradients), per layer for stacked leaves.

    A "layer" is one weight tensor of one block: a leaf whose dotted path starts
    with a name in ``stacked`` holds one tensor per block along axis 0 and gets
    a norm per block (f32[L]); every other leaf one norm (f32 scalar).
    Jit-friendly (returns device arrays); see :func:`expand_layers` for names.
    """
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = _path_name(path)
        x = jnp.asarray(leaf).astype(jnp.float32)
        if name.split(".")[0] in stacked and x.ndim >= 1:
            out[name] = jnp.sqrt(jnp.sum(jnp.square(x.reshape(x.shape[0], -1)), axis=1))
        else:
            out[name] = jnp.sqrt(jnp.sum(jnp.square(x)))
    return out


def expand_layers(norms: Mapping[str, Any]) -> dict[str, float]:
    """Host side: ``{"layers.q.kernel": [a, b]}`` -> ``{"layers.0.q.kernel": a, ...}``."""
    out = {}
    for name, v in norms.items():
        arr = np.asarray(v, dtype=np.float64)
        if arr.ndim == 0:
            out[name] = float(arr)
            continue
        head, _, rest = name.partition(".")
        for i, val in enumerate(arr.ravel()):
            out[f"{head}.{i}.{rest}" if rest else f"{head}.{i}"] = float(val)
    return out


def collapse_rate(norms: Mapping[str, Any] | Sequence[float] | np.ndarray,
                  threshold: float = 1e-6) -> float:
    """Fraction of layers whose gradient L2 norm is below ``threshold`` (NaN counts as not)."""
    if isinstance(norms, Mapping):
        vals = np.asarray(list(expand_layers(norms).values()), dtype=np.float64)
    else:
        vals = np.asarray(norms, dtype=np.float64).ravel()
    if vals.size == 0:
        raise ValueError("norms: no layers given")
    return float(np.mean(vals < threshold))


def relative_update(old: Any, new: Any, *, stacked: Sequence[str] = ("layers",)
                    ) -> dict[str, jax.Array]:
    """Per layer ``‖new − old‖₂ / ‖old‖₂`` (0 where ``old`` is all zero); jit-friendly."""
    diff = jax.tree.map(lambda a, b: jnp.asarray(b, jnp.float32) - jnp.asarray(a, jnp.float32),
                        old, new)
    dn = layer_norms(diff, stacked=stacked)
    on = layer_norms(old, stacked=stacked)
    return {k: _safe_ratio(dn[k], on[k]) for k in dn}


@dataclasses.dataclass(frozen=True, kw_only=True)
class InstabilityConfig:
    """Thresholds of the instability detector.

    A step is **exploding** when its gradient norm ``g`` is non-finite or
    ``g > growth · m`` where ``m`` is the running minimum of the positive,
    finite gradient norms of all earlier steps (no earlier such step: never
    exploding). A step is **dead** when ``g <= zero_tol`` (exactly zero by
    default). The instability point is the first step of the first run of
    ``growth_steps`` consecutive exploding steps, or of ``zero_steps``
    consecutive dead steps, whichever completes first.
    """

    growth: float = 100.0
    growth_steps: int = 5
    zero_steps: int = 10
    zero_tol: float = 0.0

    def __post_init__(self):
        if not self.growth > 1:
            raise ValueError(f"InstabilityConfig: growth must be > 1, got {self.growth!r}")
        for name in ("growth_steps", "zero_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"InstabilityConfig: {name} must be an int >= 1, got {v!r}")
        if not self.zero_tol >= 0:
            raise ValueError(f"InstabilityConfig: zero_tol must be >= 0, got {self.zero_tol!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class InstabilityState:
    """Detector state (immutable). ``event_step``/``event_kind`` once detected."""

    running_min: float = math.inf
    explode_start: int | None = None
    explode_len: int = 0
    zero_start: int | None = None
    zero_len: int = 0
    event_step: int | None = None
    event_kind: str | None = None  # 'grad_norm_growth' or 'zero_gradient'


class InstabilityDetector:
    """Pure state machine: ``state = det.update(state, step, grad_norm)``.

    Feed every training step in order (host side, plain floats). Once an event
    is detected the state keeps it (first event only). See
    :class:`InstabilityConfig` for the exact definition.
    """

    def __init__(self, config: InstabilityConfig | None = None):
        self.config = InstabilityConfig() if config is None else config

    @staticmethod
    def init() -> InstabilityState:
        return InstabilityState()

    def update(self, state: InstabilityState, step: int, grad_norm: float) -> InstabilityState:
        c = self.config
        g = float(grad_norm)
        finite = math.isfinite(g)
        exploding = (not finite) or (math.isfinite(state.running_min)
                                     and g > c.growth * state.running_min)
        dead = finite and g <= c.zero_tol
        if exploding:
            e_start = step if state.explode_len == 0 else state.explode_start
            e_len = state.explode_len + 1
        else:
            e_start, e_len = None, 0
        if dead:
            z_start = step if state.zero_len == 0 else state.zero_start
            z_len = state.zero_len + 1
        else:
            z_start, z_len = None, 0
        run_min = state.running_min
        if finite and g > 0:
            run_min = min(run_min, g)
        ev_step, ev_kind = state.event_step, state.event_kind
        if ev_step is None:
            if e_len >= c.growth_steps:
                ev_step, ev_kind = e_start, "grad_norm_growth"
            elif z_len >= c.zero_steps:
                ev_step, ev_kind = z_start, "zero_gradient"
        return InstabilityState(running_min=run_min, explode_start=e_start, explode_len=e_len,
                                zero_start=z_start, zero_len=z_len, event_step=ev_step,
                                event_kind=ev_kind)

    def run(self, grad_norms: Sequence[float], steps: Sequence[int] | None = None
            ) -> InstabilityState:
        """Feeds a whole series (steps default 0, 1, ...) and returns the final state."""
        steps = range(len(grad_norms)) if steps is None else steps
        state = self.init()
        for s, g in zip(steps, grad_norms, strict=True):
            state = self.update(state, int(s), g)
        return state
