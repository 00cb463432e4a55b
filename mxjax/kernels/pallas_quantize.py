"""Fused quantize kernel (Pallas): Hadamard + block amax + scale rule + rounding + packing.

One pass over a 2-D high-precision tensor writes packed codes and E8M0 scales
for a row-wise copy (blocks along axis 1), a column-wise copy (blocks along
axis 0), or both, each computed from the high-precision source tile (never one
copy from the other). Each copy has its own QuantSpec (an ``mxjax.OperandRecipe``
and an optional Hadamard size) plus its signs and SR key.

Bit-identity with `mxjax.quantize` comes from calling the same code: the
kernel body runs the reference's block quantizer
(`mxjax.quantization.quantize_blocks`: the E8M0 scaling scheme of
`mxjax.scaling` and the element helpers of `mxjax.elements`) on the tile's blocks. The Hadamard is
`_hadamard_tile` below: the same f32 operations as `mxjax.hadamard` (signs
multiply, log2(h) butterfly stages a+b / a-b, times 1/sqrt(h), cast back to the
input dtype), written without captured array constants (Pallas refuses them)
and with split/stack instead of reversal (Triton-lowerable); a test checks it
bit for bit against `mxjax.hadamard`. Hadamard blocks (<= the tile) and scale
blocks (32) never straddle tiles, so per-tile evaluation performs exactly the
reference's operations.

Stochastic rounding matches the reference's random bits: the uniforms are drawn
outside the kernel with the reference's own call, `jax.random.uniform(key,
shape, float32)` for the same shape (block axis last, padded to 32), and read
by the kernel tile by tile (4 extra bytes read per element).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mxjax import formats as F
from mxjax.formats import Format
from mxjax.kernels import _common as C
from mxjax.operand_recipe import OperandRecipe
from mxjax.quantization import FLOAT_DTYPES, MXArray, quantize_blocks
from mxjax.rotation import HADAMARD_SIZES
from mxjax.scaling import E8M0Blocks

__all__ = ["QuantSpec", "fused_quantize"]

_BLOCK = 32  # E8M0 block size of every MX format


def _coerce_recipe(value: Any) -> OperandRecipe:
    if isinstance(value, OperandRecipe):
        return value
    if isinstance(value, (Format, str)):
        return OperandRecipe(fmt=value)
    raise TypeError(f"recipe: expected an OperandRecipe, a Format or a format name, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """How one copy is quantized by `fused_quantize`: an operand recipe and a rotation.

    Attributes:
      recipe: the ``mxjax.OperandRecipe`` (format, scale rule, rounding, SR
        pre-scale; a Format or format name becomes ``OperandRecipe(fmt=...)``).
        Its format must be E8M0-scaled (MXFP4, MXFP8_E4M3, MXFP8_E5M2);
        STOCHASTIC rounding needs the copy's key.
      hadamard: None or the Hadamard block size (16, 32, 64, 128), applied along
        this copy's block axis before quantizing (signs passed to fused_quantize).
    """

    recipe: OperandRecipe | Format | str = F.MXFP4
    hadamard: int | None = None

    def __post_init__(self):
        recipe = _coerce_recipe(self.recipe)
        if type(recipe.scheme) is not E8M0Blocks:  # the kernel body is the E8M0 scheme's
            raise ValueError(
                f"fmt: the fused quantize kernel supports E8M0-scaled MX formats "
                f"(mxfp4, mxfp8_e4m3, mxfp8_e5m2), got {recipe.fmt.name}; use mxjax.quantize"
            )
        if self.hadamard is not None and self.hadamard not in HADAMARD_SIZES:
            raise ValueError(f"hadamard: expected None or one of {HADAMARD_SIZES}, "
                             f"got {self.hadamard!r}")
        object.__setattr__(self, "recipe", recipe)


def _hadamard_tile(x, h: int, signs, out_dtype=None):
    """mxjax.hadamard(x, h, axis=-1, signs) for a 2-D tile, op for op (see module doc).

    ``out_dtype``: the rotated values' dtype (None: x's, as mxjax.hadamard returns)."""
    r, n = x.shape
    xb = x.astype(jnp.float32).reshape(r, n // h, h)
    if signs is not None:
        xb = xb * signs
    stride = 1
    while stride < h:
        pairs = xb.reshape(r, n // h, h // (2 * stride), 2, stride)
        a, b = jnp.split(pairs, 2, axis=3)
        a = a.reshape(r, n // h, h // (2 * stride), stride)
        b = b.reshape(a.shape)
        # Lower element of each pair: a + b; upper: a - b (as in mxjax.hadamard).
        xb = jnp.swapaxes(jnp.stack([a + b, a - b], axis=-1), -1, -2).reshape(r, n // h, h)
        stride *= 2
    yb = xb * jnp.float32(1.0 / math.sqrt(h))
    return yb.reshape(r, n).astype(x.dtype if out_dtype is None else out_dtype)


def _quantize_tile(y, spec: QuantSpec, u, dtype=jnp.float32):
    """y: f32[r, n] (n % 32 == 0), block axis last -> (codes u8[r, n or n/2], scales u8[r, n/32]).

    `dtype`: the input's dtype (it bounds the scale, as in mxjax.quantize).
    """
    r, n = y.shape
    xb = y.reshape(r, n // _BLOCK, _BLOCK)
    ub = None if u is None else u.reshape(xb.shape)
    codes, scales, _ = quantize_blocks(xb, spec.recipe, ub, dtype)
    codes = codes.reshape(r, n)
    if spec.recipe.fmt.packed:
        codes = _pack_tile(codes)
    return codes, scales


def _pack_tile(codes):
    """u8[r, n] 4-bit codes -> u8[r, n/2], first of each pair in the low nibble.

    Same bytes as the packing in mxjax.quantize, written with split (Triton-lowerable)
    instead of strided indexing (lax.slice has no Pallas-Triton lowering).
    """
    r, n = codes.shape
    lo, hi = jnp.split(codes.reshape(r, n // 2, 2), 2, axis=-1)
    return (lo | (hi << 4)).reshape(r, n // 2)


def _fused_kernel(*refs, row, col, shape, tiles, flags, value_dtype):
    n_rows, n_cols = shape
    br, bc = tiles
    it = iter(refs)
    x_ref = next(it)
    row_signs = next(it)[...] if flags["row_signs"] else None
    col_signs = next(it)[...] if flags["col_signs"] else None
    u_row = next(it)[...] if flags["row_u"] else None
    u_col = next(it)[...] if flags["col_u"] else None
    outs = list(it)

    x = x_ref[...]
    if value_dtype is not None:
        x = x.astype(value_dtype)
    if (row is not None and row.hadamard) or (col is not None and col.hadamard):
        i, j = pl.program_id(0), pl.program_id(1)
        rows = i * br + lax.broadcasted_iota(jnp.int32, (br, bc), 0)
        cols = j * bc + lax.broadcasted_iota(jnp.int32, (br, bc), 1)
        valid = (rows < n_rows) & (cols < n_cols)

    if row is not None:
        y = x
        if row.hadamard:
            # The reference pads after the rotation: keep padding +0.
            y = jnp.where(valid, _hadamard_tile(y, row.hadamard, row_signs), 0)
        codes, scales = _quantize_tile(y.astype(jnp.float32), row, u_row, x.dtype)
        outs[0][...] = codes
        outs[1][...] = scales
        outs = outs[2:]
    if col is not None:
        y = x.T
        if col.hadamard:
            y = jnp.where(valid.T, _hadamard_tile(y, col.hadamard, col_signs), 0)
        codes, scales = _quantize_tile(y.astype(jnp.float32), col, u_col, x.dtype)
        outs[0][...] = codes.T
        outs[1][...] = scales.T


def _check_signs(signs, spec, name):
    if signs is None:
        return None
    if spec is None or not spec.hadamard:
        raise ValueError(f"{name}: signs given but that copy has no Hadamard")
    signs = jnp.asarray(signs, jnp.float32)
    if signs.shape != (spec.hadamard,):
        raise ValueError(f"{name}: expected shape ({spec.hadamard},), got {signs.shape}")
    return signs


def fused_quantize(
    x: jnp.ndarray,
    *,
    row: QuantSpec | None = None,
    col: QuantSpec | None = None,
    row_signs: jnp.ndarray | None = None,
    col_signs: jnp.ndarray | None = None,
    row_key: jax.Array | None = None,
    col_key: jax.Array | None = None,
    block_rows: int = 128,
    block_cols: int = 128,
    interpret: bool | None = None,
    value_dtype=None,
) -> tuple[MXArray | None, MXArray | None]:
    """Quantizes a 2-D array into a row-wise and/or a column-wise MX copy in one pass.

    Equal bit for bit to
      row: quantize_with(hadamard(x, row.hadamard, axis=1, signs=row_signs), row.recipe,
                         axis=1, key=row_key)      (no hadamard call if row.hadamard is None)
      col: the same with axis=0 and the col_* arguments.

    Args:
      x: float32/bfloat16/float16 [R, C].
      row, col: QuantSpec of each copy, or None to skip it (at least one).
      row_signs, col_signs: optional ±1 f32[h] Hadamard sign vectors.
      row_key, col_key: PRNG keys for STOCHASTIC rounding of each copy.
      block_rows, block_cols: tile size (powers of two, multiples of 32).
      interpret: run the Pallas interpreter (default: unless the backend is GPU).
      value_dtype: None, or float32: quantize ``x.astype(float32)`` instead (the
        rotation kept in f32 and the scale bounded by f32, as mxjax's GEMMs quantize
        their f32 canonical operands), converted in the kernel, not materialized.
    Returns:
      (row MXArray with codes u8[R, pad32(C)/2 (FP4) or pad32(C)], scales u8[R, pad32(C)/32],
       axis=1; col MXArray with codes u8[pad32(R)/2 or pad32(R), C], scales u8[pad32(R)/32, C],
       axis=0); None for a copy not asked for.
    """
    if interpret is None:
        interpret = C.default_interpret()
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x: expected a 2-D array, got shape {x.shape}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x: expected float32, bfloat16 or float16, got {x.dtype}")
    if row is None and col is None:
        raise ValueError("row, col: ask for at least one copy")
    if value_dtype is not None and jnp.dtype(value_dtype) != jnp.float32:
        raise ValueError(f"value_dtype: expected None or float32, got {value_dtype!r}")
    for name, spec in (("row", row), ("col", col)):
        if spec is not None and not isinstance(spec, QuantSpec):
            raise TypeError(f"{name}: expected a QuantSpec or None, got {type(spec).__name__}")
    n_rows, n_cols = x.shape
    if row is not None and row.hadamard and n_cols % row.hadamard:
        raise ValueError(
            f"x: {n_cols} columns are not a multiple of row.hadamard={row.hadamard} (pad first)"
        )
    if col is not None and col.hadamard and n_rows % col.hadamard:
        raise ValueError(
            f"x: {n_rows} rows are not a multiple of col.hadamard={col.hadamard} (pad first)"
        )
    for name, spec, key in (("row_key", row, row_key), ("col_key", col, col_key)):
        if spec is not None and spec.recipe.needs_key and key is None:
            raise ValueError(f"{name}: STOCHASTIC rounding needs a PRNG key")
    row_signs = _check_signs(row_signs, row, "row_signs")
    col_signs = _check_signs(col_signs, col, "col_signs")

    br = C.tile(n_rows, block_rows, _BLOCK)
    bc = C.tile(n_cols, block_cols, _BLOCK)
    for name, b in (("block_rows", br), ("block_cols", bc)):
        if b % _BLOCK or b & (b - 1):
            raise ValueError(f"{name}: must be a power of two and a multiple of 32, got {b}")
    for spec, b, name in ((row, bc, "block_cols"), (col, br, "block_rows")):
        if spec is not None and spec.hadamard and b % spec.hadamard:
            raise ValueError(f"{name}: tile {b} is smaller than the Hadamard size {spec.hadamard}")
    rp, cp = C.round_up(n_rows, br), C.round_up(n_cols, bc)
    grid = (rp // br, cp // bc)

    inputs = [C.pad2(x, rp, cp)]
    in_specs = [pl.BlockSpec((br, bc), lambda i, j: (i, j))]
    flags = {"row_signs": row_signs is not None, "col_signs": col_signs is not None,
                 "row_u": False, "col_u": False}
    for s in (row_signs, col_signs):
        if s is not None:
            inputs.append(s)
            in_specs.append(pl.BlockSpec(s.shape, lambda i, j: (0,)))
    if row is not None and row.recipe.needs_key:
        # Reference: uniforms over x with axis 1 last, padded to the block.
        u = jax.random.uniform(row_key, (n_rows, C.round_up(n_cols, _BLOCK)), jnp.float32)
        inputs.append(C.pad2(u, rp, cp))
        in_specs.append(pl.BlockSpec((br, bc), lambda i, j: (i, j)))
        flags["row_u"] = True
    if col is not None and col.recipe.needs_key:
        # Reference: uniforms over x.T (axis 0 last), padded to the block; read transposed.
        u = jax.random.uniform(col_key, (n_cols, C.round_up(n_rows, _BLOCK)), jnp.float32)
        inputs.append(C.pad2(u, cp, rp))
        in_specs.append(pl.BlockSpec((bc, br), lambda i, j: (j, i)))
        flags["col_u"] = True

    out_shape, out_specs = [], []
    if row is not None:
        cw = bc // 2 if row.recipe.fmt.packed else bc
        out_shape += [jax.ShapeDtypeStruct((rp, grid[1] * cw), jnp.uint8),
                      jax.ShapeDtypeStruct((rp, cp // _BLOCK), jnp.uint8)]
        out_specs += [pl.BlockSpec((br, cw), lambda i, j: (i, j)),
                      pl.BlockSpec((br, bc // _BLOCK), lambda i, j: (i, j))]
    if col is not None:
        rw = br // 2 if col.recipe.fmt.packed else br
        out_shape += [jax.ShapeDtypeStruct((grid[0] * rw, cp), jnp.uint8),
                      jax.ShapeDtypeStruct((rp // _BLOCK, cp), jnp.uint8)]
        out_specs += [pl.BlockSpec((rw, bc), lambda i, j: (i, j)),
                      pl.BlockSpec((br // _BLOCK, bc), lambda i, j: (i, j))]

    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt

        params = plt.CompilerParams(num_warps=4, num_stages=1)
    kernel = functools.partial(
        _fused_kernel, row=row, col=col, shape=(n_rows, n_cols), tiles=(br, bc), flags=flags,
        value_dtype=None if value_dtype is None else jnp.float32)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=params,
        name="mx_fused_quantize",
    )(*inputs)

    row_q = col_q = None
    cpad = C.round_up(n_cols, _BLOCK)
    rpad = C.round_up(n_rows, _BLOCK)
    if row is not None:
        codes, scales = outs[0], outs[1]
        cw = cpad // 2 if row.recipe.fmt.packed else cpad
        row_q = MXArray(codes[:n_rows, :cw], scales[:n_rows, : cpad // _BLOCK], None,
                        (n_rows, n_cols), 1, row.recipe.fmt, row.recipe.sr_prescale)
        outs = outs[2:]
    if col is not None:
        codes, scales = outs[0], outs[1]
        rw = rpad // 2 if col.recipe.fmt.packed else rpad
        col_q = MXArray(codes[:rw, :n_cols], scales[: rpad // _BLOCK, :n_cols], None,
                        (n_rows, n_cols), 0, col.recipe.fmt, col.recipe.sr_prescale)
    return row_q, col_q
