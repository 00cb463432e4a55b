"""train.memory's estimate against XLA's buffer assignment of the real train step.

For a few model shapes, prints the estimate (`train.memory.estimate`) beside
``compiled.memory_analysis()`` of the jitted train step (state donated, as the trainer
runs it): arguments + outputs - aliased + temporaries, and their ratio. The CPU rows compile
here; ``--target h200`` (or h100, b200) compiles deviceless for that GPU (the CUDA PJRT
plugin, ``pip install 'mxjax[aot-gpu]'``; see bench/costmodel/aot.py).

    PYTHONPATH=. .venv/bin/python bench/memory_estimate.py
    PYTHONPATH=. .venv-aot/bin/python bench/memory_estimate.py --target h200
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (name, LlamaConfig.tiny overrides, seq_len, micro-batch, compute dtype)
SHAPES = [
    ("tiny-test", {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                       "ffn_dim": 128}, 64, 8, "float32"),
    ("d512-L4", {"vocab_size": 8192, "dim": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4,
                     "ffn_dim": 1536}, 512, 4, "bfloat16"),
    ("d1024-L8-seq2048", {"vocab_size": 32000, "dim": 1024, "n_layers": 8, "n_heads": 16,
                              "n_kv_heads": 8, "ffn_dim": 3584}, 2048, 2, "bfloat16"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cpu",
                    help="cpu, or a GPU of bench/costmodel/aot.py (h200, ...)")
    ap.add_argument("--remat", action="store_true", help="also each shape with remat")
    ap.add_argument("--policy", default=None, help="a precision policy (default: none)")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (default all)")
    args = ap.parse_args()
    from bench.costmodel import aot

    if args.target != "cpu":
        aot.use_cpu_host()
    import dataclasses

    import jax
    import jax.numpy as jnp

    from models.llama import LlamaConfig
    from mxjax import policies
    from train import config as cfgmod
    from train import memory
    from train.optimizer import make_optimizer
    from train.state import make_state_layout
    from train.step import make_train_step

    target = aot.TARGETS[args.target]
    mesh = aot._mesh(target.name)
    dev_mesh = jax.sharding.Mesh(mesh.devices.reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    cfg = cfgmod.load(None, [])
    tx, schedule = make_optimizer(cfg)
    policy = policies.resolve(args.policy) if args.policy else None
    print(f"target: {target.description}; policy: {args.policy or 'none'}")
    print(f"{'shape':<22} {'remat':<6} {'estimate':>12} {'XLA':>12} {'ratio':>6}")
    for name, over, seq, micro, dtype in SHAPES:
        if args.shapes and name not in args.shapes.split(","):
            continue
        for remat in ((False, True) if args.remat else (False,)):
            mc = LlamaConfig.tiny(**over, max_seq_len=max(seq, 128), dtype=dtype,
                                  param_dtype="float32", remat=remat)
            lay = make_state_layout(mc, dev_mesh, tx, 0)
            fn = make_train_step(graphdef=lay.graphdef, policy=policy, tx=tx, schedule=schedule,
                                 accum_steps=1)
            batch = jax.ShapeDtypeStruct((micro, seq + 1), jnp.int32, sharding=lay.batch)
            key = jax.random.key(0)
            key_s = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=lay.replicated)
            jitted = jax.jit(fn, in_shardings=(lay.shardings, lay.batch, lay.replicated),
                             out_shardings=(lay.shardings, lay.replicated), donate_argnums=(0,))
            with jax.set_mesh(dev_mesh):
                compiled = jitted.trace(lay.abstract, batch, key_s).lower().compile()
            m = compiled.memory_analysis()
            xla = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                   + m.temp_size_in_bytes)
            est = memory.estimate(dataclasses.replace(mc), seq_len=seq, micro_batch=micro,
                                  accum_steps=1, mesh=(1, 1, 1))
            print(f"{name:<22} {remat!s:<6} {memory.gib(est.total):>12} {memory.gib(xla):>12} "
                  f"{est.total / xla:>6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
