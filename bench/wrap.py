"""What ``mxjax.nn.wrap`` costs: compile time and step time, wrapped vs policy injected.

The same Linen model (``--layers`` pre-norm MLP blocks of width ``--dim``, Dense
layers only, so both variants quantize the same GEMMs) is run two ways under
one policy: ``mxjax.nn.wrap(model, policy)`` and the model built with
``dot_general=policy.dot_general()`` in every Dense. A training step is
``value_and_grad`` of a squared loss. Compile time = trace + lower + compile of
a fresh ``jax.jit`` each round; step time = the compiled step, ``--iters`` calls
per round. Rounds alternate the two variants (the order flips each round);
the table gives medians and the wrapped/injected ratios. It also checks that
both give the same loss and gradients bit for bit and compile to the same
optimized HLO (modulo metadata): then any step-time difference is noise.

    python bench/wrap.py [--policy mxfp4_all --dim 256 --layers 4 --batch 256 --rounds 5]

Target: compile time within 1.5x, step time within noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

import mxjax.nn as mnn
from mxjax import policies
from mxjax.testing import program_text


class Block(nn.Module):
    dim: int
    dot_general: object = None

    @nn.compact
    def __call__(self, x):
        kw = {} if self.dot_general is None else {"dot_general": self.dot_general}
        h = nn.Dense(4 * self.dim, name="up", **kw)(nn.LayerNorm(name="norm")(x))
        return x + nn.Dense(self.dim, name="down", **kw)(jax.nn.gelu(h))


class Model(nn.Module):
    dim: int
    layers: int
    dot_general: object = None

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = Block(self.dim, self.dot_general, name=f"block_{i}")(x)
        return x


def _step(apply):
    def step(params, x):
        return jax.value_and_grad(lambda p: jnp.mean(apply(p, x) ** 2))(params)

    return step


def run(policy_name: str, dim: int, layers: int, batch: int, rounds: int, iters: int) -> dict:
    policy = policies.get(policy_name)
    x = jax.random.normal(jax.random.key(1), (batch, dim), jnp.float32)
    params = Model(dim, layers).init(jax.random.key(0), x)
    applies = {
        "wrapped": lambda: mnn.wrap(Model(dim, layers), policy).apply,
        "injected": lambda: Model(dim, layers, policy.dot_general()).apply,
    }
    compile_s: dict[str, list[float]] = {k: [] for k in applies}
    step_s: dict[str, list[float]] = {k: [] for k in applies}
    compiled = {}
    outs = {}
    for r in range(rounds + 1):  # round 0 warms up (imports, first-use caches)
        order = list(applies) if r % 2 == 0 else list(applies)[::-1]
        for name in order:
            t0 = time.perf_counter()
            exe = jax.jit(_step(applies[name]())).lower(params, x).compile()
            dt = time.perf_counter() - t0
            compiled[name] = exe
            out = exe(params, x)
            jax.block_until_ready(out)
            outs[name] = out
            t0 = time.perf_counter()
            for _ in range(iters):
                out = exe(params, x)
            jax.block_until_ready(out)
            if r:
                compile_s[name].append(dt)
                step_s[name].append((time.perf_counter() - t0) / iters)
    same = all(bool(jnp.array_equal(a, b)) for a, b in
               zip(jax.tree.leaves(outs["wrapped"]), jax.tree.leaves(outs["injected"])))
    same_hlo = program_text(compiled["wrapped"]) == program_text(compiled["injected"])
    return {"compile": {k: statistics.median(v) for k, v in compile_s.items()},
            "same_hlo": same_hlo,
            "step": {k: statistics.median(v) for k, v in step_s.items()},
            "step_spread": {k: (min(v), max(v)) for k, v in step_s.items()},
            "identical": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="mxfp4_all")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    res = run(a.policy, a.dim, a.layers, a.batch, a.rounds, a.iters)
    print(f"mxjax.nn.wrap vs injected dot_general: policy {a.policy}, {a.layers} blocks of "
          f"width {a.dim}, batch {a.batch}, {jax.devices()[0].platform} (jax {jax.__version__}); "
          f"median of {a.rounds} interleaved rounds after 1 warm-up, {a.iters} steps per round")
    print(f"{'':<10}  {'compile s':>10}  {'step ms':>9}  {'step ms min..max':>18}")
    for k in ("wrapped", "injected"):
        lo, hi = res["step_spread"][k]
        print(f"{k:<10}  {res['compile'][k]:>10.3f}  {res['step'][k] * 1e3:>9.3f}  "
              f"{lo * 1e3:>8.3f}..{hi * 1e3:<8.3f}")
    ratio = res['compile']['wrapped'] / res['compile']['injected']
    print(f"ratio wrapped/injected: compile {ratio:.2f}x"
          f" (target <= 1.5x), step {res['step']['wrapped'] / res['step']['injected']:.2f}x "
          "(target: within noise)")
    print(f"loss and gradients identical: {res['identical']}; optimized HLO identical (modulo "
          f"metadata): {res['same_hlo']}")


if __name__ == "__main__":
    main()
