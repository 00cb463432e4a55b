"""The emulated MXFP4 GEMM on GPUs and TPUs: operands quantized in place, in fusible passes.

On an accelerator an MX-quantized GEMM operand costs, at best, one read of the
high-precision operand and one write of its bf16 values before the GEMM reads
them (the values are exact in bf16, docs/NUMERICS.md). This module builds that
program for XLA's GPU and TPU compilers:

* **in place**: each operand keeps its own layout. Its contracting axes are merged
  (a free reshape when they are adjacent and in order, else one transpose) and
  the MX blocks run along that axis wherever it is, so no operand is transposed
  into the canonical ``[batch..., F, K]`` and the GEMM reads its operands in the
  layout a bf16 GEMM would (XLA keeps its transpose folding and GEMM merges);
* **bit view** (GPU): the contraction axis is split into (blocks, 2, 2, 2, 2, 2),
  so the Hadamard butterflies (`mxjax.rotation.hadamard_bit_view`) and the block
  amax are plain elementwise ops and a reduction over size-2 axes: XLA fuses the
  convert, the rotation and the amax into one reduction pass, and the rotation
  (recomputed), the rounding and the bf16 convert into one elementwise pass; a
  barrier on the input of the second pass keeps XLA from materializing the f32
  rotated operand between the two instead. For h <= 32 the amax skips the last
  butterfly stage (``max(|a + b|, |a - b|) == |a| + |b|`` in f32), which lets XLA
  fuse the amax pass whole even for operands larger than the L2 cache; and the rounding
  pass rounds the last stage's two halves as two results, each from its own copy of
  the input (`split_halves`), because XLA materializes in f32 a producer that the two
  halves share (H200 deviceless, [8192, 14336] bf16 H16 operand to FP8: 2.57 GB moved
  with neither, 1.66 GB with the amax change, 0.77 GB with both);
* **cheap scaling**: the power-of-two scalings are f32 multiplies
  (`mxjax.emulation.in_place_values`, which says where the values agree); round-to-nearest-
  even rounds in place (`nearest_even_values`, the TPU kernel's form, the Hadamard's
  1/sqrt(h) in its one multiply).

Values equal `mxjax.quantization.fake_quantize_parts` of the canonical operand bit
for bit (stochastic rounding draws its uniforms in the canonical shape and
transposes them here). Only MX (E8M0-scaled) formats take this path;
`mxjax.gemm` keeps NVFP4, per-tensor FP8 and the f32 fallback on canonical
operands.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mxjax import _bits
from mxjax.dimensions import free_axes
from mxjax.emulation import in_place_tpu
from mxjax.emulation.in_place_values import nearest_even_values, values_from_amax
from mxjax.formats import Rounding
from mxjax.quantization import MXArray, dequantize
from mxjax.rotation import bit_view, butterfly_stage, hadamard_bit_view
from mxjax.scaling import SR_UNSCALE

__all__ = [
    "ContractionView",
    "canonical_layout",
    "cast_operands",
    "contraction_view",
    "mx_gemm",
    "mx_gemm_packed_rhs",
    "mx_operand_values",
    "mx_operand_values_tpu",
]

MX_BLOCK = 32
_MX_BITS = 5  # log2(MX_BLOCK)


class ContractionView(NamedTuple):
    """An operand with its contracting axes merged into one (`contraction_view`).

    ``x``: the operand, contracting axes merged into axis ``axis`` (their
    row-major flattening in the dimension numbers' order). ``batch``: the
    positions of the dimension numbers' batch axes in ``x``, in their order.
    ``canonical_perm``: for each axis of ``x`` but ``axis``, its position in the
    canonical order (batch axes in the dimension numbers' order, then the free
    axes in order), used to lay out canonical-shaped arrays (the uniforms of
    stochastic rounding) like ``x``.
    """

    x: jax.Array
    axis: int
    batch: tuple[int, ...]
    canonical_perm: tuple[int, ...]


def contraction_view(x: jax.Array, batch: Sequence[int],
                     contract: Sequence[int]) -> ContractionView:
    """`x` with its contracting axes merged: free if they are adjacent and in order.

    Otherwise the contracting axes are moved after the others (one transpose).
    Free and batch axes keep their relative order.
    """
    batch, contract = tuple(batch), tuple(contract)
    kept = [i for i in range(x.ndim) if i not in contract]
    k = math.prod(x.shape[i] for i in contract)
    p, view_batch, canonical_perm = _view_axes(x.ndim, batch, contract)
    if _adjacent(contract):
        x2 = x.reshape(x.shape[:p] + (k,) + x.shape[p + len(contract):])
    else:
        x2 = jnp.transpose(x, tuple(kept) + contract).reshape(
            tuple(x.shape[i] for i in kept) + (k,))
    return ContractionView(x2, p, view_batch, canonical_perm)


def _adjacent(contract: tuple[int, ...]) -> bool:
    return bool(contract) and contract == tuple(range(contract[0], contract[0] + len(contract)))


def _view_axes(ndim: int, batch: tuple[int, ...], contract: tuple[int, ...]):
    """`contraction_view`'s (axis, batch, canonical_perm) for an operand of `ndim` axes."""
    kept = [i for i in range(ndim) if i not in contract]
    p = contract[0] if _adjacent(contract) else len(kept)
    # Position in the view of each original non-contracting axis (kept in original order).
    pos = {ax: (j if j < p else j + 1) for j, ax in enumerate(kept)}
    canonical = tuple(batch) + tuple(free_axes(ndim, batch, contract))
    canonical_perm = tuple(canonical.index(ax) for ax in kept)
    return p, tuple(pos[ax] for ax in batch), canonical_perm


def canonical_layout(x: jax.Array, view: ContractionView, k_len: int) -> jax.Array:
    """``x`` laid out like ``view.x`` (its contraction, of length ``k_len`` here, at
    ``view.axis``) as ``[B, F, k_len]``: batch axes, free axes, contraction, each flattened
    (the block-scaled dot's operand layout)."""
    p = view.axis
    free = [i for i in range(x.ndim) if i != p and i not in view.batch]
    perm = tuple(view.batch) + tuple(free) + (p,)
    b = math.prod(x.shape[i] for i in view.batch)
    f = math.prod(x.shape[i] for i in free)
    return jnp.transpose(x, perm).reshape(b, f, k_len)


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    pad = size - x.shape[axis]
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _uniforms_like(key: jax.Array, view: ContractionView, k_pad: int) -> jax.Array:
    """The uniforms `fake_quantize_parts` draws for the canonical operand, laid out like view.x.

    Canonical shape: (batch..., free..., K padded), i.e. the canonical operand's
    ``[batch..., F, K]`` with F unflattened (the same draws: JAX's uniforms depend
    on the flat index only). Transposed so that axis `view.axis` is K.
    """
    x = view.x
    kept_shape = [x.shape[j] for j in range(x.ndim) if j != view.axis]
    canonical_shape = [0] * len(kept_shape)
    for size, c in zip(kept_shape, view.canonical_perm):
        canonical_shape[c] = size
    u = jax.random.uniform(key, tuple(canonical_shape) + (k_pad,), jnp.float32)
    perm = list(view.canonical_perm) + [len(kept_shape)]
    perm.insert(view.axis, perm.pop())
    return jnp.transpose(u, perm)


def _padded_length(k: int, hadamard_size: int | None) -> tuple[int, int]:
    """(bits of the bit view, the contraction padded to a whole number of blocks)."""
    h_bits = 0 if hadamard_size is None else hadamard_size.bit_length() - 1
    n_bits = max(_MX_BITS, h_bits)
    return n_bits, -(-k // (1 << n_bits)) << n_bits


def mx_operand_values(view: ContractionView, op, *, k_out: int, hadamard_size: int | None,
                      signs: jax.Array | None, key: jax.Array | None,
                      recompute: bool = True, finish=None, split_halves: bool = True):
    """Fake-quantized MX values of one operand, in place, as bf16 (per-tensor factors left out).

    The GPU form (the bit view, module docstring).

    Args:
      view: the operand with its contraction merged (`contraction_view`).
      op: its OperandRecipe (an E8M0 format with bf16-exact values).
      k_out: the contraction length the GEMM contracts over (the operand's,
        zero-padded to a multiple of the Hadamard size when there is one).
      hadamard_size: h, or None for no rotation.
      signs: the rotation's ±1 vector or None.
      key: the rounding key (stochastic rounding) or None.
      recompute: recompute the rotation in the rounding pass (behind a barrier)
        instead of letting XLA materialize it between the passes (fewer bytes for
        most operand shapes, deviceless H200 compiles).
      finish: None, or ``finish(v, amax_bits) -> (w, extra)``: maps the f32 values
        (the bit view's shape) to what the GEMM reads instead of their bf16 cast
        (`mxjax.routes.xla_fp8`: an exact FP8 encoding), given every block's amax
        bits; ``w`` is laid out and sliced as the values are.
      split_halves: for h <= 32, round the last butterfly stage's two halves as two
        results joined afterwards, each recomputing the stages before it (XLA then
        fuses the rounding pass whole: H200 deviceless, [8192, 14336] bf16 H16 operand
        to bf16 values 1.78 -> 0.89 GB moved, to FP8 1.66 -> 0.77 GB); False rounds the
        whole transform at once (fewer bytes for `finish` writing E2M1 codes, where XLA
        splits the halves' fusion anyway: 1.69 vs 2.91 GB on B200).
    Returns:
      bf16, view.x's shape with k_out along view.axis: the values of
      ``fake_quantize_parts(canonical operand rotated, fmt, axis=-1)`` there; with
      ``finish``, ``(w, extra)``.
    """
    p = view.axis
    n_bits, k_pad = _padded_length(view.x.shape[p], hadamard_size)
    z = bit_view(_pad_axis(view.x, p, k_pad), p, n_bits)
    low = p + n_bits  # the lowest bit axis
    block_axes = tuple(range(low - _MX_BITS + 1, low + 1))

    h = hadamard_size
    # Round-to-nearest-even takes `nearest_even_values` (same values, fewer operations):
    # the rotation stays unnormalized and its 1/sqrt(h) goes into that function's one
    # multiply.
    fast = op.rounding is Rounding.NEAREST_EVEN and not op.sr_prescale
    norm = 1.0 if h is None else 1.0 / math.sqrt(h)
    # For h <= 32 the last butterfly stage pairs elements of the same MX block, and
    # max(|a + b|, |a - b|) == |a| + |b| in f32 (RNE is symmetric), so the amax is taken
    # before that stage. Then scaled by 1/sqrt(h): f32 rounding is monotone, so the amax
    # of the normalized elements is the normalized amax.
    pair_amax = h is not None and h <= MX_BLOCK

    def rotated(v, last_stage=True):
        if h is None:
            return v.astype(jnp.float32)
        r = hadamard_bit_view(v, h, low, signs, last_stage=last_stage and not pair_amax,
                              normalize=not fast)
        if pair_amax and last_stage:
            r = butterfly_stage(r, low - (h.bit_length() - 2))
            if not fast:
                r = r * jnp.float32(norm)
        return r

    def abs_bits(v):
        return _bits.f32_bits(v) & _bits.ABS_MASK

    if pair_amax:
        pre = rotated(z, last_stage=False)
        ax = low - (h.bit_length() - 2)
        sums = (_bits.bits_f32(abs_bits(lax.index_in_dim(pre, 0, ax, keepdims=True)))
                + _bits.bits_f32(abs_bits(lax.index_in_dim(pre, 1, ax, keepdims=True))))
        amax_bits = jnp.max(abs_bits(sums), axis=block_axes, keepdims=True)
    else:
        amax_bits = jnp.max(abs_bits(rotated(z)), axis=block_axes, keepdims=True)
    if h is not None and (pair_amax or fast):
        amax_bits = _bits.f32_bits(_bits.bits_f32(amax_bits) * jnp.float32(norm))
    zr = lax.optimization_barrier(z) if recompute else z
    u = None
    if op.rounding is Rounding.STOCHASTIC:
        u = bit_view(_uniforms_like(key, view, k_pad), p, n_bits)

    def values(r, u):
        if fast:
            return nearest_even_values(r, amax_bits, op, prescale=norm)
        return values_from_amax(r, amax_bits, op, u)

    def finished(v):
        return (v.astype(jnp.bfloat16), None) if finish is None else finish(v, amax_bits)

    if pair_amax and split_halves:
        # The last stage's two halves as two results, joined after the rounding: one
        # fusion (XLA materializes the f32 halves of the last stage's input otherwise).
        ax = low - (h.bit_length() - 2)
        halves = []
        # Each half recomputes both inputs from its own copy of z (a barrier keeps XLA from
        # sharing them, which would materialize them in f32).
        for i, zi in enumerate(lax.optimization_barrier((zr, zr))):
            pre = rotated(zi, last_stage=False)
            a = lax.index_in_dim(pre, 0, ax, keepdims=True)
            b = lax.index_in_dim(pre, 1, ax, keepdims=True)
            r = a + b if i == 0 else a - b
            if not fast:
                r = r * jnp.float32(norm)
            ui = None if u is None else lax.index_in_dim(u, i, ax, keepdims=True)
            halves.append(finished(values(r, ui)))
        (w0, extra), (w1, _) = halves
        v = jnp.concatenate([w0, w1], axis=ax)
    else:
        v, extra = finished(values(rotated(zr), u))
    v = lax.slice_in_dim(v.reshape(z.shape[:p] + (k_pad,) + z.shape[low + 1:]), 0, k_out, axis=p)
    return v if finish is None else (v, extra)


# --------------------------------------------------------------------------- #
# Sharded operands (custom_partitioning): each device quantizes its own shard
# --------------------------------------------------------------------------- #
# The bit view's reshapes, the barriers and the halves' concatenation leave XLA's sharding
# propagation without the operand's sharding at the GEMM: under FSDP it then partitioned the
# wgrad by gathering the quantized values along the sharded token axis (8B layer on 8 B200s:
# 448 MiB per operand). Here the values keep the operand's partition: blocks run along one
# axis, so wherever every shard holds whole blocks each device quantizes its own shard (the
# same bits); elsewhere that axis is gathered first, as before.

def _entry_names(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def values_spec(mesh, spec, shape, axis: int, step: int, whole: bool) -> tuple:
    """The partition the values are computed in, from the one XLA proposes for the operand:
    each axis keeps the mesh axes that divide it, the block axis only where ``whole`` (no
    padding along it) and each shard holds whole blocks of ``step``."""
    out = []
    for ax, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        n = math.prod(mesh.shape[a] for a in _entry_names(entry))
        if n > 1 and (shape[ax] % n or (ax == axis and (not whole or (shape[ax] // n) % step))):
            entry = None
        out.append(entry if n > 1 else None)
    return tuple(out)


def _blockwise_rule(fn, axis, k_out, step, n_extra, mesh, value_types, result_types):
    """The Shardy rule: the values follow the operand axis for axis (the block axis too,
    unless padded); the other operands (signs, the program's constants) are replicated."""
    del fn, step, n_extra, mesh, result_types
    from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule
    from jax.extend.mlir import ir

    shape = ir.RankedTensorType(value_types[0]).shape
    x_map = [f"d{i}" for i in range(len(shape))]
    v_map, replicated = list(x_map), []
    if shape[axis] != k_out:
        x_map[axis], v_map[axis] = "kin", "kout"
        replicated += ["kin", "kout"]
    operands = [ArrayMapping(*x_map)]
    for i, t in enumerate(value_types[1:]):
        names = [f"c{i}_{j}" for j in range(len(ir.RankedTensorType(t).shape))]
        operands.append(ArrayMapping(*names))
        replicated += names
    return SdyShardingRule(tuple(operands), (ArrayMapping(*v_map),),
                           need_replication_factors=tuple(replicated))


def replicated_partition(mesh, arg_shapes, result_shape, lower):
    """A custom_partitioning partition computing everything whole on every device (for
    shardings no mesh names: what XLA's partitioner does with an opaque op)."""
    from jax._src.sharding_impls import GSPMDSharding

    def whole(s):
        return GSPMDSharding.get_replicated(s.sharding._device_assignment)

    return (mesh, lower, jax.tree.map(whole, result_shape),
            jax.tree.map(whole, arg_shapes))


def _blockwise_partition(fn, axis, k_out, step, n_extra, mesh, arg_shapes, result_shape):
    from jax.sharding import NamedSharding, PartitionSpec

    x = arg_shapes[0]
    if not hasattr(x.sharding, "spec"):  # no mesh to name the axes by: computed whole
        return replicated_partition(mesh, arg_shapes, result_shape,
                                    lambda x, *rest: fn(x, k_out, *rest[:n_extra]))
    spec = values_spec(mesh, x.sharding.spec, x.shape, axis, step, x.shape[axis] == k_out)
    args = (NamedSharding(mesh, PartitionSpec(*spec)),) + (
        NamedSharding(mesh, PartitionSpec()),) * (len(arg_shapes) - 1)
    n = math.prod(mesh.shape[a] for a in _entry_names(spec[axis]))

    def lower(x, *rest):  # the constants are traced anew for the shard
        return fn(x, k_out // n, *rest[:n_extra])

    return mesh, lower, NamedSharding(mesh, PartitionSpec(*spec)), args


def _blockwise_call(fn, axis, k_out, step, n_extra, x, *rest):
    """The unpartitioned values: the traced program with its constants as operands
    (custom_partitioning takes no closed-over constants)."""
    del axis, step
    extra, consts = rest[:n_extra], rest[n_extra:]
    closed = jax.make_jaxpr(lambda x, *e: fn(x, k_out, *e))(x, *extra)
    (out,) = jax.core.eval_jaxpr(closed.jaxpr, consts, x, *extra)
    return out


@functools.cache
def _blockwise_op():
    """`_blockwise_call` as one custom_partitioning op (built once, on first use)."""
    from jax.experimental.custom_partitioning import custom_partitioning

    op = custom_partitioning(_blockwise_call, static_argnums=(0, 1, 2, 3, 4))
    op.def_partition(partition=_blockwise_partition, sharding_rule=_blockwise_rule)
    return op


# Set while `mxjax.gemm` traces a GEMM under a mesh with explicit axes (inside
# jax.sharding.auto_axes): there a custom_partitioning op left XLA:CPU a 'Sharding' custom
# call it cannot run, so the operands are quantized as before (XLA partitions them).
_WHOLE = contextvars.ContextVar("mxjax_whole_operands", default=False)


@contextlib.contextmanager
def whole_operands():
    """Within the block, `blockwise` (and the kernels' `run_codec_sharded`) trace the plain
    computation, no custom_partitioning op."""
    token = _WHOLE.set(True)
    try:
        yield
    finally:
        _WHOLE.reset(token)


def partitioned() -> bool:
    """Whether per-shard custom_partitioning ops are traced here: a program for more than
    one device (the context mesh's, e.g. a deviceless compile for 8 GPUs, or this host's
    devices: a single device has nothing to partition, and there the plain computation
    traces and compiles faster), outside `whole_operands` and not under a mesh context
    with explicit axes (there `mxjax.gemm` runs the GEMM under ``auto_axes`` in
    `whole_operands`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if _WHOLE.get() or mesh.explicit_axes:
        return False
    return (not mesh.empty and mesh.size > 1) or jax.device_count() > 1


def blockwise(fn, x: jax.Array, *extra, axis: int, k_out: int, step: int) -> jax.Array:
    """``fn(x, k_out, *extra)``, partitionable: values of x computed by blocks along `axis`
    (of whole ``step`` elements; their length there ``k_out``, x's padded with zeros), every
    other axis elementwise. Under a multi-device sharding of x each device computes its own
    shard (`values_spec`: where no block crosses a shard boundary and nothing is padded;
    elsewhere that axis is gathered first), and the values keep x's partition: the same
    bits as unsharded. ``fn`` is static (hashable); ``extra``: small replicated arrays.
    """
    if not partitioned():
        return fn(x, k_out, *extra)
    axis = axis % x.ndim

    def plain(x, *e):
        return fn(x, k_out, *e)

    def call(x, *e):
        consts = jax.make_jaxpr(plain)(x, *e).consts
        return _blockwise_op()(fn, axis, k_out, step, len(e), x, *e,
                             *[jnp.asarray(c) for c in consts])

    return batchable(call, plain)(x, *extra)


def batchable(call, plain):
    """``call`` (a custom_partitioning op), batched under ``jax.vmap`` as ``plain`` (the same
    values, unpartitioned): custom_partitioning has no batching rule."""
    wrapped = jax.custom_batching.custom_vmap(call)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        del axis_size
        out = jax.vmap(plain, in_axes=[0 if b else None for b in in_batched])(*args)
        return out, jax.tree.map(lambda _: True, out)

    return wrapped


def _values(x, k_out, *signs, axis, op, hadamard_size):
    return mx_operand_values(ContractionView(x, axis, (), ()), op, k_out=k_out,
                             hadamard_size=hadamard_size, signs=signs[0] if signs else None,
                             key=None)


def sharded_operand_values(view: ContractionView, op, *, k_out: int,
                           hadamard_size: int | None, signs: jax.Array | None,
                           key: jax.Array | None) -> jax.Array:
    """`mx_operand_values` (no ``finish``), partitionable (`blockwise`): under a
    multi-device sharding of the operand each device quantizes its shard where no block
    crosses a shard boundary, and the values keep the operand's partition. The same bits.

    Stochastic rounding (uniforms drawn in the canonical shape) takes `mx_operand_values`
    as it is.
    """
    if key is not None or op.rounding is Rounding.STOCHASTIC:
        return mx_operand_values(view, op, k_out=k_out, hadamard_size=hadamard_size,
                                 signs=signs, key=key)
    extra = () if signs is None else (jnp.asarray(signs, jnp.float32),)
    fn = functools.partial(_values, axis=view.axis, op=op, hadamard_size=hadamard_size)
    return blockwise(fn, view.x, *extra, axis=view.axis, k_out=k_out,
                     step=max(MX_BLOCK, hadamard_size or 1))


def mx_operand_values_tpu(view: ContractionView, op, *, k_out: int,
                          hadamard_size: int | None, signs: jax.Array | None,
                          key: jax.Array | None, interpret: bool = False,
                          operand_dtype=None) -> jax.Array:
    """`mx_operand_values` by the TPU kernel (`mxjax.emulation.in_place_tpu`), same values.

    ``operand_dtype``: the values are those of ``view.x.astype(operand_dtype)``; an
    f32 operand cast to bf16 is rounded in the kernel (not materialized), other
    casts happen before it. Operands whose shape does not tile into the kernel
    take `mx_operand_values`.
    """
    bf16_cast = (operand_dtype is not None and jnp.dtype(operand_dtype) == jnp.bfloat16
                 and view.x.dtype == jnp.float32)
    if operand_dtype is not None and not bf16_cast:
        view = view._replace(x=view.x.astype(operand_dtype))
    p = view.axis
    _, k_pad = _padded_length(view.x.shape[p], hadamard_size)
    x2 = _pad_axis(view.x, p, k_pad)
    a, b = math.prod(x2.shape[:p]), math.prod(x2.shape[p + 1:])
    u = None
    if op.rounding is Rounding.STOCHASTIC:
        u = _uniforms_like(key, view, k_pad).reshape(a, k_pad, b)
    v = in_place_tpu.mx_values_tpu(x2.reshape(a, k_pad, b), op, hadamard_size=hadamard_size,
                                      signs=signs, u=u, interpret=interpret, bf16_cast=bf16_cast)
    if v is None:
        if bf16_cast:
            view = view._replace(x=view.x.astype(jnp.bfloat16))
        # XLA:TPU's fusions, as measured before the GPU form split the halves (no barriers).
        return mx_operand_values(view, op, k_out=k_out, hadamard_size=hadamard_size,
                                 signs=signs, key=key, recompute=False, split_halves=False)
    return lax.slice_in_dim(v.reshape(x2.shape), 0, k_out, axis=p)


def cast_operands(a, b, operand_dtypes):
    """(a, b), each cast to its dtype in `operand_dtypes` (None, or a pair of dtypes or
    None; None: unchanged)."""
    if operand_dtypes is None:
        return a, b
    da, db = operand_dtypes
    return (a if da is None else a.astype(da)), (b if db is None else b.astype(db))


def mx_gemm(a: jax.Array, b: jax.Array, dims, recipe, k_lhs, k_rhs, signs, *,
            form: str = "gpu", interpret: bool = False, operand_dtypes=None,
            out_dtype=None, row_chunks: int = 1) -> jax.Array:
    """``dot_general(a, b, dims)`` under an MX recipe, operands in place: f32, lax's layout.

    Both operands' formats must be E8M0-scaled with bf16-exact values (MXFP4). The
    result is ``[batch..., lhs free..., rhs free...]`` like ``lax.dot_general``'s,
    times the SR 3/4 unscale of each operand that has it. ``form``: 'gpu' (the
    bit view, `mx_operand_values`) or 'tpu' (the kernel, `mx_operand_values_tpu`;
    ``interpret`` runs it in the Pallas interpreter). ``operand_dtypes``: None or a
    pair of dtypes (or None) the GEMM casts a and b to first (`mxjax.gemm.gemm`;
    the TPU kernel rounds an f32 operand to bf16 itself, XLA fuses the GPU form's
    casts into its quantize pass). ``out_dtype``: the result cast to it (f32 if None).
    ``row_chunks`` > 1: the larger operand without a stochastic-rounding key (whose draws
    are drawn for its whole shape) is cut along its largest free axis into that many
    pieces (the largest divisor of the axis' size up to it), then the other likewise
    inside, each piece quantized, contracted, cast and written into the result in a loop
    (`in_pieces`): neither the values nor the f32 result are ever whole (the routes'
    fallback branches, whose buffers would otherwise set their program's peak memory).
    Quantization runs along K, so each piece's values are the whole operand's; each
    result element is a dot over K of the same values, summed in the order the GEMM
    library takes for the piece's shape (bit for bit with ``row_chunks=1`` where the sums
    are exact).
    """
    if form not in ("gpu", "tpu"):
        raise ValueError(f"form: expected 'gpu' or 'tpu', got {form!r}")
    cuts = _pieces(row_chunks, dims, (a, k_lhs), (b, k_rhs))
    if cuts:
        whole = functools.partial(mx_gemm, dims=dims, recipe=recipe, k_lhs=k_lhs, k_rhs=k_rhs,
                                  signs=signs, form=form, interpret=interpret,
                                  operand_dtypes=operand_dtypes, out_dtype=out_dtype)
        return _cut(whole, [a, b], cuts, dims)
    da, db = operand_dtypes or (None, None)
    if form == "gpu":
        a, b = cast_operands(a, b, operand_dtypes)
        da = db = None
    (ca, cb), (ba, bb) = dims
    va, vb = contraction_view(a, ba, ca), contraction_view(b, bb, cb)
    k = va.x.shape[va.axis]
    h = None if recipe.hadamard is None else recipe.hadamard.block_size
    k_out = k if h is None else -(-k // h) * h
    kw = {"k_out": k_out, "hadamard_size": h, "signs": signs}
    if form == "tpu":
        kw["interpret"] = interpret
        av = mx_operand_values_tpu(va, recipe.lhs, key=k_lhs, operand_dtype=da, **kw)
        bv = mx_operand_values_tpu(vb, recipe.rhs, key=k_rhs, operand_dtype=db, **kw)
    else:
        av = sharded_operand_values(va, recipe.lhs, key=k_lhs, **kw)
        bv = sharded_operand_values(vb, recipe.rhs, key=k_rhs, **kw)
    return _dot(av, bv, (((va.axis,), (vb.axis,)), (va.batch, vb.batch)), recipe, out_dtype)


def _dot(av, bv, dims, recipe, out_dtype):
    """The emulation's dot of operand values: f32 accumulation (DEFAULT precision: the values
    are bf16-exact), times the SR 3/4 unscale of each operand that has it, cast to
    ``out_dtype`` (f32 if None)."""
    out = lax.dot_general(av, bv, dims, precision=lax.Precision.DEFAULT,
                          preferred_element_type=jnp.float32)
    for op in (recipe.lhs, recipe.rhs):
        if op.sr_prescale:
            out = out * jnp.float32(SR_UNSCALE)
    return out if out_dtype is None else out.astype(out_dtype)


def _free(ndim: int, batch, contract) -> list[int]:
    return [i for i in range(ndim) if i not in contract and i not in batch]


def _pieces(row_chunks: int, dims, *operands) -> list[tuple[int, int, int]]:
    """(side, axis, n) of each operand a GEMM computes in pieces, larger operand first: each
    whose values do not depend on its whole shape (no stochastic-rounding key: its draws
    are drawn for the whole operand), cut along its largest free axis into n pieces (the
    largest divisor of that axis' size up to ``row_chunks``, when more than 1)."""
    if row_chunks <= 1:
        return []
    (ca, cb), (ba, bb) = dims
    cuts = []
    for side, ((x, key), contract, batch) in enumerate(zip(operands, (ca, cb), (ba, bb))):
        free = _free(x.ndim, batch, contract)
        if key is not None or not free:
            continue
        axis = max(free, key=lambda i: x.shape[i])
        n = max(d for d in range(1, row_chunks + 1) if x.shape[axis] % d == 0)
        if n > 1:
            cuts.append((x.size, side, axis, n))
    return [c[1:] for c in sorted(cuts, key=lambda c: -c[0])]


def _cut(fn, operands: list, cuts, dims):
    """``fn(*operands)`` (a GEMM) with each of ``cuts`` (side, axis, n) taken in pieces, one
    loop inside the other (`in_pieces`): a piece of each cut operand at a time."""
    if not cuts:
        return fn(*operands)
    (side, axis, n), rest = cuts[0], cuts[1:]

    def piece(p):
        ops = list(operands)
        ops[side] = p
        return _cut(fn, ops, rest, dims)

    out_axis = _out_axis(dims, operands[0].ndim, side, axis, operands[-1].ndim)
    return in_pieces(piece, operands[side], axis, n, out_axis)


def _out_axis(dims, a_ndim: int, side: int, axis: int, b_ndim: int | None = None) -> int:
    """The axis of ``dot_general(a, b, dims)``'s result that free axis `axis` of operand
    `side` (0: a, 1: b) becomes: ``[batch..., a's free..., b's free...]``."""
    (ca, cb), (ba, bb) = dims
    a_free = _free(a_ndim, ba, ca)
    if side == 0:
        return len(ba) + a_free.index(axis)
    return len(ba) + len(a_free) + _free(b_ndim, bb, cb).index(axis)


def in_pieces(fn, x, axis: int, n: int, out_axis: int) -> jax.Array:
    """``fn(x)`` for an fn whose result's ``out_axis`` follows x's free ``axis`` element for
    element (a GEMM's free axis), computed on ``n`` equal pieces of x along ``axis`` in a
    loop, each written into the result in place: only one piece of fn's intermediates is
    live at a time (`mx_gemm`'s ``row_chunks``). ``x``: an array, or a pytree of arrays
    cut alike (a packed operand's codes and scales)."""
    length = jax.tree.leaves(x)[0].shape[axis]
    size = length // n
    piece = jax.eval_shape(fn, jax.tree.map(lambda v: jax.ShapeDtypeStruct(
        v.shape[:axis] + (size,) + v.shape[axis + 1:], v.dtype), x))
    shape = piece.shape[:out_axis] + (length,) + piece.shape[out_axis + 1:]

    def body(j, out):
        part = fn(jax.tree.map(lambda v: lax.dynamic_slice_in_dim(v, j * size, size, axis), x))
        return lax.dynamic_update_slice_in_dim(out, part, j * size, out_axis)

    return lax.fori_loop(0, n, body, jnp.zeros(shape, piece.dtype))


def mx_gemm_packed_rhs(a: jax.Array, q: MXArray, b_shape: Sequence[int], dims, recipe, k_lhs,
                       signs, *, form: str = "gpu", interpret: bool = False,
                       operand_dtype=None, out_dtype=None, row_chunks: int = 1) -> jax.Array:
    """`mx_gemm` with its rhs given quantized: the same result, bit for bit.

    Args:
      a: the lhs (the GEMM casts it to ``operand_dtype`` first if given, as `mx_gemm`).
      q: the rhs's canonical quantized operand: the primal ``b`` (of shape ``b_shape``)
        in the canonical layout ``[batch..., F, K]`` (free axes flattened), rotated by the
        recipe's Hadamard (K zero-padded to its size), quantized along K with the rhs key
        (`mxjax.quantize_with`): the values `mx_gemm` gives b, laid out here as b's
        contraction view, so that the GEMM is the same ``dot_general``.
      dims: the dimension numbers of ``dot_general(a, b)``.
      form, interpret: as `mx_gemm`'s, for the lhs.
      out_dtype: as `mx_gemm`'s.
      row_chunks: as `mx_gemm`'s: the larger of a (its largest free axis, when it has no
        stochastic-rounding key) and q (its rows, the flattened free axis: dequantized and
        contracted piece by piece) is taken in that many pieces.
    Returns:
      ``[batch..., lhs free..., rhs free...]`` (f32, or out_dtype), as `mx_gemm`.
    """
    if form not in ("gpu", "tpu"):
        raise ValueError(f"form: expected 'gpu' or 'tpu', got {form!r}")
    gemm = functools.partial(_packed_rhs_gemm, q=q, b_shape=b_shape, dims=dims, recipe=recipe,
                             k_lhs=k_lhs, signs=signs, form=form, interpret=interpret,
                             operand_dtype=operand_dtype, out_dtype=out_dtype,
                             q_chunks=row_chunks)
    # The lhs in pieces (when it has no rounding key); q's rows in pieces inside.
    return _cut(gemm, [a], _pieces(row_chunks, dims, (a, k_lhs)), dims)


def _packed_rhs_gemm(a, *, q, b_shape, dims, recipe, k_lhs, signs, form, interpret,
                     operand_dtype, out_dtype, q_chunks):
    """`mx_gemm_packed_rhs` of a whole lhs; q's rows in ``q_chunks`` pieces."""
    if form == "gpu" and operand_dtype is not None:
        a, operand_dtype = a.astype(operand_dtype), None
    (ca, _), (ba, _) = dims
    va = contraction_view(a, ba, ca)
    h = None if recipe.hadamard is None else recipe.hadamard.block_size
    k = va.x.shape[va.axis]
    k_out = k if h is None else -(-k // h) * h
    kw = {"k_out": k_out, "hadamard_size": h, "signs": signs, "key": k_lhs}
    if form == "tpu":
        av = mx_operand_values_tpu(va, recipe.lhs, operand_dtype=operand_dtype,
                                   interpret=interpret, **kw)
    else:
        av = mx_operand_values(va, recipe.lhs, **kw)
    canonical = _packed_rhs_canonical(q, b_shape, dims, k_out)
    n = max(d for d in range(1, max(1, q_chunks) + 1) if q.shape[-2] % d == 0)
    if n > 1:  # pieces of q's rows
        return _packed_rhs_dot_in_chunks(av, va, q, canonical, recipe, out_dtype, n)
    bv, b_axis, b_batch = packed_rhs_values(q, b_shape, dims, k_out, av.dtype)
    return _dot(av, bv, (((va.axis,), (b_axis,)), (va.batch, b_batch)), recipe, out_dtype)


def _packed_rhs_canonical(q: MXArray, b_shape, dims, k_out: int) -> tuple[int, ...]:
    """b's canonical axes (batch, then free), checking q is b's canonical operand."""
    (_, cb), (_, bb) = dims
    canonical = tuple(b_shape[i] for i in bb) + tuple(
        b_shape[i] for i in free_axes(len(b_shape), bb, cb))
    want = canonical[:len(bb)] + (math.prod(canonical[len(bb):]), k_out)
    if tuple(q.shape) != want:
        raise ValueError(f"q: expected the canonical operand of shape {want} for b of shape "
                         f"{tuple(b_shape)}, got {tuple(q.shape)}")
    return canonical


def packed_rhs_values(q: MXArray, b_shape: Sequence[int], dims, k_out: int, dtype):
    """The values of a packed rhs laid out as b's contraction view (the layout `mx_gemm`
    contracts b in): ``(values, axis, batch)``, K padded to ``k_out``; without the SR
    unscale, which multiplies the GEMM's result (`mx_gemm_packed_rhs`)."""
    (_, cb), (_, bb) = dims
    canonical = _packed_rhs_canonical(q, b_shape, dims, k_out)
    b_axis, b_batch, b_perm = _view_axes(len(b_shape), tuple(bb), tuple(cb))
    bare = MXArray(q.codes, q.scales, q.tensor_scale, q.shape, q.axis, q.fmt, False)
    bv = dequantize(bare, dtype).reshape(canonical + (k_out,))
    perm = list(b_perm) + [len(b_perm)]
    perm.insert(b_axis, perm.pop())
    return jnp.transpose(bv, perm), b_axis, b_batch


def _packed_rhs_dot_in_chunks(av, va, q: MXArray, canonical, recipe, out_dtype, n: int):
    """`mx_gemm_packed_rhs`'s dot with q dequantized and contracted in ``n`` row pieces of
    its flattened free axis F (`in_pieces`): the result, ``[batch..., lhs free..., F]``, is
    then read as b's free axes."""
    n_batch = len(va.batch)
    dims = (((va.axis,), (n_batch + 1,)), (va.batch, tuple(range(n_batch))))

    def dot(parts):
        codes, scales = parts
        part = MXArray(codes, scales, q.tensor_scale, q.shape[:-2] + codes.shape[-2:-1]
                       + q.shape[-1:], q.axis, q.fmt, False)  # the SR unscale: on the result
        return _dot(av, dequantize(part, av.dtype), dims, recipe, out_dtype)

    out = in_pieces(dot, (q.codes, q.scales), q.codes.ndim - 2, n, av.ndim - 1)  # F: the last
    return out.reshape(out.shape[:-1] + tuple(canonical[n_batch:]))
