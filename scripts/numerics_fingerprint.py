"""Numerics fingerprint: one SHA-256 per (preset/format, quantity), and a total.

A tool for restructurings that must not change a single bit: run it before and
after and diff the output (``python scripts/numerics_fingerprint.py > before.txt``).
Everything is computed on CPU with fixed seeds:

* for each library preset but the study's ablations (``mxjax.policies.names()`` without
  ``study.policies.ABLATIONS``), on several GEMM shapes
  (2-D, batched, several contracting dims, a non-trailing contraction, K not a
  multiple of 32), f32 and bf16 inputs, well-behaved and adversarial (ties, zeros,
  subnormals, saturation, NaN and Inf rows): the forward values of
  ``mxjax.dot_general`` and its gradients (dgrad = lhs cotangent, wgrad = rhs
  cotangent) eagerly and under ``jax.jit``; the ``mxjax.diagnostics`` statistics
  of the step; and each GEMM recipe's accelerator (GPU/TPU) form, evaluated on
  CPU by calling the emulated GEMM's accelerator function directly;
* for every format x scale rule x rounding (and the stochastic rounding 3/4
  pre-scale), on adversarial inputs along every axis and in every input dtype:
  ``quantize`` (codes, scales, tensor scale), ``dequantize``, ``fake_quantize``
  and ``fake_quantize_parts``, eagerly and under ``jax.jit``;
* the fused Pallas quantizer (interpreted) for a few specs.

Quantities that raise print the exception type and message instead of a hash
(so a changed error is a changed fingerprint too).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Fingerprint the checkout this script lives in (not an installed mxjax).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mxjax
from mxjax import operands as mxoperands
from mxjax import policies
from mxjax.dimensions import normalize_dimension_numbers
from mxjax.emulation.forms import accelerator_gemm
from mxjax.formats import FORMATS, Rounding, ScaleRule
from mxjax.quantization import fake_quantize_parts
from study.policies import ABLATIONS

jax.config.update("jax_platforms", "cpu")

# --------------------------------------------------------------------------- #
# Hashing
# --------------------------------------------------------------------------- #


def _leaf_bytes(leaf: Any) -> bytes:
    if leaf is None:
        return b"None"
    if isinstance(leaf, (str, int, float, bool)):
        return repr(leaf).encode()
    if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    a = np.asarray(leaf)
    return f"{a.dtype}{a.shape}".encode() + np.ascontiguousarray(a).tobytes()


def digest(tree: Any) -> str:
    """SHA-256 over every leaf's dtype, shape and raw bytes (NaN payloads included)."""
    h = hashlib.sha256()
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)
    h.update(str(treedef).encode())
    for leaf in leaves:
        h.update(_leaf_bytes(leaf))
    return h.hexdigest()


class Failed:
    """What a quantity gave when it raised: its exception type and first message line."""

    def __init__(self, e: Exception):
        self.text = f"raises {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def attempt(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with its outputs ready, or a Failed (a changed error is a changed print)."""
    try:
        return jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001
        return Failed(e)


class Report:
    def __init__(self, out):
        self.out = out
        self.lines: list[str] = []

    def add(self, name: str, quantity: str, value: Any) -> None:
        text = value.text if isinstance(value, Failed) else digest(value)
        line = f"{name:48s} {quantity:28s} {text}"
        self.lines.append(line)
        print(line, file=self.out, flush=True)

    def total(self) -> str:
        return hashlib.sha256("\n".join(self.lines).encode()).hexdigest()


def _part(value: Any, index: Any) -> Any:
    return value if isinstance(value, Failed) else value[index]


# --------------------------------------------------------------------------- #
# Inputs
# --------------------------------------------------------------------------- #


def _adversarial_fill(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Plants ties, zeros, subnormals, saturating magnitudes, NaN and Inf in f32 `x`."""
    x = x.copy()
    flat = x.reshape(-1)
    n = flat.size
    idx = rng.permutation(n)
    k = max(1, n // 40)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0], np.float32)
    flat[idx[:k]] = rng.choice(ties, k) * np.float32(2.0) ** rng.integers(-4, 5, k)
    flat[idx[k:2 * k]] = 0.0
    flat[idx[2 * k:3 * k]] = -0.0
    flat[idx[3 * k:4 * k]] = rng.choice(np.array([1e-40, -3e-42, 1.4e-45, 1e-39], np.float32), k)
    flat[idx[4 * k:5 * k]] = rng.choice(
        np.array([3.3e38, -3.4e38, 6e4, -65504.0, 1e30], np.float32), k)
    flat[idx[5 * k]] = np.nan
    flat[idx[5 * k + 1]] = np.inf
    flat[idx[5 * k + 2]] = -np.inf
    return x


def quant_input(dtype) -> jax.Array:
    """f32 [6, 36, 40] cast to `dtype`: slice 0 adversarial (ties, zeros, subnormals,
    saturating magnitudes, NaN, Inf), 1 all zeros, 2 subnormals, 3 the top binade,
    4-5 random values spread over 40 binades."""
    rng = np.random.default_rng(1234)
    shape = (6, 36, 40)
    base = rng.standard_normal(shape).astype(np.float32)
    base *= np.float32(2.0) ** rng.integers(-20, 20, (6, 36, 1)).astype(np.float32)
    x = base.copy()
    x[0] = _adversarial_fill(base[0], rng)
    x[1] = 0.0
    x[2] = np.float32(1e-40) * rng.choice([-1, 1], shape[1:]).astype(np.float32)
    x[3] = np.float32(3.3e38) * rng.uniform(0.5, 1.0, shape[1:]).astype(np.float32)
    return jnp.asarray(x).astype(dtype)


def gemm_cases() -> list[tuple[str, tuple[int, ...], tuple[int, ...], Any]]:
    return [
        ("2d_k70", (8, 70), (70, 24), (((1,), (0,)), ((), ()))),
        ("batched", (2, 8, 64), (2, 64, 16), (((2,), (1,)), ((0,), (0,)))),
        ("two_contract", (4, 6, 10), (6, 10, 12), (((1, 2), (0, 1)), ((), ()))),
        ("lhs_contract_first", (40, 8), (12, 40), (((0,), (1,)), ((), ()))),
    ]


def gemm_operands(lshape, rshape, dtype, adversarial: bool, seed: int):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(lshape).astype(np.float32)
    b = (rng.standard_normal(rshape) * 0.1).astype(np.float32)
    if adversarial:
        a = _adversarial_fill(a, rng)
        b2 = b.reshape(-1)
        b2[:: max(1, b2.size // 7)] = 0.0
        b2[1] = 1e-40
        b2[2] = 2.5
    return jnp.asarray(a).astype(dtype), jnp.asarray(b).astype(dtype)


# --------------------------------------------------------------------------- #
# Presets: dot_general, gradients, diagnostics, accelerator form
# --------------------------------------------------------------------------- #


def _vjp_fn(policy, dims):
    def f(a, b, g, key):
        y, vjp = jax.vjp(lambda a, b: mxjax.dot_general(a, b, dims, policy=policy, key=key), a, b)
        da, db = vjp(g)
        return y, da, db
    return f


def _stats_fn(policy, dims):
    def loss(params, a, g, key):
        y = mxjax.dot_general(a, params, dims, policy=policy, key=key)
        return jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32)), {}

    vg = mxjax.diagnostics.value_and_grad_with_stats(loss)

    def f(b, a, g, key):
        (_, aux), _ = vg(b, a, g, key)
        return aux["gemm_stats"]
    return f


def _accelerator_fn(policy, dims):
    """Each quantized GEMM recipe of `policy` in its accelerator form, on (a, b)."""
    def f(a, b, key):
        nd = normalize_dimension_numbers(dims, a.shape, b.shape)
        out = {}
        for gname, recipe in policy.gemms.items():
            if recipe.is_passthrough:
                continue
            a3, b3 = mxoperands.canonical_operands(a, b, nd)
            a3, b3, k_lhs, k_rhs = mxoperands.quantizer_operands(
                a3, b3, recipe, key if recipe.needs_key else None)
            out[gname] = accelerator_gemm(a3, b3, recipe, k_lhs, k_rhs)
        return out
    return f


def fingerprint_presets(rep: Report, presets: list[str]) -> None:
    key = jax.random.key(7)
    for name in presets:
        policy = policies.get(name)
        for i, (case, ls, rs, dims) in enumerate(gemm_cases()):
            f = _vjp_fn(policy, dims)
            jf = jax.jit(f)
            for dtype, adv in itertools.product((jnp.float32, jnp.bfloat16), (False, True)):
                tag = f"{name}/{case}/{jnp.dtype(dtype).name}/{'adv' if adv else 'normal'}"
                a, b = gemm_operands(ls, rs, dtype, adv, seed=11 + i)
                out_shape = jax.eval_shape(partial(jax.lax.dot_general, dimension_numbers=dims),
                                           a, b).shape
                g = jnp.asarray(np.random.default_rng(5).standard_normal(out_shape), dtype)
                res = attempt(jf, a, b, g, key)
                for j, gname in enumerate(("fprop", "dgrad", "wgrad")):
                    rep.add(tag, f"{gname} jit", _part(res, j))
                if i == 0 and dtype == jnp.float32:
                    # Eager (op by op) on one shape: each new shape compiles every op anew.
                    rep.add(tag, "fwd+grads eager", attempt(f, a, b, g, key))
                if adv or dtype != jnp.float32:
                    continue  # diagnostics and the accelerator form: well-behaved f32 inputs
                rep.add(tag, "diagnostics jit",
                        attempt(jax.jit(_stats_fn(policy, dims)), b, a, g, key))
                rep.add(tag, "accelerator gemms jit",
                        attempt(jax.jit(_accelerator_fn(policy, dims)), a, b, key))


# --------------------------------------------------------------------------- #
# Quantizer
# --------------------------------------------------------------------------- #


def quant_recipes():
    """(label, fmt, scale_rule, rounding, sr_prescale) for every valid combination."""
    out = []
    for fmt in FORMATS.values():
        if fmt.is_passthrough:
            continue
        rules = list(ScaleRule) if fmt.scale == "e8m0" else [ScaleRule.FLOOR]
        for rule in rules:
            for mode in Rounding:
                out.append((f"{fmt.name}/{rule.value}/{mode.value}", fmt, rule, mode, False))
            out.append((f"{fmt.name}/{rule.value}/stochastic+prescale", fmt, rule,
                        Rounding.STOCHASTIC, True))
    return out


def _quant_all(fmt, rule, mode, prescale):
    def f(x, key):
        res = {}
        for axis in range(x.ndim):
            kw = {"scale_rule": rule, "rounding": mode, "key": key, "sr_prescale": prescale}
            q = mxjax.quantize(x, fmt, axis, **kw)
            res[f"ax{axis}/quantize"] = (q.codes, q.scales, q.tensor_scale)
            res[f"ax{axis}/dequantize"] = (mxjax.dequantize(q), mxjax.dequantize(q, x.dtype))
            res[f"ax{axis}/fake"] = mxjax.fake_quantize(x, fmt, axis, **kw)
            res[f"ax{axis}/parts"] = fake_quantize_parts(x, fmt, axis, **kw)
        return res
    return f


def fingerprint_quantizer(rep: Report, eager: bool) -> None:
    key = jax.random.key(3)
    inputs = {jnp.dtype(d).name: quant_input(d) for d in (jnp.float32, jnp.bfloat16,
                                                          jnp.float16)}
    for label, fmt, rule, mode, prescale in quant_recipes():
        f = _quant_all(fmt, rule, mode, prescale)
        jf = jax.jit(f)
        for dname, x in inputs.items():
            if dname == "float16" and mode is not Rounding.NEAREST_EVEN:
                continue  # f16: every scale rule under the default rounding
            res = attempt(jf, x, key)
            for quantity in ("quantize", "dequantize", "fake", "parts"):
                picked = res if isinstance(res, Failed) else {
                    k: v for k, v in res.items() if k.endswith("/" + quantity)}
                rep.add(f"{label}/{dname}", f"jit {quantity}", picked)
            if eager and dname == "float32":
                # Eager (op by op) on f32 only: every new dtype compiles every op anew.
                rep.add(f"{label}/{dname}", "eager all", attempt(f, x, key))


def _quant_spec(hadamard=None, **recipe):
    """A fused-quantizer spec, in whichever form this checkout's mxjax.kernels takes.

    (QuantSpec held loose recipe fields before it took an OperandRecipe; the
    fingerprint must run on both sides of that change.)
    """
    import dataclasses

    from mxjax.kernels import QuantSpec

    if "recipe" in {f.name for f in dataclasses.fields(QuantSpec)}:
        return QuantSpec(recipe=mxjax.OperandRecipe(**recipe), hadamard=hadamard)
    return QuantSpec(hadamard=hadamard, **recipe)


def fingerprint_pallas(rep: Report) -> None:
    rng = np.random.default_rng(9)
    x = _adversarial_fill(rng.standard_normal((64, 96)).astype(np.float32), rng)
    x = jnp.asarray(x)
    key = jax.random.key(4)
    specs = {
        "mxfp4_even_rne": _quant_spec(fmt="mxfp4", scale_rule="even"),
        "mxfp4_floor_sr_h16": _quant_spec(fmt="mxfp4", rounding="stochastic", hadamard=16),
        "mxfp8e4m3_rceil_sr_pre": _quant_spec(fmt="mxfp8_e4m3", scale_rule="rceil",
                                              rounding="stochastic", sr_prescale=True),
        "mxfp8e5m2_ceil_rtz_h32": _quant_spec(fmt="mxfp8_e5m2", scale_rule="ceil",
                                              rounding="toward_zero", hadamard=32),
    }
    for name, spec in specs.items():
        for dtype in (jnp.float32, jnp.bfloat16):
            rep.add(f"pallas/{name}/{jnp.dtype(dtype).name}", "fused_quantize row+col",
                    attempt(_fused_copies, x.astype(dtype), spec, key))


def _fused_copies(x, spec, key):
    from mxjax.kernels import fused_quantize

    rq, cq = fused_quantize(x, row=spec, col=spec, row_key=key,
                            col_key=jax.random.fold_in(key, 1), interpret=True)
    return (rq.codes, rq.scales, cq.codes, cq.scales)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default=",".join(n for n in policies.names()
                                                 if n not in ABLATIONS),
                   help="comma-separated presets (default: all 12)")
    p.add_argument("--no-eager-quantizer", action="store_true",
                   help="skip the eager quantizer runs (the slowest part)")
    p.add_argument("--skip", default="", help="comma-separated parts: presets,quantizer,pallas")
    p.add_argument("--cache-dir", default=None,
                   help="JAX persistent compilation cache (a rerun whose programs are "
                        "unchanged then skips compiling; values are those of the same "
                        "executables)")
    args = p.parse_args(argv)
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    skip = set(filter(None, args.skip.split(",")))
    rep = Report(sys.stdout)
    print(f"# mxjax numerics fingerprint, jax {jax.__version__}, backend "
          f"{jax.default_backend()}, mxjax from {Path(mxjax.__file__).parent}")
    if "presets" not in skip:
        fingerprint_presets(rep, args.presets.split(","))
    if "quantizer" not in skip:
        fingerprint_quantizer(rep, eager=not args.no_eager_quantizer)
    if "pallas" not in skip:
        fingerprint_pallas(rep)
    print(f"TOTAL {rep.total()}  ({len(rep.lines)} quantities)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
