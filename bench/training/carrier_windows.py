"""How often the MXFP4 routes' exact carriers hold a training run's GEMM operands.

'xla_fp8' carries an operand exactly when its live blocks' scale exponents span at most
28 binades (lhs, E5M2) or 14 (rhs, E4M3); 'xla_fp4' when they span at most 17 (NVFP4's
E4M3 scales). A GEMM whose operand does not fit runs the emulation instead
(docs/NUMERICS.md): right, but at the emulation's speed. `observe_spans` trains the tiny
Llama (configs/tiny.yaml, the bundled corpus) under a policy on this CPU and, every
``every`` steps, traces one train step with every GEMM observed: the span of each
quantized operand (after the recipe's rotation) per GEMM kind and side; `report_lines`
gives the share of GEMMs each route would carry.
"""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mxjax import interceptor, operands
from mxjax.quantization import quantize_with
from mxjax.routes import xla_fp4, xla_fp8

__all__ = ["WINDOWS", "observe_spans", "operand_span", "report_lines"]

ROOT = Path(__file__).resolve().parents[2]
# Route -> (lhs window, rhs window): the most binades the live blocks' scale exponents may
# span for the route to carry the operand exactly.
_E4M3_LO, _E4M3_HI = xla_fp4.E4M3_POW2_RANGE
WINDOWS = {"xla_fp8": (xla_fp8.LHS_CARRIER.span, xla_fp8.RHS_CARRIER.span),
           "xla_fp4": (_E4M3_HI - _E4M3_LO,) * 2}


def operand_span(x3: jax.Array, op, key) -> jax.Array:
    """int32: max - min scale exponent over the live blocks of `x3` quantized by `op` (-1:
    none live; 1000: a NaN/Inf block, which no carrier holds)."""
    q = quantize_with(x3, op, -1, key=key)
    scale = q.scales.astype(jnp.int32)
    codes = q.codes.reshape(q.codes.shape[:-1] + (scale.shape[-1], -1))
    live = jnp.any((codes & 0x77) != 0, axis=-1) & (scale != 255)
    s = scale - 127
    big = jnp.int32(1 << 20)
    span = jnp.max(jnp.where(live, s, -big)) - jnp.min(jnp.where(live, s, big))
    span = jnp.where(jnp.any(live), span, -1)
    return jnp.where(jnp.any(scale == 255), 1000, span)


def observe_spans(policy: str, steps: int, every: int,
                  seed: int = 0) -> list[tuple[int, str, int, int]]:
    """(step, GEMM name, lhs span, rhs span) of every quantized GEMM of the tiny config's
    train step under `policy`, observed at steps 0, every, 2 * every, ... up to `steps`
    while it trains."""
    from train import config as cfgmod
    from train.plan import validate
    from train.run import CompiledRun
    from train.step import policy_base_key

    out = tempfile.mkdtemp(prefix="carrier_windows_")
    cfg = cfgmod.load(ROOT / "configs" / "tiny.yaml",
                      [f"policy={policy}", f"train.steps={steps}", f"out_dir={out}"])
    plan = validate(cfg, verbose=False)
    run = CompiledRun(plan)
    state = run.init_state(seed)
    loader = run.loader(seed)
    step = run.train_step(plan.policy)
    base = policy_base_key(seed)
    spans: list[tuple[int, str, int, int]] = []
    current = [0]

    def on_gemm(record):
        if record.recipe.is_passthrough:
            return
        a3, b3 = operands.canonical_operands(record.lhs, record.rhs, record.dims)
        a3, b3, k_lhs, k_rhs = operands.quantizer_operands(a3, b3, record.recipe, record.key)
        jax.debug.callback(
            lambda a, b, g=record.name: spans.append((current[0], g, int(a), int(b))),
            operand_span(a3, record.recipe.lhs, k_lhs), operand_span(b3, record.recipe.rhs, k_rhs))

    def hook(call):
        return call(call.lhs, call.rhs, call.key, on_gemm=on_gemm)

    observed = _observed_step(run, plan.policy, hook)
    for k in range(steps + 1):
        batch = run.put(loader.batch(k))
        if k % every == 0:
            current[0] = k
            jax.block_until_ready(observed(state, batch, base))
        if k < steps:
            state, _ = step(state, batch, base)
    return spans


def _observed_step(run, policy, hook):
    """The run's train step with every GEMM observed (its result is not kept: the state
    donated to it is the caller's copy, not the one training goes on with)."""
    from train.step import make_train_step

    step = make_train_step(graphdef=run.layout.graphdef, policy=policy, tx=run.tx,
                           schedule=run.schedule, accum_steps=run.config.accum_steps)

    def fn(state, batch, base):
        with interceptor.observe(hook):
            return step(state, batch, base)

    return jax.jit(fn)


def report_lines(spans, policy: str, steps: int, every: int) -> list[str]:
    """The spans per GEMM kind and side, and the share of GEMMs each route carries."""
    by = collections.defaultdict(list)
    for _, g, a, b in spans:
        by[(g, "lhs")].append(a)
        by[(g, "rhs")].append(b)
    lines = [(f"policy {policy}, tiny Llama, steps 0..{steps} every {every}: "
             f"{len(spans)} quantized GEMMs; span = binades between the live blocks' largest "
             "and smallest scale"),
             f"{'gemm':6} {'side':4} {'n':>5} {'span min':>8} {'median':>6} {'max':>5}  "
             + "  ".join(f"{r} fits" for r in WINDOWS)]
    for (g, side), xs in sorted(by.items()):
        xs = np.asarray(xs)
        fits = [np.mean(xs <= WINDOWS[r][side == "rhs"]) for r in WINDOWS]
        lines.append(f"{g:6} {side:4} {len(xs):5d} {xs.min():8d} {int(np.median(xs)):6d} "
                     f"{xs.max():5d}  " + "  ".join(f"{f:12.1%}" for f in fits))
    for r, (lw, rw) in WINDOWS.items():
        ok = np.mean([a <= lw and b <= rw for _, _, a, b in spans])
        lines.append(f"{r}: {ok:.1%} of {len(spans)} GEMMs carried (the rest take the emulation)")
    return lines
