"""Trace, lower and compile time of the Llama train step's value_and_grad under policies.

A quantized GEMM stages out all three platform forms (CPU, GPU, TPU) when it is
traced, so tracing, not compiling, dominates small quantized programs. mxjax jits
the emulated GEMM (and the quantizer) so that JAX caches their traces: GEMMs of
the same shapes and recipe (k and v, gate and up, unrolled layers) are traced once.
Each measurement starts from empty caches (``jax.clear_caches()``); policies are
measured interleaved, round robin, and the median per phase is reported with its
ratio to no policy.

    .venv/bin/python bench/trace_time.py
    .venv/bin/python bench/trace_time.py --unrolled --layers 8 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.model import _get_policy, make_step
from models.llama import Llama, LlamaConfig

DEFAULT_POLICIES = ("none", "mxfp4_all", "mxfp4_all_h16")
PHASES = ("trace", "lower", "compile")


def _phases(model, policy, tokens, key) -> dict[str, float]:
    jax.clear_caches()
    step, state = make_step(model, policy)
    t0 = time.perf_counter()
    traced = step.trace(state, tokens, key)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    return {"trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--unrolled", action="store_true", help="scan_layers=False")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    if "none" not in names:
        names.insert(0, "none")
    cfg = LlamaConfig.tiny(vocab_size=512, n_layers=args.layers,
                           scan_layers=not args.unrolled)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq + 1), 0,
                                cfg.vocab_size, dtype=jnp.int32)
    key = jax.random.key(1)
    print(f"# bench/trace_time.py: tiny Llama, {cfg.n_layers} layers "
          f"({'unrolled' if args.unrolled else 'scanned'}), d {cfg.dim}, batch {args.batch} x "
          f"seq {args.seq}, jax {jax.__version__} on {jax.default_backend()}")
    times = {n: {p: [] for p in PHASES} for n in names}
    for r in range(args.rounds + 1):  # round 0 warms up JAX itself
        for name in names[r % len(names):] + names[:r % len(names)]:
            got = _phases(model, _get_policy(name), tokens, key)
            if r:
                for p in PHASES:
                    times[name][p].append(got[p])
    med = {n: {p: statistics.median(v) for p, v in t.items()} for n, t in times.items()}
    print(f"{'policy':<16}" + "".join(f"{p + ' s':>11}{'vs none':>9}" for p in PHASES)
          + f"{'total s':>10}")
    for name in names:
        row = "".join(f"{med[name][p]:>11.2f}{med[name][p] / med['none'][p]:>9.2f}"
                      for p in PHASES)
        print(f"{name:<16}{row}{sum(med[name].values()):>10.2f}")
    print(f"# median over {args.rounds} interleaved rounds after one warm-up round, each "
          "from empty caches (jax.clear_caches())")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
