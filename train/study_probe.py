"""Mechanism probe: what each policy does to every GEMM of a real model, and why.

The per-GEMM error statistics of ``mxjax.diagnostics`` (operand error, output
cosine) can rank policies opposite to what training does. This probe measures
what they leave out, on the real model at fixed parameters:

* ``gain`` (``<policy, exact> / |exact|^2``) and ``err_cos`` (cosine of the
  error with the exact product): whether the quantized GEMM is *biased* (e.g. a
  shrunk gradient), not just noisy;
* ``err_corr_batches``: the cosine between the error matrices of the same GEMM
  on two batches at the same parameters. A structured error that does not
  average out across steps (the same direction every step) shows up here;
  randomized policies get a different key per batch, as in training;
* ``common_share`` of each operand along the contraction (the energy in its
  per-16-block means, :func:`mxjax.diagnostics.block_mean_share`) and
  ``noncommon_err``/``common_err``: the operand's quantization error (with
  any rotation undone) restricted to the complement of / to that block-mean
  subspace, plus ``flush``/``flushed_energy``: the share of nonzero
  (rotated) entries, and of their energy, that quantize to zero. They test the
  hypothesis that a deterministic H16 puts a block's common component into one
  coefficient, which then sets the MX scale and flushes the varying part;
* an implementation check per GEMM: ``rot_only_dev`` (the same GEMM with the
  policy's Hadamard and no quantization, through ``mxjax.gemm.gemm``, against
  the exact product) and ``ref_dev`` (the policy GEMM against a reference
  built here: float64 rotation with a Sylvester matrix from ``np.kron``,
  ``mxjax.fake_quantize`` of each operand along the contraction, float64
  product). Both are ``max |a - b| / max |b|``: ~1e-7 means agreement to fp32
  rounding. The float64 rotation can put an element that lies within an fp32
  ulp of an E2M1 rounding (or scale) boundary on the other side of it, which
  moves a few outputs by one grid step; so rotated GEMMs also get ``ref32_dev``
  (the same reference from the fp32 rotation ``mxjax.hadamard`` computes, the
  values the GEMM quantizes) and ``ref_flips`` (the share of quantized operand
  elements on which the two routes differ). Nothing raises: the numbers go in
  the report (the strict version is tests/train/test_study_probe.py).

How: the loss (mean token cross-entropy, as ``train.step``) and its gradient
run jitted with an observer (``mxjax.interceptor.observe``) that wraps every
quantized ``dot_general`` in a custom VJP; ``jax.debug.callback`` sends its
operands, the forward cotangent and the policy's three GEMM results to the
host, where everything above is computed in float64 numpy. Labels follow
``train.ladder_diagnostics.llama_slot_labels``; a call site inside the layer
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
from mxjax.formats import BF16
from mxjax.policies import PrecisionPolicy
from mxjax.quantization import fake_quantize
from mxjax.recipes import GEMMS, GemmRecipe, Hadamard, OperandRecipe
from mxjax.rotation import fixed_signs, random_signs
from train.ladder_diagnostics import llama_slot_labels
from train.step import policy_base_key

__all__ = ["COMMON_BLOCK", "GemmCapture", "analyze_gemm", "capture_gemms",
           "error_correlation_sums", "format_table", "mechanism_probe", "operand_treatment",
           "summarize_row", "sylvester"]

COMMON_BLOCK = 16  # the block of the common (block-mean) subspace: H16's first coefficient
OPERANDS = {"fprop": ("X", "W"), "dgrad": ("dY", "W"), "wgrad": ("dY", "X")}


# --------------------------------------------------------------------------- capture
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


class _Sink:
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


def _hook_for(sink: _Sink):
    def hook(call, lhs, rhs, key, dims, policy):
        slot = len(sink.meta)
        impl = None
        if key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(key)
        sink.meta.append((dims, policy, (key is not None, impl)))
        return _captured(call, sink, slot, lhs, rhs, key)

    return hook


def _probe_config(model_config: LlamaConfig) -> LlamaConfig:
    # remat would run each forward (and its callback) twice
    return dataclasses.replace(model_config, remat=False)


@functools.lru_cache(maxsize=8)
def _graphdef(model_config: LlamaConfig):
    abstract = nnx.eval_shape(lambda: Llama(model_config, rngs=nnx.Rngs(0)))
    graphdef, _, _ = nnx.split(abstract, nnx.Param, ...)
    return graphdef


def _loss_and_grad(model_config: LlamaConfig, policy: PrecisionPolicy, sink: _Sink):
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
    cfg = _probe_config(model_config)
    sink = _Sink() if _sink is None else _sink
    fn = _loss_and_grad(cfg, policy, sink) if _fn is None else _fn
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
            raise RuntimeError(f"study_probe: call site {slot} ({labels[slot]}) ran {len(fwds)} "
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


# --------------------------------------------------------------------------- host analysis
def sylvester(h: int) -> np.ndarray:
    """Unnormalized Sylvester Hadamard matrix of size h (float64), built with np.kron."""
    if h < 1 or h & (h - 1):
        raise ValueError(f"h: expected a power of two, got {h}")
    mat = np.ones((1, 1))
    while mat.shape[0] < h:
        mat = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), mat)
    return mat


def _signs(had: Hadamard, key) -> np.ndarray | None:
    if had.randomized:
        _, _, k_had = mxgemm.split_key(key)
        return np.asarray(random_signs(k_had, had.block_size), np.float64)
    if had.seed is not None:
        return np.asarray(fixed_signs(had.seed, had.block_size), np.float64)
    return None


def _pad_k(x: np.ndarray, mult: int) -> np.ndarray:
    pad = (-x.shape[-1]) % mult
    if not pad:
        return x
    return np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), x.dtype)], axis=-1)


def _rotate(x: np.ndarray, h: int, signs: np.ndarray | None, inverse: bool = False) -> np.ndarray:
    """Block-diagonal (1/sqrt h) H diag(signs) along the last axis, float64 (x padded to h)."""
    xb = x.reshape(x.shape[:-1] + (x.shape[-1] // h, h))
    hm = sylvester(h) / math.sqrt(h)  # symmetric: H^T = H
    if inverse:  # (H D)^-1 = D H
        yb = xb @ hm
        if signs is not None:
            yb = yb * signs
    else:
        yb = (xb * signs if signs is not None else xb) @ hm
    return yb.reshape(x.shape)


@functools.lru_cache(maxsize=64)
def _fq_fn(op: OperandRecipe):
    def f(x, key):
        return fake_quantize(x, op.fmt, -1, **op.quantizer_kwargs(key))

    return jax.jit(f)


@functools.lru_cache(maxsize=16)
def _lib_rotate_fn(h: int, has_signs: bool):
    from mxjax.rotation import hadamard

    def f(x, signs):
        return hadamard(x, h, axis=-1, signs=signs if has_signs else None)

    return jax.jit(f)


@functools.lru_cache(maxsize=64)
def _rot_only_fn(had: Hadamard, n_batch: int):
    recipe = GemmRecipe(lhs=OperandRecipe(fmt=BF16), rhs=OperandRecipe(fmt=BF16), hadamard=had)
    batch = tuple(range(n_batch))
    dims = Dims(((n_batch + 1,), (n_batch + 1,)), (batch, batch))

    def f(a, b, key):
        return mxgemm.gemm(a, b, dims, recipe, key if recipe.needs_key else None)

    return jax.jit(f)


def operand_treatment(x: np.ndarray, op: OperandRecipe, had: Hadamard | None,
                      signs: np.ndarray | None, key=None) -> dict[str, np.ndarray]:
    """What a GEMM does to one canonical operand [..., K], in float64.

    Returns ``rot`` (the operand rotated by the float64 Sylvester rotation, K
    zero-padded to the Hadamard size; ``x`` itself without a Hadamard), ``q``
    (``mxjax.fake_quantize`` of ``rot`` rounded to f32, along K, under ``op``
    with the rounding key ``key``) and ``eff`` (``q`` rotated back and cut to
    K: the operand the GEMM effectively multiplies, in the original basis).
    """
    x = np.asarray(x, np.float64)
    k = x.shape[-1]
    if had is not None:
        rot = _rotate(_pad_k(x, had.block_size), had.block_size, signs)
    else:
        rot = x
    if op.is_passthrough:
        q = rot.astype(np.float32).astype(np.float64) if had is not None else x
    else:
        q = np.asarray(_fq_fn(op)(jnp.asarray(rot.astype(np.float32)), key), np.float64)
    eff = _rotate(q, had.block_size, signs, inverse=True)[..., :k] if had is not None else q
    return {"rot": rot, "q": q, "eff": eff}


def _block_mean(xp: np.ndarray, block: int) -> np.ndarray:
    """Projection of xp [..., K] (K a multiple of block) onto its per-block means."""
    xb = xp.reshape(xp.shape[:-1] + (xp.shape[-1] // block, block))
    return np.broadcast_to(xb.mean(axis=-1, keepdims=True), xb.shape).reshape(xp.shape)


def _mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[batch..., Fa, K] x [batch..., Fb, K] -> [batch..., Fa, Fb], float64."""
    return np.matmul(a, np.swapaxes(b, -1, -2))


def _maxdev(a: np.ndarray, ref: np.ndarray) -> float:
    m = float(np.max(np.abs(ref))) if ref.size else 0.0
    d = float(np.max(np.abs(a - ref))) if ref.size else 0.0
    return d / m if m > 0 else d


def analyze_gemm(cap: GemmCapture, *, impl_check: bool = True,
                 common_block: int = COMMON_BLOCK) -> dict[str, Any]:
    """Sums and checks of one captured GEMM (float64, host).

    Returns a dict of sums (``s_*``, to be combined over batches and call
    sites), the error matrix ``err`` (policy − exact, for ``err_corr_batches``)
    and the implementation checks ``rot_only_dev``, ``ref_dev``, ``ref32_dev``,
    ``ref_flips`` (module docstring; None where the GEMM has no Hadamard or
    nothing to check).
    """
    r = cap.recipe
    a = np.asarray(cap.a, np.float64)
    b = np.asarray(cap.b, np.float64)
    out = np.asarray(cap.out, np.float64)
    exact = _mm(a, b)
    err = out - exact
    s = {"s_exact2": float(np.sum(exact * exact)), "s_err2": float(np.sum(err * err)),
         "s_out_exact": float(np.sum(out * exact)), "s_err_exact": float(np.sum(err * exact))}
    had = r.hadamard
    signs = _signs(had, cap.key) if had is not None else None
    k_lhs, k_rhs, _ = mxgemm.split_key(cap.key)
    treated = {}
    for side, x, op, k in (("lhs", a, r.lhs, k_lhs), ("rhs", b, r.rhs, k_rhs)):
        t = operand_treatment(x, op, had, signs, k if op.needs_key else None)
        treated[side] = t
        # The common subspace lives in the zero-padded space, as the rotation sees it
        # (so common_share equals mxjax.diagnostics.block_mean_share).
        xp = _pad_k(x, common_block)
        d = _pad_k(t["eff"] - x, common_block)
        xm = _block_mean(xp, common_block)
        dm = _block_mean(d, common_block)
        nz = t["rot"] != 0
        flushed = nz & (t["q"] == 0)
        s.update({
            f"s_{side}_x2": float(np.sum(x * x)),
            f"s_{side}_common2": float(np.sum(xm * xm)),
            f"s_{side}_err2": float(np.sum(d * d)),
            f"s_{side}_err_common2": float(np.sum(dm * dm)),
            f"s_{side}_err_noncommon2": float(np.sum((d - dm) ** 2)),
            f"s_{side}_noncommon2": float(np.sum((xp - xm) ** 2)),
            f"s_{side}_nz": float(np.sum(nz)),
            f"s_{side}_flushed": float(np.sum(flushed)),
            f"s_{side}_rot2": float(np.sum(t["rot"] ** 2)),
            f"s_{side}_flushed2": float(np.sum(np.where(flushed, t["rot"], 0.0) ** 2)),
        })
    res: dict[str, Any] = {"sums": s, "err": err, "rot_only_dev": None, "ref_dev": None,
                           "ref32_dev": None, "ref_flips": None}
    if impl_check and not r.is_passthrough:
        ref = _mm(treated["lhs"]["q"], treated["rhs"]["q"])
        res["ref_dev"] = _maxdev(out, ref)
        if had is not None:
            n_batch = a.ndim - 2
            rot = _rot_only_fn(had, n_batch)(jnp.asarray(cap.a, jnp.float32),
                                             jnp.asarray(cap.b, jnp.float32), cap.key)
            res["rot_only_dev"] = _maxdev(np.asarray(rot, np.float64), exact)
            # The same reference from the fp32 rotation the GEMM itself quantizes: it
            # separates a fault from an element that sits within an fp32 ulp of a rounding
            # or scale boundary, which the float64 rotation may put on the other side.
            q32, changed, n = [], 0, 0
            for side, x, op, k in (("lhs", a, r.lhs, k_lhs), ("rhs", b, r.rhs, k_rhs)):
                xr = _lib_rotate_fn(had.block_size, signs is not None)(
                    jnp.asarray(_pad_k(np.asarray(x, np.float32), had.block_size)),
                    None if signs is None else jnp.asarray(signs, jnp.float32))
                q = (np.asarray(xr, np.float64) if op.is_passthrough else np.asarray(
                    _fq_fn(op)(xr, k if op.needs_key else None), np.float64))
                q32.append(q)
                changed += int(np.sum(q != treated[side]["q"]))
                n += q.size
            res["ref32_dev"] = _maxdev(out, _mm(q32[0], q32[1]))
            res["ref_flips"] = changed / n
    return res


_CHECKS = ("rot_only_dev", "ref_dev", "ref32_dev", "ref_flips")


def _ratio(num: float, den: float) -> float | None:
    return None if den <= 0 else float(num / den)


def error_correlation_sums(errs: Sequence[np.ndarray]) -> tuple[float, float, float] | None:
    """``(sum <E_i, E_j>, sum |E_i|^2, sum |E_j|^2)`` over all pairs i < j of error
    matrices (None for fewer than two); their ratio is ``err_corr_batches``."""
    if len(errs) < 2:
        return None
    pairs = [(errs[i], errs[j]) for i in range(len(errs)) for j in range(i + 1, len(errs))]
    if any(x.shape != y.shape for x, y in pairs):
        return None
    return (sum(float(np.sum(x * y)) for x, y in pairs),
            sum(float(np.sum(x * x)) for x, _ in pairs),
            sum(float(np.sum(y * y)) for _, y in pairs))


def summarize_row(s: Mapping[str, float], corr: tuple[float, float, float] | None
                  ) -> dict[str, Any]:
    """One row of fields from the sums of :func:`analyze_gemm` (added over batches and/or
    call sites: energy-weighted) and :func:`error_correlation_sums` (or None)."""
    row = {
        "rel_err": _ratio(math.sqrt(s["s_err2"]), math.sqrt(s["s_exact2"])),
        "gain": _ratio(s["s_out_exact"], s["s_exact2"]),
        "err_cos": _ratio(s["s_err_exact"], math.sqrt(s["s_err2"] * s["s_exact2"])),
        "err_corr_batches": None if corr is None else _ratio(corr[0], math.sqrt(corr[1] * corr[2])),
    }
    for side in ("lhs", "rhs"):
        g = lambda n, side=side: s[f"s_{side}_{n}"]
        row.update({
            f"{side}_rel_err": _ratio(math.sqrt(g("err2")), math.sqrt(g("x2"))),
            f"{side}_common_share": _ratio(g("common2"), g("x2")),
            f"{side}_noncommon_err": _ratio(math.sqrt(g("err_noncommon2")),
                                            math.sqrt(g("noncommon2"))),
            f"{side}_common_err": _ratio(math.sqrt(g("err_common2")), math.sqrt(g("common2"))),
            f"{side}_flush": _ratio(g("flushed"), g("nz")),
            f"{side}_flushed_energy": _ratio(g("flushed2"), g("rot2")),
        })
    return row


def _add(acc: dict[str, float], s: Mapping[str, float]) -> None:
    for k, v in s.items():
        acc[k] = acc.get(k, 0.0) + v


def _max_opt(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


def mechanism_probe(model_config: LlamaConfig, params: dict, batches: Sequence[np.ndarray],
                    policies: Mapping[str, PrecisionPolicy], *, key_seed: int = 0,
                    impl_check: bool = True) -> dict[str, Any]:
    """Per policy, per GEMM kind and call site: bias, cross-batch error correlation,
    common-component measures and the implementation checks (module docstring).

    Args:
      model_config: the Llama config the parameters belong to.
      params: pure parameter dict (``train.state``'s ``params``), fixed.
      batches: int32[B, T+1] token batches (>= 2 for ``err_corr_batches``; all the
        same shape).
      policies: name -> PrecisionPolicy (quantizing; a pass-through policy has no
        quantized GEMM and gives empty tables).
      key_seed: randomized policies use ``fold_in(policy_base_key(key_seed), i)``
        on batch ``i`` (a different key per batch, as per step in training).
      impl_check: compute the implementation checks (three extra products per rotated
        GEMM, one per plain one); False saves about a third of the host time.
    Returns:
      JSON-able dict: ``{"policies": {name: {"loss": [per batch], "aggregate":
      {kind: row}, "per_gemm": {label: {kind: row}}, "impl_check": {...}}},
      "operands": {kind: [lhs, rhs] names}, "n_batches", "key_seed",
      "common_block"}``. A row holds ``rel_err``, ``gain``, ``err_cos``,
      ``err_corr_batches`` (mean over batch pairs, energy-weighted),
      ``{lhs,rhs}_{rel_err, common_share, noncommon_err, common_err, flush,
      flushed_energy}`` and, per call site, ``rot_only_dev``, ``ref_dev``,
      ``ref32_dev``, ``ref_flips`` (max over batches; ``impl_check`` holds their
      maxima per GEMM kind and overall). Aggregates pool the sums over call sites (energy-weighted
      means).
    """
    if not isinstance(model_config, LlamaConfig):
        raise TypeError(f"model_config: expected a LlamaConfig, got {type(model_config).__name__}")
    batches = [np.asarray(bt) for bt in batches]
    if not batches:
        raise ValueError("batches: expected at least one int32[B, T+1] batch")
    for i, bt in enumerate(batches):
        if bt.ndim != 2 or not np.issubdtype(bt.dtype, np.integer) or bt.shape[1] < 2:
            raise ValueError(f"batches[{i}]: expected int[B, T+1] with T >= 1, got "
                             f"{bt.dtype}{list(bt.shape)}")
        if bt.shape != batches[0].shape:
            raise ValueError(f"batches[{i}]: shape {bt.shape} differs from batches[0] "
                             f"{batches[0].shape}")
    if not isinstance(policies, Mapping) or not policies:
        raise ValueError("policies: expected a non-empty mapping name -> PrecisionPolicy")
    base = policy_base_key(key_seed)
    cfg = _probe_config(model_config)
    result: dict[str, Any] = {}
    for name, policy in policies.items():
        if not isinstance(policy, PrecisionPolicy):
            raise TypeError(f"policies[{name!r}]: expected a PrecisionPolicy, got "
                            f"{type(policy).__name__}")
        sink = _Sink()
        fn = _loss_and_grad(cfg, policy, sink)
        losses = []
        sums: dict[tuple[str, str], dict[str, float]] = {}
        errs: dict[tuple[str, str], list[np.ndarray]] = {}
        checks: dict[tuple[str, str], dict[str, float | None]] = {}
        for i, bt in enumerate(batches):
            key = jax.random.fold_in(base, i)
            loss, caps = capture_gemms(model_config, params, bt, policy, key, _fn=fn,
                                       _sink=sink)
            losses.append(loss)
            for cap in caps:
                at = (cap.label, cap.kind)
                res = analyze_gemm(cap, impl_check=impl_check)
                _add(sums.setdefault(at, {}), res["sums"])
                errs.setdefault(at, []).append(res["err"])
                c = checks.setdefault(at, dict.fromkeys(_CHECKS))
                for f in _CHECKS:
                    c[f] = _max_opt(c[f], res[f])
        per_gemm: dict[str, dict[str, Any]] = {}
        agg_sums: dict[str, dict[str, float]] = {}
        agg_corr: dict[str, list[float]] = {}
        for (label, kind), s in sums.items():
            e = errs[(label, kind)]
            corr = error_correlation_sums(e)
            if corr is not None:
                ac = agg_corr.setdefault(kind, [0.0, 0.0, 0.0])
                for j in range(3):
                    ac[j] += corr[j]
            row = summarize_row(s, corr)
            row.update(checks[(label, kind)])
            per_gemm.setdefault(label, {})[kind] = row
            _add(agg_sums.setdefault(kind, {}), s)
        aggregate = {kind: summarize_row(agg_sums[kind], tuple(agg_corr[kind])
                                      if kind in agg_corr else None)
                     for kind in GEMMS if kind in agg_sums}
        impl = {f"{kind}_{c}": _max_of(per_gemm, kind, c) for kind in GEMMS for c in _CHECKS}
        impl.update({f"max_{c}": _max_of(per_gemm, None, c) for c in _CHECKS})
        result[name] = {"loss": losses, "aggregate": aggregate, "per_gemm": per_gemm,
                        "impl_check": impl}
    return {"policies": result, "operands": {k: list(v) for k, v in OPERANDS.items()},
            "n_batches": len(batches), "key_seed": key_seed, "common_block": COMMON_BLOCK}


def _max_of(per_gemm, kind, field):
    vals = [row[field] for rows in per_gemm.values() for k, row in rows.items()
            if (kind is None or k == kind) and row.get(field) is not None]
    return max(vals) if vals else None


def format_table(probe: Mapping[str, Any]) -> str:
    """The aggregate rows of :func:`mechanism_probe` as a text table (one line per
    policy and GEMM kind)."""
    cols = ("rel_err", "gain", "err_cos", "err_corr_batches", "lhs_rel_err", "rhs_rel_err",
            "lhs_common_share", "rhs_common_share", "lhs_common_err", "rhs_common_err",
            "lhs_noncommon_err", "rhs_noncommon_err", "lhs_flush", "rhs_flush")
    short = {"err_corr_batches": "err_corr", "lhs_common_share": "l_cshare",
             "rhs_common_share": "r_cshare", "lhs_common_err": "l_cerr", "rhs_common_err": "r_cerr",
             "lhs_noncommon_err": "l_ncerr", "rhs_noncommon_err": "r_ncerr",
             "lhs_rel_err": "l_rel", "rhs_rel_err": "r_rel", "lhs_flush": "l_flush",
             "rhs_flush": "r_flush"}
    width = max([16] + [len(n) for n in probe["policies"]])
    head = [f"{'policy':<{width}}", "gemm "] + [f"{short.get(c, c):>8}" for c in cols]
    lines = [" ".join(head)]
    for name, p in probe["policies"].items():
        for kind, row in p["aggregate"].items():
            vals = ["-" if row[c] is None else f"{row[c]:.4f}" for c in cols]
            lines.append(" ".join([f"{name:<{width}}", f"{kind:5}"] + [f"{v:>8}" for v in vals]))
    return "\n".join(lines)

