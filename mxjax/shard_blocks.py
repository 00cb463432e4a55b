"""Whether a mesh keeps every quantization block on one device.

A block format quantizes along a GEMM's contraction in blocks (32 elements for MXFP4 and
MXFP8, 16 for NVFP4), and a Hadamard rotation mixes ``h`` consecutive elements of it. When
a device's shard of an operand holds whole blocks along that axis, each device quantizes
its own shard and the GEMMs move packed codes and scales (`mxjax.routes.xla_fp4_kernel.
run_codec_sharded`); when a shard boundary cuts a block, no device holds the block, and
the operand would have to be gathered in bf16 first. A mesh like that is refused here,
before anything compiles, rather than left to a slower program.

The contraction of each operand, for ``y = x @ w`` (`mxjax.policies.PrecisionPolicy`):

* ``w [d_in, d_out]``: fprop blocks it along ``d_in``, dgrad along ``d_out``;
* ``x [tokens, d_in]`` and ``dy [tokens, d_out]``: wgrad blocks both along the tokens.

The step an axis needs (`contraction_step`) is the least common multiple of the format's
block, the Hadamard size and 32, the group the per-shard operand kernels write codes and
scales in (NVFP4's 16-blocks included).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from mxjax.formats import get as get_format
from mxjax.recipes import GemmRecipe

__all__ = ["KERNEL_GROUP", "check_linear_shards", "contraction_step", "linear_shard_problems"]

# The per-shard operand kernels write codes and scales in groups of 32 contraction elements.
KERNEL_GROUP = 32


def contraction_step(recipe: GemmRecipe, side: str) -> int:
    """The number of consecutive contraction elements a device must hold whole for operand
    ``side`` ('lhs' or 'rhs') of a GEMM under ``recipe``: 1 when nothing crosses elements
    (pass-through or per-tensor, no rotation), else the lcm of the block size, the
    Hadamard size and `KERNEL_GROUP`."""
    if side not in ("lhs", "rhs"):
        raise ValueError(f"side: expected 'lhs' or 'rhs', got {side!r}")
    fmt = get_format(getattr(recipe, side).fmt)
    sizes = []
    if fmt.is_block:
        sizes += [fmt.block_size, KERNEL_GROUP]
    if recipe.hadamard is not None:
        sizes.append(recipe.hadamard.block_size)
    return math.lcm(*sizes) if sizes else 1


def _extent(shape_n: int, mesh_shape: Mapping[str, int], entry) -> tuple[int, tuple[str, ...]]:
    names = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    n = math.prod(mesh_shape[a] for a in names)
    return (shape_n // n if n else shape_n), names


def linear_shard_problems(policy, kernels: Mapping[str, tuple[Sequence[int], Sequence]],
                          mesh_shape: Mapping[str, int], *,
                          tokens_per_shard: int | None = None) -> list[str]:
    """What in a sharded model would split a quantization block, one sentence each.

    Args:
      policy: a `mxjax.PrecisionPolicy` (None: nothing is quantized, no problems).
      kernels: ``{name: (shape, spec)}`` for the weight of every ``y = x @ w`` the policy
        reaches: its last two axes ``[d_in, d_out]`` (leading axes, e.g. stacked layers,
        are not contracted) and its PartitionSpec entries (mesh axis names or None).
      mesh_shape: ``{mesh axis: size}`` (``Mesh.shape``).
      tokens_per_shard: the tokens one device's activations hold (wgrad's contraction),
        or None to leave the tokens unchecked.
    Returns:
      one sentence per axis whose shards would cut a block: the weight, its axis, the
      mesh axes, the shard's extent and the step it needs; empty when the mesh fits.
    """
    if policy is None:
        return []
    steps = (contraction_step(policy.fprop, "rhs"), contraction_step(policy.dgrad, "rhs"))
    out = []
    for name, (shape, spec) in kernels.items():
        if len(shape) < 2:
            raise ValueError(f"kernels[{name!r}]: expected a weight [..., d_in, d_out], got "
                             f"shape {tuple(shape)}")
        spec = tuple(spec) + (None,) * (len(shape) - len(spec))
        for axis, gemm, step in ((len(shape) - 2, "fprop", steps[0]),
                                 (len(shape) - 1, "dgrad", steps[1])):
            local, names = _extent(shape[axis], mesh_shape, spec[axis])
            if names and local % step:
                out.append(f"{name}: axis {axis} ({shape[axis]} over mesh axes {names}: "
                           f"{local} per device) is {gemm}'s contraction, quantized in "
                           f"blocks of {step}; {local} is not a multiple of {step}")
    if tokens_per_shard is not None:
        step = max(contraction_step(policy.wgrad, "lhs"), contraction_step(policy.wgrad, "rhs"))
        if tokens_per_shard % step:
            out.append(f"tokens: {tokens_per_shard} per device are wgrad's contraction, "
                       f"quantized in blocks of {step}; {tokens_per_shard} is not a multiple "
                       f"of {step}")
    return out


def check_linear_shards(policy, kernels: Mapping[str, tuple[Sequence[int], Sequence]],
                        mesh_shape: Mapping[str, int], *,
                        tokens_per_shard: int | None = None) -> None:
    """Raise ValueError listing every `linear_shard_problems` entry (a mesh whose shards
    would cut a quantization block); return None when the mesh keeps every block whole."""
    problems = linear_shard_problems(policy, kernels, mesh_shape,
                                     tokens_per_shard=tokens_per_shard)
    if problems:
        name = getattr(policy, "name", None) or "the policy"
        raise ValueError(
            f"mesh {dict(mesh_shape)}: under {name}, shards would cut quantization blocks "
            "(each device must hold whole blocks along every contraction it quantizes):\n  "
            + "\n  ".join(problems)
            + "\nchoose mesh axis sizes that leave whole blocks per device (or more tokens "
              "per device)")
