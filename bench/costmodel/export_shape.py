"""The quantized GEMMs of an exported program, read from its StableHLO (`analyze`).

`layer_train_step` builds a decoder layer's train step (loss, and gradients w.r.t. the
layer's parameters and its input) under a policy or a policy-like object; `export_text`
exports it with ``jax.export`` for a platform from this machine (abstract shapes only);
`analyze` counts the quantized GEMMs: operand dtypes, precision, ``optimization_barrier``
count and block/tensor amax reductions. bench/export_shape.py prints them per platform.

A dot counts as a GEMM of the interceptor when its source location chain
reaches ``mxjax/gemm.py`` or ``mxjax/interceptor.py`` (``mxjax/dot_general.py``
before the module split):
backward GEMMs carry the location of the custom_vjp call, not of the code
inside it, so this is what identifies them in any version of the code. Under
a policy that quantizes all three GEMMs (every policy here but ``bf16``)
those are the quantized GEMMs.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

INTERCEPTOR_FILES = ("mxjax/dot_general.py", "mxjax/interceptor.py",
                     "mxjax/gemm.py")
POLICIES = ("bf16", "mxfp4_all_h16", "mxfp4_all", "nvfp4", "fp8")
PLATFORMS = ("cpu", "cuda", "tpu")

_FUNC_RE = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$-]+)\(")
_CALL_RE = re.compile(r"\b(?:func\.)?call @([\w.$-]+)\(")
_DOT_RE = re.compile(
    r"stablehlo\.dot_general [^:]*: "
    r"\(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>.*?loc\((#loc\d+)\)")
_PRECISION_RE = re.compile(r"precision = \[(\w+), (\w+)\]")
_LOC_DEF_RE = re.compile(r"^(#loc\d+) = loc\((.*)\)\s*$")
_LOC_NAME_RE = re.compile(r'"([^"]*)"[(:]')
_LOC_REF_RE = re.compile(r"#loc\d+")
_AMAX_RE = re.compile(r"applies stablehlo\.maximum across dimensions = \[[\d, ]*\] : "
                      r"\(tensor<[^>]*xui32>")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dot:
    """One dot_general of a module (repeated once per call of its function)."""

    lhs: str
    rhs: str
    out: str
    precision: str  # 'DEFAULT' when the op carries no precision attribute
    quantized: bool

    @property
    def signature(self) -> str:
        return f"{self.lhs} x {self.rhs} -> {self.out} @ {self.precision}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModuleShape:
    """What a lowered module contains, counted over its call graph from @main."""

    dots: tuple[Dot, ...]
    barriers: int
    amax_reductions: int  # reduce-max over uint32 |x| bits: one per block/tensor amax
    tpu_kernels: int = 0  # Pallas TPU (Mosaic) custom calls: mxjax's quantize kernels

    @property
    def quantized(self) -> tuple[Dot, ...]:
        return tuple(d for d in self.dots if d.quantized)

    @property
    def f32_highest(self) -> int:
        return sum(1 for d in self.quantized
                   if (d.lhs, d.rhs) == ("f32", "f32") and d.precision == "HIGHEST")


def _loc_names(loc: str, defs: dict[str, str], memo: dict[str, frozenset]) -> frozenset:
    if loc in memo:
        return memo[loc]
    memo[loc] = frozenset()  # cycle guard
    body = defs.get(loc, "")
    names = set(_LOC_NAME_RE.findall(body))
    for ref in _LOC_REF_RE.findall(body):
        names |= _loc_names(ref, defs, memo)
    memo[loc] = frozenset(names)
    return memo[loc]


def _dtype(tensor_type: str) -> str:
    return tensor_type.rsplit("x", 1)[-1]


def analyze(text: str, *, quantized_policy: bool = True) -> ModuleShape:
    """Counts dots (with operand dtypes, precision, quantized or not), barriers and amax
    reductions of a StableHLO module, each function's ops once per call from @main.

    ``quantized_policy``: whether the interceptor's GEMMs are quantized (False for a
    pass-through policy such as bf16).
    """
    defs = {}
    for line in text.splitlines():
        m = _LOC_DEF_RE.match(line)
        if m:
            defs[m.group(1)] = m.group(2)
    memo: dict[str, frozenset] = {}
    own: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        m = _FUNC_RE.match(line)
        if m:
            current = m.group(1)
            own[current] = {"dots": [], "barriers": 0, "amax": 0, "kernels": 0, "calls": []}
            continue
        if current is None:
            continue
        f = own[current]
        f["calls"] += _CALL_RE.findall(line)
        f["barriers"] += line.count("stablehlo.optimization_barrier")
        f["amax"] += len(_AMAX_RE.findall(line))
        f["kernels"] += line.count("@tpu_custom_call")
        if "stablehlo.dot_general" in line:
            d = _DOT_RE.search(line)
            if d is None:
                raise ValueError(f"unparsed dot_general: {line.strip()[:200]}")
            lhs, rhs, out, loc = d.groups()
            p = _PRECISION_RE.search(line)
            names = _loc_names(loc, defs, memo)
            quantized = quantized_policy and any(n.endswith(INTERCEPTOR_FILES) for n in names)
            f["dots"].append(Dot(lhs=_dtype(lhs), rhs=_dtype(rhs), out=_dtype(out),
                                 precision=p.group(1) if p else "DEFAULT",
                                 quantized=quantized))

    totals: dict[str, tuple] = {}

    def total(name: str, depth: int = 0):
        if name in totals:
            return totals[name]
        if depth > 100:
            raise ValueError("call graph too deep (recursion?)")
        f = own[name]
        dots, barriers, amax, kernels = list(f["dots"]), f["barriers"], f["amax"], f["kernels"]
        for callee in f["calls"]:
            cd, cb, ca, ck = total(callee, depth + 1)
            dots += cd
            barriers += cb
            amax += ca
            kernels += ck
        totals[name] = (dots, barriers, amax, kernels)
        return totals[name]

    dots, barriers, amax, kernels = total("main")
    return ModuleShape(dots=tuple(dots), barriers=barriers, amax_reductions=amax,
                       tpu_kernels=kernels)


def export_text(fn, args, platform: str) -> str:
    """StableHLO text of ``jax.jit(fn)`` exported for one platform."""
    return jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()


def layer_train_step(config, policy_name, batch: int, seq: int):
    """(fn, abstract args): loss and grads of one DecoderLayer w.r.t. its params and input.

    ``policy_name``: a preset name, None (plain lax.dot_general), or a policy-like object
    (``.dot_general(key)``, ``.needs_key``: bench/costmodel/peers.py).
    """
    from flax import nnx

    from models.llama import DecoderLayer, rope_cos_sin, rope_inv_freq
    from mxjax import policies

    layer = nnx.eval_shape(lambda: DecoderLayer(config, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(layer)
    policy = policies.get(policy_name) if isinstance(policy_name, str) else policy_name
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype) if (
        policy is not None and policy.needs_key) else None

    def step(p, x, k):
        def loss(p, x):
            inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
            cos, sin = rope_cos_sin(jnp.arange(seq, dtype=jnp.int32), inv)
            y = nnx.merge(graphdef, p)(x, 0, cos, sin, policy=policy, policy_key=k)
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1))(p, x)

    x = jax.ShapeDtypeStruct((batch, seq, config.dim), config.dtype)
    return step, (params, x, key)
