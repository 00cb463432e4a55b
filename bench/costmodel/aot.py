"""Deviceless (ahead-of-time) compiles for GPUs and TPUs on a CPU machine.

``compile_for(fn, args, target)`` returns the ``jax.stages.Compiled`` of
``jax.jit(fn)`` for a target that need not be present: TPUs through libtpu's
topology descriptions (``pip install 'mxjax[aot-tpu]'``), NVIDIA GPUs through
the CUDA PJRT plugin with one of XLA's GPU target specs (``GpuTargetConfigProto``
text, copied into ``bench/costmodel/gpu_targets/`` from openxla/xla; ``pip install
'mxjax[aot-gpu]'``), and this machine's CPU. Every argument is placed on a
one-device mesh of the target. The compiled program gives the optimized HLO
(``as_text()``), ``memory_analysis()`` and, on TPU, ``cost_analysis()``.

``jax_platforms`` must be 'cpu' before any backend starts (:func:`use_cpu_host`):
the CUDA plugin would otherwise look for a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import jax

__all__ = ["TARGETS", "Target", "compile_for", "unavailable_reason", "use_cpu_host"]

SPECS = Path(__file__).resolve().parent / "gpu_targets"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """A compile target and the peak rates its roofline assumes.

    ``kind``: 'gpu', 'tpu' or 'cpu'. ``topology``: the TPU topology name or the GPU
    spec file (in ``bench/costmodel/gpu_targets``). ``hbm_bytes_per_s`` / ``bf16_flops_per_s``:
    peak memory bandwidth and dense bf16 matrix rate (GPU: read from the spec; TPU:
    the published figures). ``alu_ops_per_s``: f32 vector ALU issue rate (one
    elementwise op per lane per clock).
    """

    name: str
    kind: str
    topology: str
    description: str
    hbm_bytes_per_s: float = 0.0
    bf16_flops_per_s: float = 0.0
    alu_ops_per_s: float = 0.0

    @property
    def spec_path(self) -> Path:
        return SPECS / self.topology


def _gpu_rates(spec_file: str) -> tuple[float, float, float]:
    """(HBM bytes/s, bf16 FLOP/s, f32 ALU ops/s) from a GpuTargetConfigProto text."""
    text = (SPECS / spec_file).read_text()

    def field(name: str, within: str) -> float:
        for line in within.splitlines():
            if line.strip().startswith(name + ":"):
                return float(line.split(":", 1)[1])
        raise ValueError(f"{spec_file}: no {name!r}")

    info = text.split("matrix_unit_description", 1)
    cores = field("core_count", info[0])
    bw = field("memory_bandwidth", info[0])
    clock = field("clock_rate_ghz", info[0]) * 1e9
    fpus = field("fpus_per_core", info[0])
    # matrix_unit_description rate_infos keyed by xla::PrimitiveType; BF16 is 16.
    bf16 = None
    for block in info[1].split("rate_infos")[1:]:
        if field("key", block) == 16:
            bf16 = (field("clock_rate_ghz", block) * 1e9 * field("units_per_core", block)
                    * field("ops_per_clock", block) * cores * 2)  # ops are FMAs
            break
    if bf16 is None:
        raise ValueError(f"{spec_file}: no bf16 matrix rate")
    return bw, bf16, cores * fpus * clock


def _gpu(name: str, spec: str, description: str) -> Target:
    bw, bf16, alu = _gpu_rates(spec)
    return Target(name=name, kind="gpu", topology=spec, description=description,
                  hbm_bytes_per_s=bw, bf16_flops_per_s=bf16, alu_ops_per_s=alu)


def _tpu(name: str, description: str) -> Target:
    """A TPU target at its published peaks (Google Cloud's per-chip figures, from
    ``mxjax/measurements.json``)."""
    from mxjax import measurements

    rates = measurements.chip_rates(name)
    return Target(name=name, kind="tpu", topology=f"{name}:1x1", description=description,
                  hbm_bytes_per_s=rates.hbm_bytes_per_s,
                  bf16_flops_per_s=dict(rates.matrix_flops)["bf16"])


@functools.cache
def _targets() -> dict[str, Target]:
    return {
        "h100": _gpu("h100", "h100_sxm.txtpb", "NVIDIA H100 SXM 80GB (sm_90a)"),
        "h200": _gpu("h200", "h200.txtpb", "NVIDIA H200 141GB (sm_90a)"),
        "b200": _gpu("b200", "b200.txtpb", "NVIDIA B200 (sm_100a, native FP4)"),
        "v5e": _tpu("v5e", "TPU v5e"),
        "v6e": _tpu("v6e", "TPU v6e"),
        "cpu": Target(name="cpu", kind="cpu", topology="", description="this machine's CPU"),
    }


class _Targets(dict):
    def __missing__(self, key):
        raise KeyError(f"target: unknown {key!r}; expected one of {sorted(_targets())}")


TARGETS = _Targets(_targets())


def use_cpu_host() -> None:
    """Makes the CPU the only local platform (call before anything touches a backend)."""
    jax.config.update("jax_platforms", "cpu")
    # libtpu looks for TPU VM metadata unless told where it is; these keep it quiet.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # Deviceless compiles touch no chip: several processes may load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def unavailable_reason(target: Target) -> str | None:
    """None if `target` can be compiled for here, else why not (the package to install)."""
    import importlib.util

    if target.kind == "tpu" and importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed (pip install 'mxjax[aot-tpu]')"
    if target.kind == "gpu" and importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return "the CUDA PJRT plugin is not installed (pip install 'mxjax[aot-gpu]')"
    return None


@functools.cache
def _mesh(name: str):
    from jax.experimental import topologies

    target = TARGETS[name]
    if target.kind == "cpu":
        return jax.sharding.Mesh(jax.devices("cpu")[:1], ("x",))
    why = unavailable_reason(target)
    if why:
        raise RuntimeError(f"target {name!r}: {why}")
    if target.kind == "tpu":
        topo = topologies.get_topology_desc(target.topology, "tpu")
    else:
        topo = topologies.get_topology_desc(
            name, "cuda", target_config=target.spec_path.read_text(), topology="1x1x1")
    return topologies.make_mesh(topo, (1,), ("x",))


def place(args, target: Target):
    """Every array leaf of `args` as a ShapeDtypeStruct replicated on the target's mesh."""
    sharding = jax.sharding.NamedSharding(_mesh(target.name), jax.sharding.PartitionSpec())

    def leaf(a):
        if a is None:
            return None
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return jax.tree.map(leaf, args)


def compile_for(fn, args, target: Target | str, compiler_options: dict | None = None):
    """``jax.jit(fn)`` traced with abstract `args` and compiled for `target` (no device needed)."""
    target = TARGETS[target] if isinstance(target, str) else target
    placed = place(args, target)
    if target.kind != "cpu":
        # The chip compiled for is the context mesh's abstract device: Pallas' GPU lowering
        # reads its device kind (compute capability), and mxjax.backends.capabilities()
        # chooses the GEMM backends for it.
        with jax.set_mesh(_mesh(target.name)):
            lowered = jax.jit(fn).trace(*placed).lower()
    else:
        lowered = jax.jit(fn).trace(*placed).lower()
    return lowered.compile(compiler_options or None)
