"""The train state's layout on the mesh: abstract shapes, shardings, fresh init.

State = ``{'params': fp32 pure param dict, 'opt': optax state, 'step',
'skipped', 'consecutive': int32 scalars}``. Parameters follow the model's
partition rules (`models.sharding`), optimizer moments follow their parameters,
everything else is replicated; batches are split over data x fsdp.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import sharding as shd
from models.llama import Llama, LlamaConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateLayout:
    """How a run's state lies on `mesh`.

    graphdef: the model's graph (params are merged in at every step);
    abstract: the state as ShapeDtypeStructs carrying their shardings (what a
    checkpoint restores into); shardings/param_shardings: NamedSharding pytrees;
    replicated/batch: shardings for scalars and for int32[B, T+1] batches;
    init: jitted ``init(seed_key) -> state``, sharded, one compile for all seeds.
    """

    mesh: Mesh
    graphdef: nnx.GraphDef
    abstract: dict[str, Any]
    shardings: dict[str, Any]
    param_shardings: Any
    replicated: NamedSharding
    batch: NamedSharding
    n_params: int
    init: Callable[[jax.Array], dict[str, Any]]


def make_state_layout(model_config: LlamaConfig, mesh: Mesh,
                      tx: optax.GradientTransformation, seed: int) -> StateLayout:
    """Abstract state and shardings for `model_config` trained with `tx` (nothing compiled)."""
    rep = NamedSharding(mesh, PartitionSpec())
    batch_sh = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    abstract = nnx.eval_shape(lambda: Llama(model_config, rngs=nnx.Rngs(seed)))
    graphdef, abs_params, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise RuntimeError("the model has non-parameter state, which the train state does not "
                           "carry; it would be lost between steps")
    specs = shd.param_partition_specs(abstract, mesh)
    abs_pure = nnx.to_pure_dict(abs_params)
    param_sh = jax.tree_util.tree_map_with_path(
        lambda p, _: NamedSharding(mesh, specs[tuple(k.key for k in p)]), abs_pure)
    n_params = int(sum(math.prod(x.shape) for x in jax.tree.leaves(abs_pure)))
    abs_opt = jax.eval_shape(tx.init, abs_pure)
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, abs_opt, param_sh,
                                   transform_non_params=lambda _: rep)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    state_sh = {"params": param_sh, "opt": opt_sh, "step": rep, "skipped": rep,
                "consecutive": rep}
    abs_state = {"params": abs_pure, "opt": abs_opt, "step": scalar, "skipped": scalar,
                 "consecutive": scalar}
    abs_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             abs_state, state_sh)

    def fresh_state(seed_key):  # the seed is an argument: one compile for all seeds
        model = Llama(model_config, rngs=nnx.Rngs(seed_key))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        zero = jnp.zeros((), jnp.int32)
        return {"params": params, "opt": tx.init(params), "step": zero, "skipped": zero,
                "consecutive": zero}

    return StateLayout(mesh=mesh, graphdef=graphdef, abstract=abs_state, shardings=state_sh,
                       param_shardings=param_sh, replicated=rep, batch=batch_sh,
                       n_params=n_params,
                       init=jax.jit(fresh_state, out_shardings=state_sh))


def put_batch(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The global batch from this process's rows int32[b_local, T+1] (b_local * processes)."""
    gshape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
    return jax.make_array_from_process_local_data(sharding, local, gshape)
