"""The TPU form of the in-place MX operand: one Mosaic (Pallas TPU) kernel per operand.

XLA's TPU compiler does not fuse the bit view of `mxjax.emulation.in_place` (axes of
size 2 break its (8, 128) tiling: relayout copies), nor block reductions along
the lane axis. This kernel reads the operand once and writes its bf16 values
once, with the MX blocks along the sublane (row) axis of each tile, where the
Hadamard butterflies are sublane rotations plus selects and the block amax is
an elementwise max over rows: an operand whose contraction is its minor (lane)
axis is transposed tile by tile inside the kernel and back.

The values are `mxjax.emulation.in_place.mx_operand_values`': the same butterflies on the
same elements, the same block scales, and the rounding of `values_from_amax` or, for
round-to-nearest-even, `nearest_even_values` (the same values in fewer operations,
the rotation's 1/sqrt(h) folded in); see those for what they equal.

Pallas is imported with this module, i.e. with `mxjax`: importing it later, at the
first quantized trace, would add its options to JAX's tracing context and make every
program traced before recompile once (tests/mxjax/test_import_effects.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mxjax import _bits
from mxjax.emulation.in_place_values import nearest_even_values, values_from_amax
from mxjax.formats import Rounding

__all__ = ["KernelSpec", "mx_values_tpu", "record_kernels", "tiles"]

_MX_BLOCK = 32
_SUBLANES = 8  # rows of an f32 vreg
# Tile edges tried, largest first: rows (the block axis) and columns (the other).
_ROW_TILES = (512, 256, 128, 64, 32)
_COL_TILES = (512, 256, 128)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """One traced kernel: operand [a, k, b] of `dtype`, its recipe, rotation, extra inputs."""

    a: int
    k: int
    b: int
    dtype: str
    op: object  # OperandRecipe
    hadamard_size: int | None
    has_signs: bool
    has_uniforms: bool
    bf16_cast: bool = False  # an f32 operand rounded to bf16 in the kernel (`mx_values_tpu`)


# Context-local list that `mx_values_tpu` appends to (set only inside `record_kernels`).
_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "mxjax_tpu_kernels", default=None)


@contextlib.contextmanager
def record_kernels():
    """Collects the `KernelSpec` of every kernel traced inside (for cost tools, e.g. bench/).

    The specs are recorded when a GEMM is traced, and JAX caches the traces of the
    emulated GEMM (`mxjax.emulation.forms.emulated_gemm`): entering clears JAX's caches
    (``jax.clear_caches()``), so that every kernel of a program traced inside is
    recorded; a kernel configuration traced again from the cache inside is not
    recorded twice.
    """
    jax.clear_caches()
    specs: list[KernelSpec] = []
    token = _RECORDING.set(specs)
    try:
        yield specs
    finally:
        _RECORDING.reset(token)


def _divisor(n: int, options) -> int | None:
    return next((t for t in options if n % t == 0), None)


def tiles(a: int, k: int, b: int, h: int) -> tuple[int, int] | None:
    """(rows, columns) of the kernel's tiles for an operand [a, k, b] (blocks along k), or None.

    ``b == 1`` is the lane case (tiles [columns of a, rows of k], transposed in the
    kernel); otherwise tiles are [rows of k, columns of b]. Rows are a multiple of
    max(32, h); None when the operand does not tile (the caller falls back).
    """
    unit = max(_MX_BLOCK, h)
    rows = _divisor(k, tuple(t for t in _ROW_TILES if t % unit == 0) or (unit,))
    if rows is None or rows % unit:
        return None
    other = a if b == 1 else b
    cols = _divisor(other, _COL_TILES)
    if cols is None:
        return None
    if b == 1 and rows % 128:  # the lane case transposes [cols, rows]: both lane-aligned
        rows = _divisor(k, (512, 256, 128))
        if rows is None or rows % unit:
            return None
    return rows, cols


def _rotate_rows(x, h: int, sign_col):
    """Butterflies along axis 0 (blocks of h rows), `hadamard`'s ops but the 1/sqrt(h).

    Partners less than 8 rows apart lie in the same vreg: each group of 8 rows is
    rotated on its own (one sublane rotation per vreg, none merging two vregs) and a
    select takes the sum or the difference; partners further apart are whole vregs
    (adds, no data movement).
    """
    n, c = x.shape
    if sign_col is not None:
        x = x * sign_col
    groups = x.reshape(n // _SUBLANES, _SUBLANES, c)
    row = lax.broadcasted_iota(jnp.int32, groups.shape, 1)
    s = 1
    while s < min(h, _SUBLANES):
        nxt = pltpu.roll(groups, _SUBLANES - s, 1)  # row i + s of the group
        prv = pltpu.roll(groups, s, 1)  # row i - s of the group
        groups = jnp.where((row & s) != 0, prv - groups, groups + nxt)
        s *= 2
    x = groups.reshape(n, c)
    while s < h:
        z = x.reshape(n // (2 * s), 2, s, c)
        a, b = z[:, 0], z[:, 1]
        x = jnp.stack([a + b, a - b], axis=1).reshape(n, c)
        s *= 2
    return x


def _values_rows(x, op, h, sign_col, u):
    """The MX values of a [rows, cols] f32 tile with blocks of 32 along rows."""
    if h:
        x = _rotate_rows(x, h, sign_col)
    scale = 1.0 / math.sqrt(h) if h else 1.0  # the rotation's normalization
    r, c = x.shape
    xb = x.reshape(r // _MX_BLOCK, _MX_BLOCK, c)
    if u is None and op.rounding is Rounding.NEAREST_EVEN and not op.sr_prescale:
        # The scale goes into the rounding's one multiply; the amax of the scaled
        # elements is the scaled amax (f32 rounding is monotone).
        amax_bits = _amax_bits(xb)
        if h:
            amax_bits = _bits.f32_bits(_bits.bits_f32(amax_bits) * jnp.float32(scale))
        v = nearest_even_values(xb, amax_bits, op, prescale=scale)
    else:
        xb = xb * jnp.float32(scale) if h else xb
        v = values_from_amax(xb, _amax_bits(xb), op, None if u is None else u.reshape(xb.shape))
    return v.reshape(r, c)


def _amax_bits(xb):
    """uint32 abs bits of the amax of each block of xb [nb, 32, c] (axis 1)."""
    abs_bits = (_bits.f32_bits(xb) & _bits.ABS_MASK).astype(jnp.int32)  # Mosaic: signed max
    return jnp.max(abs_bits, axis=1, keepdims=True).astype(jnp.uint32)


def _kernel(*refs, op, h, lanes, has_signs, has_u, bf16_cast):
    refs = list(refs)
    x_ref = refs.pop(0)
    sign_ref = refs.pop(0) if has_signs else None
    u_ref = refs.pop(0) if has_u else None
    (o_ref,) = refs
    x = x_ref[...]
    if bf16_cast:
        x = x.astype(jnp.bfloat16)
    x = x.astype(jnp.float32)
    u = None if u_ref is None else u_ref[...]
    if lanes:
        x = x.T
        u = None if u is None else u.T
    v = _values_rows(x, op, h, None if sign_ref is None else sign_ref[...], u)
    o_ref[...] = (v.T if lanes else v).astype(o_ref.dtype)


def mx_values_tpu(x3: jax.Array, op, *, hadamard_size: int | None, signs, u,
                  interpret: bool = False, bf16_cast: bool = False) -> jax.Array | None:
    """bf16 MX values of x3 [a, k, b] (blocks along k, k a multiple of max(32, h)), or None.

    ``u``: the uniforms of stochastic rounding in x3's layout (f32) or None.
    ``bf16_cast``: x3 is f32 and the values are those of ``x3.astype(bfloat16)``,
    rounded in the kernel (which then reads the f32 operand once, and no bf16 copy
    of it is written: e.g. an f32 master weight cast to a bf16 compute dtype).
    None is returned (nothing traced) when the shape does not tile (`tiles`).
    """
    if bf16_cast and x3.dtype != jnp.float32:
        raise ValueError(f"bf16_cast: needs a float32 x3, got {x3.dtype}")
    a, k, b = x3.shape
    h = hadamard_size or 0
    t = tiles(a, k, b, h)
    if t is None:
        return None
    rows, cols = t
    recording = _RECORDING.get()
    if recording is not None:
        recording.append(KernelSpec(a=a, k=k, b=b, dtype=jnp.dtype(x3.dtype).name, op=op,
                                    hadamard_size=hadamard_size, has_signs=signs is not None,
                                    has_uniforms=u is not None, bf16_cast=bf16_cast))
    sign_col = None
    if signs is not None:
        sign_col = jnp.tile(jnp.asarray(signs, jnp.float32), rows // h).reshape(rows, 1)
    out = _pallas_values(x3, sign_col, u, op=op, h=h, rows=rows, cols=cols,
                         interpret=interpret, bf16_cast=bf16_cast)
    return out.reshape(x3.shape)


# One jitted function per kernel configuration: every call of the same kernel on the
# same shapes lowers to the same function, so the custom calls XLA sees are identical
# (the kernel's debug locations included, which otherwise differ per call site and
# transformation) and XLA's CSE merges those that read the same operand (e.g. the
# q/k/v projections' shared input, quantized once per axis).
@functools.partial(jax.jit, static_argnames=("op", "h", "rows", "cols", "interpret", "bf16_cast"))
def _pallas_values(x3, sign_col, u, *, op, h, rows, cols, interpret, bf16_cast):
    a, k, b = x3.shape
    lanes = b == 1
    if lanes:
        x = x3.reshape(a, k)
        grid = (a // cols, k // rows)
        spec = pl.BlockSpec((cols, rows), lambda i, j: (i, j))
    else:
        x = x3
        grid = (a, k // rows, b // cols)
        spec = pl.BlockSpec((None, rows, cols), lambda n, i, j: (n, i, j))
    operands, in_specs = [x], [spec]
    if sign_col is not None:
        operands.append(sign_col)
        in_specs.append(pl.BlockSpec((rows, 1), lambda *_: (0, 0)))
    if u is not None:
        operands.append(u.reshape(x.shape))
        in_specs.append(spec)
    kernel = functools.partial(_kernel, op=op, h=h, lanes=lanes, has_signs=sign_col is not None,
                               has_u=u is not None, bf16_cast=bf16_cast)
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * len(grid)),
    )(*operands)
