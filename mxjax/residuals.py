"""Quantized residuals: the backward GEMM's operand saved quantized and packed by the forward.

A quantized ``mxjax.dot_general`` (``y = x·w``) runs two GEMMs in its backward pass that
read a primal: dgrad reads W (blocks along N) and wgrad reads X (blocks along M). Both are
the *rhs* of their GEMM (``dgrad(g, w)``, ``wgrad(g, x)``). Without this module the forward
saves X and W as they are (bf16 for a bf16 model) and the backward quantizes them. Here the
forward quantizes each one exactly as its backward GEMM would (:func:`pack_rhs`: the GEMM's
canonical layout `mxjax.operands`, its Hadamard along its contraction with its own signs,
its rounding with its own rhs key: every key of a GEMM is known in the forward, the call's
key being a residual) and saves the packed result instead: the canonical `mxjax.MXArray`
of the rhs (E2M1 codes two per byte and one scale byte per block for MXFP4/NVFP4, plus
NVFP4's f32 tensor scale), about 4.25 bits per element instead of 16. The backward runs
the GEMM on it (`mxjax.gemm.gemm_packed_rhs`, the route's ``Route.packed_rhs_gemm``) in
place of quantizing the primal: the same values, the same GEMM, the same bits (tests
compare gradients bit for bit).

The packed residual does not depend on the route; each route says whether it takes it
(``mxjax.routes.spec.Route.packed_rhs_gemm``). Which backward GEMMs save packed
(:func:`saves_packed`): those whose rhs operand is block-scaled (MX formats, NVFP4) and
whose backend resolves, on every platform (`mxjax.backends.routes_per_platform`: the
program holds one branch per platform and may be lowered for any, ``jax.export`` from a
CPU host for a TPU included), to a route with a ``packed_rhs_gemm`` ('xla', 'xla_fp4',
'xla_nvfp4', 'xla_mxfp8'); where that route is the emulation, also only where its form on
that platform takes it with the same bits (`mxjax.emulation.forms.emulates_packed_rhs`:
every block-scaled recipe but CUDA's FP8-unit forms). On the chip traced for, the
emulation packs where that is the better choice (`emulation_packs_rhs`: on a CPU, and
NVFP4 everywhere; on GPUs and TPUs the MX formats' in-place forms read X and W in place in
the backward, one read each). Of the presets under the emulation that leaves ``nvfp4``
everywhere and the MX presets on a CPU; under 'auto' on a Blackwell target also
``mxfp4_*`` ('xla_fp4') and ``mxfp8`` ('xla_mxfp8'). W is saved packed only when the
call does not cast its operands (``operand_dtype`` unset): with a cast, W's residual is
the primal as stored (a model's f32 master weight, alive anyway), and a packed copy would
add memory instead of replacing a bf16 copy. Kept in bf16 (the backward quantizes them):
the MX presets under the emulation on GPUs and TPUs (``mxfp4_*``, ``tseng``, ``mxfp8``:
in-place or FP8-unit forms), per-tensor FP8 operands (``fp8``: XLA:CPU and CUDA quantize
them in place, no canonical layout), the 'xla_fp8' and 'triton' backends (and 'auto'
where it picks them, e.g. on Hopper) until their routes have a ``packed_rhs_gemm``,
``mxfp4_fprop`` (bf16 backward), calls under a mesh with explicit axes, observed calls
(`mxjax.interceptor.observe`: the observer sees the primals), and calls being
differentiated again (``jax.grad`` of ``jax.grad``: the straight-through
rule differentiates the backward w.r.t. the primals).

The packed residuals are named `mxjax.remat.PACKED_RESIDUAL` (``checkpoint_name``), so a
remat policy can keep them (`mxjax.remat.remat_policy`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mxjax._platform import per_platform
from mxjax.backends import ROUTES, routes_per_platform
from mxjax.chips import target_chip
from mxjax.dimensions import Dims
from mxjax.emulation.forms import emulates_packed_rhs
from mxjax.operands import canonical_operand, rotate_operand, split_key
from mxjax.quantization import MXArray, quantize_with
from mxjax.remat import PACKED_RESIDUAL

__all__ = ["PackedResidual", "pack_rhs", "saves_packed"]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PackedResidual:
    """A backward GEMM's rhs operand, quantized by the forward pass.

    Attributes:
      q: the operand in the GEMM's canonical layout ``[batch..., Fb, K']`` (K' the
        contraction, zero-padded to the Hadamard size if the recipe has one), rotated by
        the recipe's Hadamard, quantized along K' under ``recipe.rhs`` with the GEMM's rhs
        key: what ``Route.packed_rhs_gemm`` takes.
      shape: the operand's shape in its own layout.
      primal_dtype: the primal's dtype (before any cast: its cotangent's).
    """

    q: MXArray
    shape: tuple[int, ...]
    primal_dtype: Any

    def tree_flatten(self):
        return (self.q,), (self.shape, self.primal_dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def primal(self) -> jax.ShapeDtypeStruct:
        """The primal's shape and dtype (`mxjax.gemm.gemm_packed_rhs`'s ``b``)."""
        return jax.ShapeDtypeStruct(self.shape, self.primal_dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held (codes, scales, tensor scale)."""
        return self.q.nbytes


def _takes_packed_rhs(route, recipe, platform: str) -> bool:
    """Whether `route`, the one `platform` resolves to, takes the packed rhs with the same
    bits (the emulation: `emulates_packed_rhs`). None (the backend cannot run there: its
    branch raises when lowered, packed or not) is no obstacle."""
    if route is None:
        return True
    if route.packed_rhs_gemm is None:
        return False
    return route is not ROUTES["xla"] or emulates_packed_rhs(recipe, platform)


def saves_packed(recipe) -> bool:
    """Whether the backward GEMM under `recipe` takes its rhs operand packed (module
    docstring): a block-scaled rhs; on every platform the backend resolves to (one where it
    cannot run aside) a route that takes the packed rhs with the same bits, since the
    program carries one branch per platform (``lax.platform_dependent``) and may be lowered
    for any of them; and on the chip the program is traced for (`mxjax.chips.target_chip`),
    a form for which packing is the better choice (``Route.packs_rhs``): everywhere but the
    emulation's GPU and TPU in-place forms for MX operands (`emulation_packs_rhs`) and
    'xla_fp8' on a GPU (its bit view), which read X and W in place in the backward faster
    than XLA quantizes them in the forward."""
    op = recipe.rhs
    if recipe.is_passthrough or op.is_passthrough or op.fmt.is_per_tensor:
        return False
    try:
        choices = routes_per_platform(recipe.backend, recipe.lhs.fmt, op.fmt)
    except ValueError:
        return False
    if not all(_takes_packed_rhs(route, recipe, platform)
               for platform, (route, _) in choices.items()):
        return False
    platform = target_chip().platform
    route = choices[platform][0]
    # None: the backend cannot run on the target (its branch raises when lowered).
    return route is None or route.packs_rhs is None or route.packs_rhs(recipe, platform)


def pack_rhs(b: jax.Array, dims: Dims, recipe, key, dtype=None) -> PackedResidual:
    """The rhs `b` of the GEMM ``dot_general(a, b, dims)`` under `recipe` as that GEMM
    quantizes it (cast to `dtype` first if given), packed and named for remat policies.

    ``key``: the GEMM's key (None when the recipe needs none); its splits are the GEMM's.
    Lowered for a GPU whose route has its own operand kernels (``Route.pack_rhs``: the
    one-pass kernel of 'xla_fp4', which reads the forward GEMM's operand once for both),
    those make it; elsewhere `mxjax.quantize_with`: the same bits.
    """
    q = _residual(b, key if recipe.needs_key else None, _PackSpec(dims, recipe, dtype))
    q = jax.tree.map(lambda x: checkpoint_name(x, PACKED_RESIDUAL), q)
    return PackedResidual(q, tuple(b.shape), jnp.dtype(b.dtype))


class _PackSpec(NamedTuple):
    dims: Dims
    recipe: Any
    dtype: Any


def _canonical_pack(b: jax.Array, key, spec: _PackSpec) -> MXArray:
    (_, cb), (_, bb) = spec.dims
    _, k_rhs, k_had = split_key(key)
    if spec.dtype is not None:
        b = b.astype(spec.dtype)
    b3 = rotate_operand(canonical_operand(b, bb, cb), spec.recipe, k_had)
    return quantize_with(b3, spec.recipe.rhs, -1, key=k_rhs)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _residual(b: jax.Array, key, spec: _PackSpec) -> MXArray:
    """`_canonical_pack`, or on a GPU the route's own kernel (`pack_rhs`); never
    differentiated (below)."""
    recipe = spec.recipe
    route, _ = routes_per_platform(recipe.backend, recipe.lhs.fmt, recipe.rhs.fmt)["gpu"]
    if route is None or route.pack_rhs is None:
        return _canonical_pack(b, key, spec)

    def gpu(b, key):
        q = route.pack_rhs(b, dims=spec.dims, recipe=recipe, key=key,
                           operand_dtype=spec.dtype)
        return _canonical_pack(b, key, spec) if q is None else q

    return per_platform(b, key, cpu=functools.partial(_canonical_pack, spec=spec),
                        tpu=functools.partial(_canonical_pack, spec=spec), gpu=gpu)


@_residual.defjvp
def _residual_jvp(spec, primals, tangents):
    del spec, primals, tangents
    raise TypeError(
        "mxjax.dot_general: a gradient computed from packed quantized residuals "
        "(mxjax.residuals) is being differentiated again, across a jax.jit boundary that hid "
        "the outer differentiation from the inner one (e.g. jax.grad(jax.jit(jax.grad(f)))). "
        "Put the outer differentiation inside the same jit (jax.jit(jax.grad(jax.grad(f)))) "
        "or differentiate without the inner jit: there the forward keeps its primals and "
        "second derivatives follow the straight-through rule (docs/NUMERICS.md).")
