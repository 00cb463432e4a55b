"""The two programs bench/accelerator_cost.py compiles (and bench/device/gpu.py times on a device).

* ``matmul``: value_and_grad of ``mean((x @ w)^2)`` for bf16 ``x, w [n, n]`` through
  ``mxjax.dot_general`` under a policy (fprop, dgrad and wgrad GEMMs);
* ``layer``: the Llama-3.2-1B decoder layer's train step of `bench.costmodel.export_shape`
  (loss and gradients w.r.t. the layer's parameters and input);
* ``layer_8b``: the same for one Llama 3.1-8B decoder layer, at the paper's sequence
  (8192 unless ``seq`` is given), micro-batch 1;
* ``wrapped_mlp`` (not in the default set): a Flax Linen MLP we did not build with a policy
  (``Dense(dtype=bf16, param_dtype=f32)``, 2048 -> 8192 -> 2048, gelu, ``batch * seq``
  tokens) under ``mxjax.nn.wrap``: loss and gradients w.r.t. its parameters.

Each builder returns ``(fn, abstract args)``: ShapeDtypeStructs (a PRNG key where
the policy needs one, else None). No backend is touched here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["EXTRA_PROGRAMS", "LAYER_8B_SEQ", "LAYER_PROGRAMS", "PROGRAMS", "concrete_args",
           "layer_program", "matmul_program", "program", "wrapped_mlp_program"]

PROGRAMS = ("matmul", "layer")
LAYER_PROGRAMS = {"layer": "llama3_1b", "layer_8b": "llama3_8b"}  # program -> LlamaConfig preset
LAYER_8B_SEQ = 8192  # MLPerf Llama 3.1-8B's sequence length
EXTRA_PROGRAMS = ("layer_8b", "wrapped_mlp")


def _resolve(policy):
    """A preset name's PrecisionPolicy; a policy or a peer (policy-like) as given."""
    from mxjax import policies

    return policies.get(policy) if isinstance(policy, str) else policy


def matmul_program(policy_name, n: int = 4096):
    """(fn, abstract args): value_and_grad of mean((x @ w)^2) for bf16 x, w [n, n] (and a key).

    ``policy_name``: a preset name, or an object with ``needs_key`` and
    ``dot_general(key)`` (a PrecisionPolicy, a peer of bench/costmodel/peers.py)."""
    policy = _resolve(policy_name)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype) if policy.needs_key else None

    def step(x, w, k):
        def loss(x, w):
            y = policy.dot_general(key=k)(x, w, (((1,), (0,)), ((), ())))
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    a = jax.ShapeDtypeStruct((n, n), jnp.bfloat16)
    return step, (a, a, key)


def layer_program(policy_name: str, batch: int = 1, seq: int = 2048, *, size: str = "llama3_1b",
                  attention_impl: str | None = None):
    """(fn, abstract args): `bench.costmodel.export_shape`'s decoder-layer train step.

    ``policy_name``: a preset name, or a PrecisionPolicy (bench/device/gpu.py's layer rows with
    every GEMM's backend set); ``size``: the LlamaConfig preset ('llama3_1b',
    'llama3_8b'; 'tiny' for CPU smoke runs); ``attention_impl``: the config's attention
    implementation (None: the config's default).
    """
    from bench.costmodel import export_shape
    from models.llama import LlamaConfig

    extra = {} if attention_impl is None else {"attention_impl": attention_impl}
    config = getattr(LlamaConfig, size)(n_layers=1, dtype="bfloat16", param_dtype="float32",
                                        **extra)
    return export_shape.layer_train_step(config, policy_name, batch, seq)


def wrapped_mlp_program(policy_name: str, batch: int = 1, seq: int = 2048,
                        dim: int = 2048, hidden: int = 8192):
    """(fn, abstract args): value_and_grad of a wrapped bf16-compute, f32-parameter MLP."""
    import flax.linen as nn

    import mxjax.nn as mnn
    from mxjax import policies

    policy = policies.get(policy_name)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype) if policy.needs_key else None

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32, "use_bias": False}
            h = nn.Dense(hidden, name="up", **dense)(x)
            return nn.Dense(dim, name="down", **dense)(nn.gelu(h))

    model = Mlp()
    wrapped = mnn.wrap(model, [mnn.Rule(path=".*", policy=policy)])
    params = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                               jnp.zeros((1, dim), jnp.bfloat16)))

    def step(params, x, k):
        rngs = None if k is None else {"mxjax": k}

        def loss(params):
            y = wrapped.apply(params, x, rngs=rngs)
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        return jax.value_and_grad(loss)(params)

    x = jax.ShapeDtypeStruct((batch * seq, dim), jnp.bfloat16)
    return step, (params, x, key)


def program(name: str, policy: str, *, matmul_size: int = 4096, batch: int = 1,
            seq: int = 2048, seq_8b: int = LAYER_8B_SEQ,
            attention_impl: str | None = None) -> tuple:
    """(fn, abstract args) of program `name` (one of PROGRAMS or EXTRA_PROGRAMS) under
    `policy` (a preset name, or a peer of bench/costmodel/peers.py: 'peer:<name>').

    ``seq`` is the 1B layer's and the MLP's sequence, ``seq_8b`` the 8B layer's;
    ``attention_impl`` (None: the LlamaConfig default) applies to both layers.
    """
    if policy.startswith("peer:"):
        from bench.costmodel import peers

        if name == "wrapped_mlp":
            raise ValueError(f"program: {name!r} has no peer form; expected 'matmul' or one "
                             f"of {tuple(LAYER_PROGRAMS)}")
        policy = peers.get(policy.removeprefix("peer:"))
    if name == "matmul":
        return matmul_program(policy, matmul_size)
    if name in LAYER_PROGRAMS:
        return layer_program(policy, batch, seq_8b if name == "layer_8b" else seq,
                             size=LAYER_PROGRAMS[name], attention_impl=attention_impl)
    if name == "wrapped_mlp":
        return wrapped_mlp_program(policy, batch, seq)
    raise ValueError(f"program: unknown {name!r}; expected one of "
                     f"{PROGRAMS + EXTRA_PROGRAMS}")


def concrete_args(args, seed: int = 0):
    """Random arrays (normal, scaled 0.02) for the abstract args; keys from `seed`."""
    leaves, treedef = jax.tree.flatten(args)
    keys = jax.random.split(jax.random.key(seed), max(1, len(leaves)))
    out = []
    for k, a in zip(keys, leaves):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            out.append(jax.random.key(seed))
        else:
            out.append((0.02 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype))
    return jax.tree.unflatten(treedef, out)
