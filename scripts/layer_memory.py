"""Peak temporary memory of the Llama 3.1-8B decoder layer's train step, per policy and remat
policy, compiled without a device for a GPU target (docs/TRAINING.md, "Remat policies").

The train step is ``bench/costmodel/export_shape.layer_train_step``'s (loss and gradients
w.r.t. the layer's parameters and input, bf16 compute, fp32 parameters, micro-batch 1,
fused attention), with the layer under ``jax.checkpoint`` when ``--remat`` names a policy
(`mxjax.remat.remat_policy`: 'none' no checkpoint, 'full' nothing saved, 'quantized_residuals'
the packed residuals saved). Prints ``memory_analysis().temp_size_in_bytes`` per row and
each row's ratio to bf16's (policy ``bf16``: plain ``lax.dot_general``) under the same remat.
Needs the ``aot-gpu`` extra:

    .venv-aot/bin/python scripts/layer_memory.py [--target b200] [--seq 8192]
        [--policies bf16,mxfp4_all_h16@auto] [--remat none,full,quantized_residuals]

``--residuals`` prints instead, without compiling (seconds, any venv), the bytes the
forward pass saves for the backward (``jax.ad_checkpoint.saved_residuals`` of the layer,
parameters and input excluded), with packing on and, for comparison, off (the bf16
residuals every quantized GEMM saved before `mxjax.residuals`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.costmodel import aot

aot.use_cpu_host()


def layer_step(config, policy, seq: int, remat: str):
    """(fn, abstract args) of the layer's train step, the layer under `remat`'s checkpoint."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.llama import DecoderLayer, rope_cos_sin, rope_inv_freq
    from mxjax.remat import remat_policy

    layer = nnx.eval_shape(lambda: DecoderLayer(config, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(layer)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype) if (
        policy is not None and policy.needs_key) else None

    def apply(p, x, k):
        inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        cos, sin = rope_cos_sin(jnp.arange(seq, dtype=jnp.int32), inv)
        return nnx.merge(graphdef, p)(x, 0, cos, sin, policy=policy, policy_key=k)

    if remat != "none":
        apply = jax.checkpoint(apply, policy=remat_policy(remat))

    def step(p, x, k):
        def loss(p, x):
            return jnp.mean(jnp.square(apply(p, x, k).astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1))(p, x)

    x = jax.ShapeDtypeStruct((1, seq, config.dim), config.dtype)
    return step, (params, x, key)


def temp_bytes(target: str, policy_name: str, seq: int, remat: str) -> int:
    """memory_analysis().temp_size_in_bytes of one compile."""
    from models.llama import LlamaConfig
    from mxjax import policies

    config = LlamaConfig.llama3_8b(n_layers=1, dtype="bfloat16", param_dtype="float32",
                                   attention_impl="fused")
    policy = None if policy_name == "bf16" else policies.get(policy_name)
    fn, args = layer_step(config, policy, seq, remat)
    compiled = aot.compile_for(fn, args, target)
    return int(compiled.memory_analysis().temp_size_in_bytes)


def residual_bytes(policy_name: str, seq: int, packed: bool = True) -> int:
    """Bytes of the layer's saved residuals (traced, not compiled), arguments excluded."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals's list

    from models.llama import DecoderLayer, LlamaConfig, rope_cos_sin, rope_inv_freq
    from mxjax import interceptor, policies

    config = LlamaConfig.llama3_8b(n_layers=1, dtype="bfloat16", param_dtype="float32",
                                   attention_impl="fused")
    policy = None if policy_name == "bf16" else policies.get(policy_name)
    layer = nnx.eval_shape(lambda: DecoderLayer(config, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(layer)
    key = jax.random.key(0) if policy is not None and policy.needs_key else None

    def loss(p, x):
        inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        cos, sin = rope_cos_sin(jnp.arange(seq, dtype=jnp.int32), inv)
        y = nnx.merge(graphdef, p)(x, 0, cos, sin, policy=policy, policy_key=key)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    x = jax.ShapeDtypeStruct((1, seq, config.dim), config.dtype)
    saves = interceptor.saves_packed
    if not packed:
        interceptor.saves_packed = lambda recipe: False
    try:
        res = saved_residuals(loss, params, x)
    finally:
        interceptor.saves_packed = saves
    return sum(int(a.size) * a.dtype.itemsize for a, src in res
               if not src.startswith("from the argument"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="b200")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--policies", default="bf16,mxfp4_all_h16@auto")
    ap.add_argument("--remat", default="none,full,quantized_residuals")
    ap.add_argument("--residuals", action="store_true",
                    help="print the saved residuals' bytes (traced, no compile)")
    args = ap.parse_args(argv)
    if args.residuals:
        base = residual_bytes("bf16", args.seq)
        for name in args.policies.split(","):
            for packed in (False, True) if name != "bf16" else (True,):
                n = residual_bytes(name, args.seq, packed)
                what = "" if name == "bf16" else (" packed" if packed else " bf16 residuals")
                print(f"seq {args.seq} {name}{what}: residuals {n / 1e9:.3f} GB, "
                      f"{n / base:.3f}x bf16", flush=True)
        return
    for remat in args.remat.split(","):
        base = None
        for name in args.policies.split(","):
            temp = temp_bytes(args.target, name, args.seq, remat)
            base = temp if name == "bf16" else base
            ratio = f", {temp / base:.3f}x bf16" if base else ""
            print(f"{args.target} seq {args.seq} remat {remat} {name}: temp "
                  f"{temp / 1e9:.3f} GB{ratio}", flush=True)


if __name__ == "__main__":
    main()
