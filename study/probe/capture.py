"""Capture every quantized GEMM of the model's loss and gradient, on the host.

The loss (mean token cross-entropy, as ``train.step``) and its gradient run
jitted with an observer (``mxjax.interceptor.observe``) that wraps every
quantized ``dot_general`` in a custom VJP; ``jax.debug.callback`` sends its
operands, the forward cotangent and the policy's three GEMM results to the
host (`Sink`), where `capture_gemms` lays them out canonically as one
`GemmCapture` per call site and GEMM. Labels follow
``train.diagnostics.numerics.llama_slot_labels``; a call site inside the layer
scan runs once per layer and each execution is labelled with its layer
(``L0.q_proj``, found by matching W against the stacked kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.llama import Llama, LlamaConfig
from mxjax import gemm as mxgemm
from mxjax import interceptor
from mxjax.dimensions import Dims, backward_dimension_numbers
from mxjax.policies import PrecisionPolicy
from mxjax.recipes import GEMMS, GemmRecipe
from train.diagnostics.numerics import llama_slot_labels

__all__ = ["GemmCapture", "Sink", "capture_gemms", "loss_and_grad", "probe_config"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmCapture:
    """One GEMM of one call site, canonical layout (``mxjax.layout``), float32 host arrays.

    ``a``: [batch..., Fa, K], ``b``: [batch..., Fb, K] (contraction last, flattened
    in the GEMM's own order), ``out``: the policy's result [batch..., Fa, Fb];
    ``recipe``: its GemmRecipe; ``key``: the GEMM's PRNG key (None if unused).
    """

    label: str
    kind: str
    a: np.ndarray
    b: np.ndarray
    out: np.ndarray
    recipe: GemmRecipe
    key: Any


class Sink:
    """Host side of the observer: per call site, the static metadata and the arrays.

    ``meta[slot] = (dims, policy, (has_key, key_impl))`` is filled at trace time;
    ``data[(slot, part)]`` lists the arrays of every execution (one per layer when
    the call site sits inside a scan).
    """

    def __init__(self):
        self.meta: list[tuple[Dims, PrecisionPolicy, Any]] = []
        self.data: dict[tuple[int, str], list[tuple[np.ndarray, ...]]] = {}

    def put(self, slot: int, part: str, *arrays):
        self.data.setdefault((slot, part), []).append(tuple(np.asarray(a) for a in arrays))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _captured(call, sink, slot, lhs, rhs, key):
    return call(lhs, rhs, key)


def _key_data(key):
    if key is None:
        return ()
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return (jax.random.key_data(key),)
    return (key,)


def _captured_fwd(call, sink, slot, lhs, rhs, key):
    y, vjp = jax.vjp(call, lhs, rhs, key)
    jax.debug.callback(functools.partial(sink.put, slot, "fwd"), lhs, rhs, y, *_key_data(key))
    return y, (vjp, rhs)


def _captured_bwd(call, sink, slot, res, g):
    vjp, rhs = res
    cts = vjp(g)
    # rhs again: pairs this backward with its forward when the site runs once per layer
    jax.debug.callback(functools.partial(sink.put, slot, "bwd"), g, cts[0], cts[1], rhs)
    return cts


_captured.defvjp(_captured_fwd, _captured_bwd)


def _hook_for(sink: Sink):
    def hook(call, lhs, rhs, key, dims, policy):
        slot = len(sink.meta)
        impl = None
        if key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(key)
        sink.meta.append((dims, policy, (key is not None, impl)))
        return _captured(call, sink, slot, lhs, rhs, key)

    return hook


def probe_config(model_config: LlamaConfig) -> LlamaConfig:
    # remat would run each forward (and its callback) twice
    return dataclasses.replace(model_config, remat=False)


@functools.lru_cache(maxsize=8)
def _graphdef(model_config: LlamaConfig):
    abstract = nnx.eval_shape(lambda: Llama(model_config, rngs=nnx.Rngs(0)))
    graphdef, _, _ = nnx.split(abstract, nnx.Param, ...)
    return graphdef


def loss_and_grad(model_config: LlamaConfig, policy: PrecisionPolicy, sink: Sink):
    """jitted ``(params, tokens int32[B, T+1], key) -> (loss, grads)`` with the observer on."""
    graphdef = _graphdef(model_config)
    needs_key = bool(getattr(policy, "needs_key", False))

    def loss(params, tokens, key):
        model = nnx.merge(graphdef, params)
        logits = model(tokens[:, :-1], policy=policy, policy_key=key if needs_key else None)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                             tokens[:, 1:])
        return jnp.mean(ce)

    def traced(params, tokens, key):
        sink.meta.clear()
        with interceptor.observe(_hook_for(sink)):
            return jax.value_and_grad(loss)(params, tokens, key)

    return jax.jit(traced)


def _np_canonical(x: np.ndarray, batch: Sequence[int], contract: Sequence[int]) -> np.ndarray:
    """x -> [batch..., prod(free), prod(contract)] (numpy; contraction flattened in order)."""
    free = [i for i in range(x.ndim) if i not in set(batch) | set(contract)]
    xt = np.transpose(x, tuple(batch) + tuple(free) + tuple(contract))
    nb = len(batch)
    f = math.prod(xt.shape[nb:nb + len(free)])
    return xt.reshape(xt.shape[:nb] + (f, math.prod(xt.shape[nb + len(free):])))


def _np_out_canonical(out_lax: np.ndarray, dims: Dims, a_shape) -> np.ndarray:
    """``lax.dot_general(a, b, dims)``-layout result -> [batch..., Fa, Fb]."""
    (ca, _), (ba, _) = dims
    fa = math.prod(a_shape[i] for i in range(len(a_shape)) if i not in set(ca) | set(ba))
    bshape = tuple(a_shape[i] for i in ba)
    return out_lax.reshape(bshape + (fa, -1))


def _wrap_key(data, has_key_impl):
    has_key, impl = has_key_impl
    if not has_key:
        return None
    if impl is None:
        return jnp.asarray(data)
    return jax.random.wrap_key_data(jnp.asarray(data), impl=impl)


def _layer_of(label: str, rhs: np.ndarray, params: Mapping[str, Any], order: int) -> int:
    """Layer index of one execution of a scanned call site ``L*.<proj>``: the layer whose
    stacked kernel equals the GEMM's rhs (W); the execution order where that is ambiguous."""
    proj = label.split(".", 1)[1] if "." in label else label
    try:
        stack = np.asarray(params["layers"][proj]["kernel"])
    except (KeyError, TypeError):
        return order
    hits = [i for i in range(stack.shape[0])
            if stack[i].shape == rhs.shape and np.array_equal(stack[i].astype(rhs.dtype), rhs)]
    return hits[0] if len(hits) == 1 else order


def capture_gemms(model_config: LlamaConfig, params: dict, tokens: np.ndarray,
                  policy: PrecisionPolicy, key: jax.Array | None = None,
                  *, _fn=None, _sink=None) -> tuple[float, list[GemmCapture]]:
    """Runs loss and gradient on one batch and returns (loss, every quantized GEMM).

    Args:
      model_config: the model's config (run as configured, without remat).
      params: the pure parameter dict (``train.state``'s ``params``).
      tokens: int32[B, T+1].
      policy: the precision policy.
      key: the step's policy key (``fold_in(policy_base, step)``); needed when
        ``policy.needs_key``.
    Returns:
      ``(loss, captures)``: one :class:`GemmCapture` per call site (per layer:
      ``L0.q_proj``, ... also when the layers are scanned) and GEMM kind
      (fprop, dgrad, wgrad), in trace order.
    """
    cfg = probe_config(model_config)
    sink = Sink() if _sink is None else _sink
    fn = loss_and_grad(cfg, policy, sink) if _fn is None else _fn
    if key is None:
        if getattr(policy, "needs_key", False):
            raise ValueError(f"key: policy {policy.name!r} needs a PRNG key")
        key = jax.random.key(0)
    sink.data.clear()
    loss, _ = fn(params, jnp.asarray(tokens, jnp.int32), key)
    loss = float(loss)
    jax.effects_barrier()
    labels = llama_slot_labels(cfg)
    if len(labels) != len(sink.meta):
        labels = [f"gemm{i}" for i in range(len(sink.meta))]
    caps = []
    for slot, (dims, pol, key_info) in enumerate(sink.meta):
        fwds, bwds = sink.data.get((slot, "fwd"), []), sink.data.get((slot, "bwd"), [])
        if not fwds or len(fwds) != len(bwds):
            raise RuntimeError(f"probe: call site {slot} ({labels[slot]}) ran {len(fwds)} "
                               f"forward and {len(bwds)} backward GEMM sets")
        execs = []
        for j, fwd in enumerate(fwds):
            match = [bw for bw in bwds if bw[3].shape == fwd[1].shape
                     and np.array_equal(bw[3], fwd[1])]
            bwd = match[0] if len(match) == 1 else bwds[len(bwds) - 1 - j]  # scan runs back
            label, layer = labels[slot], 0
            if len(fwds) > 1:
                layer = _layer_of(label, fwd[1], params, j)
                label = label.replace("L*.", f"L{layer}.", 1) if label.startswith("L*.") \
                    else f"{label}#{layer}"
            execs.append((layer, label, fwd, bwd))
        for _, label, fwd, bwd in sorted(execs, key=lambda e: e[0]):
            lhs, rhs, y = fwd[:3]
            g, dlhs, drhs = bwd[:3]
            call_key = _wrap_key(fwd[3], key_info) if len(fwd) > 3 else None
            gkeys = dict(zip(GEMMS, mxgemm.split_key(call_key)))
            (d_dims, d_perm), (w_dims, w_perm) = backward_dimension_numbers(dims, lhs.ndim,
                                                                            rhs.ndim)
            out_d = np.transpose(dlhs, np.argsort(d_perm))
            out_w = np.transpose(drhs, np.argsort(w_perm))
            for kind, a, b, dd, out in (("fprop", lhs, rhs, dims, y),
                                        ("dgrad", g, rhs, d_dims, out_d),
                                        ("wgrad", g, lhs, w_dims, out_w)):
                (ca, cb), (ba, bb) = dd
                recipe = getattr(pol, kind)
                caps.append(GemmCapture(
                    label=label, kind=kind, a=_np_canonical(a, ba, ca),
                    b=_np_canonical(b, bb, cb), out=_np_out_canonical(out, dd, a.shape),
                    recipe=recipe, key=gkeys[kind] if recipe.needs_key else None))
    return loss, caps
