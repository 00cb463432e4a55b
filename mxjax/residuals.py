"""Quantized residuals: the backward GEMM's operand saved quantized and packed by the forward.

A quantized ``mxjax.dot_general`` (``y = x·w``) runs two GEMMs in its backward pass that
read a primal: dgrad reads W (blocks along N) and wgrad reads X (blocks along M). Both are
the *rhs* of their GEMM (``dgrad(g, w)``, ``wgrad(g, x)``). Without this module the forward
saves X and W as they are (bf16 for a bf16 model) and the backward quantizes them. Here the
forward quantizes each one exactly as its backward GEMM would (the GEMM's canonical layout
`mxjax.operands`, its Hadamard along its contraction with its own signs, its rounding with
its own key: every key of a GEMM is known in the forward, the call's key being a residual)
and saves the packed result instead: an `mxjax.MXArray` (E2M1 codes two per byte and one
scale byte per block for MXFP4/NVFP4, plus NVFP4's f32 tensor scale), about 4.25 bits per
element instead of 16. The backward dequantizes it in place of quantizing the primal: the
same values, the same GEMM, the same bits (tests compare gradients bit for bit).

Which backward GEMMs save packed (:func:`saves_packed`): those whose rhs operand is
block-scaled (MX formats, NVFP4) and whose backend is the emulation ('xla') on every
platform, in a program compiled for a CPU, or for a GPU/TPU where the emulation's form
there is the canonical one (NVFP4; the MX formats' in-place forms there, the TPU's Pallas
quantizer among them, read each operand in both directions themselves and keep their bf16
residuals until they emit the packed operands). W is saved packed only when the call does
not cast its operands (``operand_dtype`` unset): with a cast, W's residual is the primal as
stored (a model's f32 master weight, alive anyway), and a packed copy would add memory
instead of replacing a bf16 copy. By preset, on CPU: ``mxfp4_fprop_dgrad`` saves W for
dgrad; ``mxfp4_all``, ``mxfp4_all_sr``, ``mxfp4_all_rht16``, ``mxfp4_all_h16``,
``mxfp4_all_h32``, ``mxfp4_all_h16_wgrad``, ``nvfp4`` and ``tseng`` save W (dgrad) and X
(wgrad), SR and randomized Hadamards included (the keys are the same in both passes); on
GPUs and TPUs ``nvfp4`` does. Kept in bf16 (the backward quantizes them): per-tensor FP8
operands (``fp8``: XLA:CPU and CUDA quantize them in place, no canonical layout), GEMMs on
FP8 units on CUDA (``mxfp8``), the 'xla_fp8', 'xla_fp4' and 'triton' backends (and 'auto'
where it picks them: their own operand passes), ``mxfp4_fprop`` (bf16 backward), calls
under a mesh with explicit axes, observed calls (`mxjax.interceptor.observe`: the observer
sees the primals), and calls being differentiated again (``jax.grad`` of ``jax.grad``: the
straight-through rule differentiates the backward w.r.t. the primals).

The packed residuals are named `mxjax.remat.PACKED_RESIDUAL` (``checkpoint_name``), so a
remat policy can keep them (`mxjax.remat.remat_policy`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from mxjax._platform import cpu_barrier, per_platform
from mxjax.backends import routes_per_platform
from mxjax.chips import target_chip
from mxjax.dimensions import Dims, free_axes
from mxjax.emulation.forms import (
    accelerator_operand_dtype,
    in_place_mx,
    prepare_operand_parts,
    takes_f8_on_cuda,
)
from mxjax.layout import canonical_dimension_numbers
from mxjax.operands import canonical_operand, rotation_signs, split_key
from mxjax.quantization import MXArray, dequantize, fake_quantize_with, quantize_with
from mxjax.remat import PACKED_RESIDUAL
from mxjax.rotation import hadamard
from mxjax.scaling import SR_UNSCALE

__all__ = ["PackedResidual", "pack_rhs", "packed_rhs_gemm", "saves_packed"]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PackedResidual:
    """A backward GEMM's rhs operand, quantized by the forward pass.

    Attributes:
      q: the operand in the GEMM's canonical layout ``[batch..., Fb, K']`` (K' the
        contraction, zero-padded to the Hadamard size if the recipe has one), rotated by
        the recipe's Hadamard, quantized along K' under ``recipe.rhs`` with the GEMM's key.
      shape, dtype: the operand as the GEMM takes it (its own layout, after any cast).
      primal_dtype: the primal's dtype before the cast (its cotangent's).
    """

    q: MXArray
    shape: tuple[int, ...]
    dtype: Any
    primal_dtype: Any

    def tree_flatten(self):
        return (self.q,), (self.shape, self.dtype, self.primal_dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def nbytes(self) -> int:
        """Bytes held (codes, scales, tensor scale)."""
        return self.q.nbytes


@functools.cache
def _packable(recipe) -> bool:
    op = recipe.rhs
    if recipe.is_passthrough or op.is_passthrough or op.fmt.is_per_tensor:
        return False
    if recipe.lhs.fmt.is_per_tensor or takes_f8_on_cuda(recipe):
        return False
    try:
        choices = routes_per_platform(recipe.backend, recipe.lhs.fmt, recipe.rhs.fmt)
    except ValueError:
        return False
    return all(route is not None and not why and route.name == "xla"
               for route, why in choices.values())


def saves_packed(recipe) -> bool:
    """Whether the backward GEMM under `recipe` takes its rhs operand packed (module
    docstring): a block-scaled rhs, the emulation ('xla') on every platform the backend
    resolves to, and a program compiled for a CPU or, for a GPU/TPU, a recipe whose
    emulated form there is the canonical one (not the MX in-place forms)."""
    if not _packable(recipe):
        return False
    return target_chip().platform == "cpu" or not in_place_mx(recipe)


def _rotated(x3: jax.Array, recipe, k_had) -> jax.Array:
    """`mxjax.operands.rotate`'s rotation of one canonical operand (padded to the size)."""
    had = recipe.hadamard
    if had is None:
        return x3
    h = had.block_size
    pad = (-x3.shape[-1]) % h
    if pad:
        x3 = jnp.pad(x3, [(0, 0)] * (x3.ndim - 1) + [(0, pad)])
    return cpu_barrier(hadamard(x3, h, axis=-1, signs=rotation_signs(had, k_had)))


def pack_rhs(b: jax.Array, dims: Dims, recipe, key, dtype=None) -> PackedResidual:
    """The rhs `b` of the GEMM ``dot_general(a, b, dims)`` under `recipe` as that GEMM
    quantizes it (cast to `dtype` first if given), packed and named for remat policies.

    ``key``: the GEMM's key (None when the recipe needs none); its splits are the GEMM's.
    """
    primal_dtype = jnp.dtype(b.dtype)
    if dtype is not None:
        b = b.astype(dtype)
    (_, cb), (_, bb) = dims
    _, k_rhs, k_had = split_key(key if recipe.needs_key else None)
    b3 = _rotated(canonical_operand(b, bb, cb), recipe, k_had)
    q = _residual(b3, k_rhs, recipe.rhs)
    q = jax.tree.map(lambda x: checkpoint_name(x, PACKED_RESIDUAL), q)
    return PackedResidual(q, tuple(b.shape), jnp.dtype(b.dtype), primal_dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _residual(b3: jax.Array, key, op) -> MXArray:
    """``quantize_with(b3, op, -1, key=key)``, which must not be differentiated (below)."""
    return quantize_with(b3, op, -1, key=key)


@_residual.defjvp
def _residual_jvp(op, primals, tangents):
    del op, primals, tangents
    raise TypeError(
        "mxjax.dot_general: a gradient computed from packed quantized residuals "
        "(mxjax.residuals) is being differentiated again, across a jax.jit boundary that hid "
        "the outer differentiation from the inner one (e.g. jax.grad(jax.jit(jax.grad(f)))). "
        "Put the outer differentiation inside the same jit (jax.jit(jax.grad(jax.grad(f)))) "
        "or differentiate without the inner jit: there the forward keeps its primals and "
        "second derivatives follow the straight-through rule (docs/NUMERICS.md).")


def _values(q: MXArray) -> jax.Array:
    """The f32 values `q` holds (``fake_quantize``'s, bit for bit)."""
    return dequantize(q, jnp.float32)


def _parts(q: MXArray) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """(values, per-tensor factors) as `mxjax.emulation.forms`' accelerator form splits them:
    the values without the tensor scale and the SR unscale, which multiply the result."""
    bare = MXArray(q.codes, q.scales, None if q.tensor_scale is None else jnp.float32(1.0),
                   q.shape, q.axis, q.fmt, False)
    factors = () if q.tensor_scale is None else (q.tensor_scale,)
    if q.sr_prescale:
        factors += (jnp.float32(SR_UNSCALE),)
    return dequantize(bare, jnp.float32), factors


def _cpu(a3, q, recipe, k_lhs):
    """XLA:CPU: `mxjax.emulation.forms`' form with the rhs dequantized from the residual."""
    aq = cpu_barrier(fake_quantize_with(a3, recipe.lhs, -1, key=k_lhs))
    bq = cpu_barrier(_values(q))
    return lax.dot_general(aq, bq, canonical_dimension_numbers(a3.ndim - 2),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _accelerator(a3, q, recipe, k_lhs):
    """GPU/TPU: bf16 operands at DEFAULT with f32 accumulation, per-tensor factors on the
    result (`mxjax.emulation.forms.accelerator_gemm`'s form); f32 at HIGHEST otherwise."""
    dims = canonical_dimension_numbers(a3.ndim - 2)
    if accelerator_operand_dtype(recipe) != jnp.bfloat16:
        aq = fake_quantize_with(a3, recipe.lhs, -1, key=k_lhs)
        return lax.dot_general(aq, _values(q), dims, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    av, a_factors = prepare_operand_parts(a3, recipe.lhs, k_lhs)
    bv, b_factors = _parts(q)
    out = lax.dot_general(av.astype(jnp.bfloat16), bv.astype(jnp.bfloat16), dims,
                          precision=lax.Precision.DEFAULT, preferred_element_type=jnp.float32)
    for factor in a_factors + b_factors:
        out = out * factor
    return out


def packed_rhs_gemm(a: jax.Array, packed: PackedResidual, dims: Dims, recipe, key, *,
                    preferred_element_type=None) -> jax.Array:
    """``dot_general(a, b, dims)`` under `recipe`, b given as the residual `pack_rhs` made.

    The same result, bit for bit, as `mxjax.gemm.gemm` of the primal ``b`` on XLA:CPU; on
    GPUs and TPUs the emulation's canonical form (`mxjax.emulation.forms.accelerator_gemm`)
    of the same values. In ``lax.dot_general``'s layout and result dtype.
    """
    (ca, cb), (ba, bb) = dims
    out_dtype = jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=dims.as_lax(),
                          preferred_element_type=preferred_element_type),
        jax.ShapeDtypeStruct(a.shape, a.dtype),
        jax.ShapeDtypeStruct(packed.shape, packed.dtype)).dtype
    k_lhs, _, k_had = split_key(key if recipe.needs_key else None)
    a3 = _rotated(canonical_operand(a, ba, ca), recipe, k_had)
    q = packed.q
    out = per_platform(a3, cpu=lambda a3: _cpu(a3, q, recipe, k_lhs),
                       gpu=lambda a3: _accelerator(a3, q, recipe, k_lhs),
                       tpu=lambda a3: _accelerator(a3, q, recipe, k_lhs))
    fa = [a.shape[i] for i in free_axes(a.ndim, ba, ca)]
    fb = [packed.shape[i] for i in free_axes(len(packed.shape), bb, cb)]
    out = out.reshape(tuple(a.shape[i] for i in ba) + tuple(fa) + tuple(fb))
    return out.astype(out_dtype)
