"""Forward + backward of one GEMM under mxjax policies, side by side in one process.

Times ``y, (dx, dw) = vjp(dot_general)(x, w)(g)`` for an [M, K] x [K, N] f32 GEMM
under plain ``lax.dot_general``, ``jax.nn.scaled_dot_general`` with the 'mxfp4'
config (all three GEMMs), and the mxjax presets bf16, fp8, mxfp4_all and
mxfp4_all_h16. Each variant is jitted and warmed up; the rounds are interleaved
(every round times every variant once, in a rotating order) so machine noise
hits all of them alike; the table gives medians and ratios to plain.

    python bench/dot_general.py [--m 8192 --k 1024 --n 1024 --rounds 7 --warmup 2]

Targets: mxfp4_all no slower than scaled_dot_general mxfp4;
mxfp4_all_h16 within 1.2x of mxfp4_all.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

import mxjax

DIMS = (((1,), (0,)), ((), ()))
POLICIES = ("bf16", "fp8", "mxfp4_all", "mxfp4_all_h16")


def _fwd_bwd(dot):
    def step(x, w, g):
        y, vjp = jax.vjp(dot, x, w)
        dx, dw = vjp(g)
        return y, dx, dw

    return jax.jit(step)


def variants() -> dict:
    out = {"lax.dot_general": _fwd_bwd(lambda x, w: lax.dot_general(x, w, DIMS))}
    cfg = jax.nn.get_scaled_dot_general_config("mxfp4")
    out["jax.nn.scaled_dot_general mxfp4"] = _fwd_bwd(
        lambda x, w: jax.nn.scaled_dot_general(x, w, DIMS, configs=[cfg, cfg, cfg]))
    for name in POLICIES:
        out[f"mxjax {name}"] = _fwd_bwd(
            lambda x, w, name=name: mxjax.dot_general(x, w, DIMS, policy=name))
    return out


def run(m: int, k: int, n: int, rounds: int, warmup: int) -> dict[str, float]:
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5
    g = jax.random.normal(kg, (m, n), jnp.float32)
    fns = variants()
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(x, w, g))
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[name](x, w, g))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    med = run(a.m, a.k, a.n, a.rounds, a.warmup)
    base = med["lax.dot_general"]
    print(f"fwd+bwd of [{a.m}, {a.k}] x [{a.k}, {a.n}] f32 on {jax.devices()[0].platform} "
          f"(jax {jax.__version__}); median of {a.rounds} interleaved rounds after {a.warmup} "
          "warm-up calls")
    width = max(map(len, med))
    print(f"{'variant':<{width}}  {'median ms':>10}  {'vs plain':>8}")
    for name, t in med.items():
        print(f"{name:<{width}}  {t * 1e3:>10.2f}  {t / base:>7.2f}x")
    sdg = med["jax.nn.scaled_dot_general mxfp4"]
    mx, h16 = med["mxjax mxfp4_all"], med["mxjax mxfp4_all_h16"]
    print(f"target mxfp4_all <= scaled_dot_general mxfp4: {mx / sdg:.2f}x "
          f"({'met' if mx <= sdg else 'MISSED'})")
    print(f"target mxfp4_all_h16 <= 1.2x mxfp4_all: {h16 / mx:.2f}x "
          f"({'met' if h16 <= 1.2 * mx else 'MISSED'})")


if __name__ == "__main__":
    main()
