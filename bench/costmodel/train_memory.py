"""The train step's memory as XLA assigns it, beside `train.memory`'s estimate.

`compare` compiles the trainer's own train step (``train.step.make_train_step``, state
donated, shardings of ``train.state.make_state_layout``) for a mesh of one or more
devices, on this CPU or deviceless for a GPU of `aot.TARGETS` (``topology 1x1xN``: N GPUs
of one host), and reads ``compiled.memory_analysis()`` per device: arguments + outputs -
aliased + temporaries. bench/memory_estimate.py prints the rows; tests/train/test_memory.py
(CPU) and tests/accelerators/test_memory_estimate.py (H100) hold the ratio in bounds.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.costmodel import aot

__all__ = ["MemoryRow", "compare", "compile_train_step", "mesh_for"]

AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryRow:
    """One compile: the estimate and XLA's figure, bytes per device."""

    estimate: int
    xla: int
    argument: int
    output: int
    alias: int
    temp: int

    @property
    def ratio(self) -> float:
        """estimate / XLA."""
        return self.estimate / self.xla


@functools.cache
def mesh_for(target_name: str, shape: tuple[int, int, int]) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh of `shape` on `target_name`'s devices: this host's CPU
    devices (as many as ``--xla_force_host_platform_device_count`` gives), or a deviceless
    GPU topology of one host with that many GPUs."""
    from jax.experimental import topologies

    n = shape[0] * shape[1] * shape[2]
    target = aot.TARGETS[target_name]
    if target.kind == "cpu":
        devs = jax.devices("cpu")
        if len(devs) < n:
            raise RuntimeError(f"{n} CPU devices needed, {len(devs)} here: set XLA_FLAGS="
                               f"--xla_force_host_platform_device_count={n}")
        return jax.sharding.Mesh(np.asarray(devs[:n]).reshape(shape), AXES)
    if target.kind != "gpu":
        raise ValueError(f"target {target_name!r}: only cpu and GPU targets here")
    why = aot.unavailable_reason(target)
    if why:
        raise RuntimeError(f"target {target_name!r}: {why}")
    topo = topologies.get_topology_desc(target_name, "cuda",
                                        target_config=target.spec_path.read_text(),
                                        topology=f"1x1x{n}")
    return topologies.make_mesh(topo, shape, AXES)


def compile_train_step(mc, *, seq_len: int, micro_batch: int,
                       mesh_shape: tuple[int, int, int], target_name: str = "cpu",
                       policy=None):
    """`mc`'s train step (one micro-batch of `micro_batch` sequences of `seq_len` tokens,
    no accumulation) compiled on `mesh_shape` devices of `target_name`, with the state
    layout's shardings and the activation constraints a run has."""
    from models import sharding as shd
    from train import config as cfgmod
    from train.optimizer import make_optimizer
    from train.state import make_state_layout
    from train.step import make_train_step

    mesh = mesh_for(target_name, mesh_shape)
    tx, schedule = make_optimizer(cfgmod.load(None, []))
    lay = make_state_layout(mc, mesh, tx, 0)
    fn = make_train_step(graphdef=lay.graphdef, policy=policy, tx=tx, schedule=schedule,
                         accum_steps=1)
    batch = jax.ShapeDtypeStruct((micro_batch, seq_len + 1), jnp.int32, sharding=lay.batch)
    key = jax.random.key(0)
    key_s = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=lay.replicated)
    jitted = jax.jit(fn, in_shardings=(lay.shardings, lay.batch, lay.replicated),
                     out_shardings=(lay.shardings, lay.replicated), donate_argnums=(0,))
    with jax.set_mesh(mesh), shd.use_mesh(mesh):  # the activation constraints, as a run has
        return jitted.trace(lay.abstract, batch, key_s).lower().compile()


def compare(mc, *, seq_len: int, micro_batch: int, mesh_shape: tuple[int, int, int],
            target_name: str = "cpu", policy=None) -> MemoryRow:
    """Compile `mc`'s train step (one micro-batch of `micro_batch` sequences of `seq_len`
    tokens, no accumulation) on `mesh_shape` devices of `target_name`; its `MemoryRow`."""
    from train import memory

    compiled = compile_train_step(mc, seq_len=seq_len, micro_batch=micro_batch,
                                  mesh_shape=mesh_shape, target_name=target_name,
                                  policy=policy)
    m = compiled.memory_analysis()
    xla = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
           + m.temp_size_in_bytes)
    platform = "cpu" if aot.TARGETS[target_name].kind == "cpu" else "gpu"
    est = memory.estimate(mc, seq_len=seq_len, micro_batch=micro_batch, accum_steps=1,
                          mesh=mesh_shape, platform=platform)
    return MemoryRow(estimate=est.total, xla=xla, argument=m.argument_size_in_bytes,
                     output=m.output_size_in_bytes, alias=m.alias_size_in_bytes,
                     temp=m.temp_size_in_bytes)
