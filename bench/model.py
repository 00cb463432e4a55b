"""Forward+backward tokens/s of the Llama model under precision policies.

One process, one model, one batch; the policies are timed interleaved (round
robin: each round runs every policy once) after compilation and warm-up, and
the median step time per policy is reported with its ratio to no policy.

    .venv/bin/python bench/model.py                 # tiny config, CPU-sized
    .venv/bin/python bench/model.py --config llama3_1b --batch 4 --seq 2048 --dtype bfloat16

On CPU the MXFP4 policies run the emulation (quantize -> dequantize -> f32 GEMM),
so they are slower than no policy; the ratio measures the emulation's overhead,
not FP4 hardware speed.
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

from models.llama import Llama, LlamaConfig
from mxjax import policies

DEFAULT_POLICIES = ("none", "bf16", "mxfp4_all", "mxfp4_all_h16")


def _get_policy(name: str):
    """The policy for ``name`` ('none' -> None); an unknown name is an error."""
    if name == "none":
        return None
    if name not in policies.names():
        raise SystemExit(f"--policies: unknown policy {name!r}; known: none, "
                         f"{', '.join(policies.names())}")
    return policies.get(name)


def make_step(model: Llama, policy):
    graphdef, state = nnx.split(model)

    def loss_fn(params, tokens, key):
        m = nnx.merge(graphdef, params)
        logits = m(tokens[:, :-1], policy=policy,
                   policy_key=key if policy is not None and policy.needs_key else None)
        tgt = tokens[:, 1:]
        lse = jax.nn.logsumexp(logits, -1)
        return jnp.mean(lse - jnp.take_along_axis(logits, tgt[..., None], -1)[..., 0])

    step = jax.jit(jax.value_and_grad(loss_fn))
    return step, state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", choices=["tiny", "llama3_1b", "llama3_8b"])
    ap.add_argument("--vocab", type=int, default=512, help="vocab size (tiny only)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    args = ap.parse_args(argv)

    preset = getattr(LlamaConfig, args.config)
    kw = {"dtype": args.dtype, "remat": args.remat}
    cfg = preset(vocab_size=args.vocab, **kw) if args.config == "tiny" else preset(**kw)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq + 1), 0,
                                cfg.vocab_size, dtype=jnp.int32)
    key = jax.random.key(1)
    ntok = args.batch * args.seq
    print(f"# bench/model.py: {args.config} (d {cfg.dim}, {cfg.n_layers} layers, "
          f"vocab {cfg.vocab_size}), batch {args.batch} x seq {args.seq} = {ntok} tokens, "
          f"compute {args.dtype}, backend {jax.default_backend()} "
          f"({jax.device_count()} device(s)), jax {jax.__version__}")

    steps = {}
    for name in args.policies.split(","):
        pol = _get_policy(name)
        step, state = make_step(model, pol)
        t0 = time.perf_counter()
        jax.block_until_ready(step(state, tokens, key))
        compile_s = time.perf_counter() - t0
        for _ in range(args.warmup):
            jax.block_until_ready(step(state, tokens, key))
        steps[name] = (step, state, compile_s)
    if "none" not in steps:
        print("error: the 'none' baseline must be among --policies", file=sys.stderr)
        return 1

    times: dict[str, list[float]] = {n: [] for n in steps}
    for _ in range(args.rounds):
        for name, (step, state, _) in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(state, tokens, key))
            times[name].append(time.perf_counter() - t0)

    base = statistics.median(times["none"])
    print(f"{'policy':<16}{'median step ms':>16}{'tokens/s':>14}{'vs none':>10}"
          f"{'compile s':>12}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<16}{med * 1e3:>16.1f}{ntok / med:>14.0f}{base / med:>10.3f}"
              f"{steps[name][2]:>12.1f}")
    print(f"# median over {args.rounds} interleaved rounds after {args.warmup} warm-up; "
          "'vs none' = no-policy step time / policy step time (tokens/s ratio)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
