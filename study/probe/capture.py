"""Capture every GEMM of the model's loss and gradient, on the host.

The loss (mean token cross-entropy, as ``train.step``) and its gradient run
jitted with an observer (``mxjax.interceptor.observe``) that asks the
interceptor for the record of each of a quantized call's three GEMMs
(``mxjax.gemm_record.GemmRecord``: recipe, canonical operands, keys already
split, result) and sends it to the host with ``jax.debug.callback`` (`Sink`),
together with what the analysis needs from the trace: the Hadamard's sign
vector and the same GEMM with the policy's Hadamard and no quantization
(``record.run``). `capture_gemms` turns them into one `GemmCapture` per call
site and GEMM. Labels follow ``train.diagnostics.numerics.llama_slot_labels``;
a call site inside the layer scan runs once per layer and each execution is
labelled with its layer (``L0.q_proj``, found by matching W against the
stacked kernels).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.llama import Llama, LlamaConfig
from mxjax import interceptor
from mxjax.formats import BF16
from mxjax.gemm_record import GemmRecord
from mxjax.policies import PrecisionPolicy
from mxjax.recipes import GEMMS, GemmRecipe
from train.diagnostics.numerics import llama_slot_labels

__all__ = ["GemmCapture", "Sink", "capture_gemms", "loss_and_grad", "probe_config"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmCapture:
    """One GEMM of one call site, canonical layout (``mxjax.layout``), host arrays.

    ``a``: f32 [batch..., Fa, K], ``b``: f32 [batch..., Fb, K] (contraction last,
    flattened in the GEMM's own order), ``out``: the policy's result [batch...,
    Fa, Fb] (its dtype); ``recipe``: its GemmRecipe; ``lhs_key``/``rhs_key``: the
    keys of the two roundings (None unless that operand's rounding is
    STOCHASTIC); ``signs``: the Hadamard's ±1 sign vector (None without signs);
    ``rot_only``: the same GEMM with the recipe's Hadamard and no quantization
    (f32 [batch..., Fa, Fb]; None without a Hadamard).
    """

    label: str
    kind: str
    a: np.ndarray
    b: np.ndarray
    out: np.ndarray
    recipe: GemmRecipe
    lhs_key: Any = None
    rhs_key: Any = None
    signs: np.ndarray | None = None
    rot_only: np.ndarray | None = None


class Sink:
    """Host side of the observer: per call site, the static metadata and the arrays.

    ``meta[slot] = (policy, key_impl)`` is filled at trace time; ``data[(slot,
    part)]`` lists the arrays of every execution (one per layer when the call
    site sits inside a scan): part 'fwd' holds the fprop record, 'bwd' the dgrad
    and wgrad records, each with W (to pair a backward with its forward).
    """

    def __init__(self):
        self.meta: list[tuple[PrecisionPolicy, Any]] = []
        self.data: dict[tuple[int, str], list[dict[str, Any]]] = {}

    def put(self, slot: int, part: str, tree: dict[str, Any]):
        self.data.setdefault((slot, part), []).append(jax.tree.map(np.asarray, tree))


def _key_data(key):
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def _record_arrays(r: GemmRecord) -> dict[str, jax.Array]:
    """What the host analysis needs of one GEMM record (traced)."""
    a, b = r.operands
    arrays = {"a": a, "b": b, "out": r.out_canonical}
    keys = r.keys
    if r.recipe.lhs.needs_key:
        arrays["lhs_key"] = _key_data(keys.lhs)
    if r.recipe.rhs.needs_key:
        arrays["rhs_key"] = _key_data(keys.rhs)
    had = r.recipe.hadamard
    if had is not None:
        signs = r.hadamard_signs()
        if signs is not None:
            arrays["signs"] = signs
        arrays["rot_only"] = r.run(GemmRecipe(lhs=BF16, rhs=BF16, hadamard=had))
    return arrays


class _CallSite:
    """The observer's on_gemm for one call site: sends its records to the sink.

    The interceptor hands over fprop in the forward pass and dgrad then wgrad in
    the backward pass; the two backward records go out in one callback.
    """

    def __init__(self, sink: Sink, slot: int):
        self.sink, self.slot = sink, slot
        self.dgrad: GemmRecord | None = None

    def __call__(self, r: GemmRecord) -> None:
        if r.name == "fprop":
            tree = {"w": r.rhs, "fprop": _record_arrays(r)}
            jax.debug.callback(functools.partial(self.sink.put, self.slot, "fwd"), tree)
        elif r.name == "dgrad":
            self.dgrad = r
        else:
            d, self.dgrad = self.dgrad, None
            tree = {"w": d.rhs, "dgrad": _record_arrays(d), "wgrad": _record_arrays(r)}
            jax.debug.callback(functools.partial(self.sink.put, self.slot, "bwd"), tree)


def _hook_for(sink: Sink):
    def hook(call):
        slot = len(sink.meta)
        impl = None
        if call.key is not None and jnp.issubdtype(call.key.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(call.key)
        sink.meta.append((call.policy, impl))
        return call(call.lhs, call.rhs, call.key, on_gemm=_CallSite(sink, slot))

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


def _wrap_key(data, impl):
    if data is None:
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
    for slot, (pol, impl) in enumerate(sink.meta):
        fwds, bwds = sink.data.get((slot, "fwd"), []), sink.data.get((slot, "bwd"), [])
        if not fwds or len(fwds) != len(bwds):
            raise RuntimeError(f"probe: call site {slot} ({labels[slot]}) ran {len(fwds)} "
                               f"forward and {len(bwds)} backward GEMM sets")
        execs = []
        for j, fwd in enumerate(fwds):
            match = [bw for bw in bwds if bw["w"].shape == fwd["w"].shape
                     and np.array_equal(bw["w"], fwd["w"])]
            bwd = match[0] if len(match) == 1 else bwds[len(bwds) - 1 - j]  # scan runs back
            label, layer = labels[slot], 0
            if len(fwds) > 1:
                layer = _layer_of(label, fwd["w"], params, j)
                label = label.replace("L*.", f"L{layer}.", 1) if label.startswith("L*.") \
                    else f"{label}#{layer}"
            execs.append((layer, label, fwd, bwd))
        for _, label, fwd, bwd in sorted(execs, key=lambda e: e[0]):
            for kind in GEMMS:
                rec = (fwd if kind == "fprop" else bwd)[kind]
                caps.append(GemmCapture(
                    label=label, kind=kind, a=rec["a"], b=rec["b"], out=rec["out"],
                    recipe=getattr(pol, kind), lhs_key=_wrap_key(rec.get("lhs_key"), impl),
                    rhs_key=_wrap_key(rec.get("rhs_key"), impl), signs=rec.get("signs"),
                    rot_only=rec.get("rot_only")))
    return loss, caps
