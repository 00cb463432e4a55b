"""Collection of GEMM statistics inside the jitted step: probes through the interceptor.

No ``jax.debug.print``, no host callbacks. Each quantized ``dot_general`` call
gets an extra, otherwise unused, differentiable *probe* ``f32[3,
N_GEMM_FIELDS]`` (zeros): :func:`probed_call` wraps the GEMM in a custom VJP
whose forward records the fprop stats and whose backward records the
dgrad/wgrad stats (:func:`record_gemm`, with the operands as the GEMM hands
them to the quantizer) and returns ``stack([fprop, dgrad, wgrad])`` as the
probe's cotangent. The gradient of the loss with respect to the probes is then
the stats of every GEMM of the step, an auxiliary output of the same
``value_and_grad`` (:func:`value_and_grad_with_stats`), through ``scan``
(summed over layers), ``remat`` and gradient accumulation (summed over
micro-batches). Every row carries ``count = 1`` so sums divide back into
means. The stats only *read* the GEMM's inputs (they re-quantize them
bit-identically, and compute the cosine from that copy), so the GEMM's own
program is unchanged and losses and gradients are bit-identical with
diagnostics on.

Plugging into the interceptor: :func:`collect` installs one hook
(``mxjax.interceptor.observe``) for the duration of the trace. The interceptor
calls it once per quantized ``dot_general`` call with the call (a
``mxjax.interceptor.DotGeneralCall``); the hook takes the next probe slot and
runs the call inside :func:`probed_call`, asking the interceptor for a
``mxjax.gemm_record.GemmRecord`` of each GEMM as it runs. A record's
``quantizer_inputs()`` and ``keys`` are the operands and keys the GEMM hands
its quantizer, so the stats are those of the GEMM's own quantization. The
interceptor never imports this module, and with diagnostics off it traces
exactly the plain program.

Protocol for other GEMMs: the caller wraps its loss function with
:func:`instrument` (or uses :func:`value_and_grad_with_stats`), which makes a
``probes f32[n_slots, 3, N_GEMM_FIELDS]`` argument available while the loss is
traced; a GEMM calls :func:`next_probe` once per call (``None`` when
diagnostics are off) and then :func:`probed_call`, and its backends call
:func:`record_gemm`. Slots are handed out in trace order; :func:`count_slots`
finds ``n_slots`` with an abstract trace. A GEMM traced once inside ``scan``
gets one slot for all iterations (its stats are summed over layers; ``count``
says how many).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mxjax import interceptor
from mxjax.diagnostics.gemm_stats import GEMM_FIELDS, N_GEMM_FIELDS, gemm_stats
from mxjax.gemm_record import GemmRecord
from mxjax.interceptor import DotGeneralCall
from mxjax.recipes import GEMMS

__all__ = [
    "DiagnosticsConfig",
    "collect",
    "count_slots",
    "init_probes",
    "instrument",
    "next_probe",
    "probed_call",
    "record_gemm",
    "summarize_probes",
    "value_and_grad_with_stats",
]

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
        with interceptor.observe(_observe_dot_general):
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
    if gemm_name not in GEMMS:
        raise ValueError(f"gemm_name: expected one of {GEMMS}, got {gemm_name!r}")
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
    acc: dict[str, dict[str, list[float]]] = {g: {f: [] for f in fields} for g in GEMMS}
    for s, label in enumerate(labels):
        entry = {}
        for gi, g in enumerate(GEMMS):
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
    per_gemm = {g: {f: float(np.mean(v)) for f, v in acc[g].items() if v} for g in GEMMS}
    per_gemm = {g: v for g, v in per_gemm.items() if v}
    flat = {f"{g}/{f}": v for g, row in per_gemm.items() for f, v in row.items()}
    return {"per_slot": per_slot, "per_gemm": per_gemm, "flat": flat}


# --------------------------------------------------------------------------- #
# The interceptor's hook
# --------------------------------------------------------------------------- #
def _record_gemm_record(record: GemmRecord) -> None:
    """The interceptor's on_gemm: one GEMM's stats into the probed call being traced."""
    if record.recipe.is_passthrough or _SINK.get() is None:
        return  # nothing quantized (lax.dot_general), or no probed call being traced
    a, b = record.quantizer_inputs()
    keys = record.keys
    record_gemm(record.name, a, b, record.recipe, keys.lhs, keys.rhs)


def _observe_dot_general(call: DotGeneralCall):
    """The hook :func:`collect` installs in the interceptor (``mxjax.interceptor.observe``)."""
    slot = next_probe()
    if slot is None:  # an inner trace outside this recorder's reach
        return call(call.lhs, call.rhs, call.key)
    return probed_call(functools.partial(call, on_gemm=_record_gemm_record), slot,
                       call.lhs, call.rhs, call.key)
