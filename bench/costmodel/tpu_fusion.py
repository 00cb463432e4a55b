"""Static cycles of one TPU MX kernel with and without XLA's input fusion of its producer.

Does folding a weight's f32 -> bf16 convert into the Pallas kernel
(``allow_input_fusion``) save what the separate convert costs? `fusion_rows` compiles,
for v5e, one [2048, 8192] operand's kernel (``mxfp4_all_h16``'s fprop X recipe, H16,
blocks along sublanes, or along lanes) in four forms and gives libtpu's static LLO
estimate of every op (`tpu_kernel_cycles`, which this imports first: it sets libtpu's
profile flag, read when libtpu starts, so this runs in its own process):

- ``bf16 in``: the kernel on a bf16 parameter (what the layer runs for activations);
- ``convert + kernel``: an f32 parameter, XLA's convert, then the kernel;
- ``convert fused``: the same with ``allow_input_fusion`` on the kernel's input;
- ``f32 in``: the kernel reading the f32 parameter and rounding it to bf16 itself
  (``bf16_cast``; what the layer runs for a weight since ``operand_dtype``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bench.costmodel import tpu_kernel_cycles as tkc  # sets libtpu's profile flag, the CPU host

__all__ = ["FORMS", "SHAPE", "FusionRow", "fusion_rows", "row_line"]

SHAPE = (2048, 8192)
FORMS = ("bf16 in", "convert + kernel", "convert fused", "f32 in")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusionRow:
    """One form of the kernel at one tile: libtpu's static us per op (at the clock)."""

    lanes: bool
    rows: int
    cols: int
    form: str
    op_us: dict[str, float]

    @property
    def total_us(self) -> float:
        return sum(self.op_us.values())


def _kernel_call(x, *, op, lanes: bool, rows: int, cols: int, fuse: bool,
                 bf16_cast: bool = False):
    from mxjax.emulation import in_place_tpu as at

    if lanes:
        grid, block = (x.shape[0] // cols, x.shape[1] // rows), (cols, rows)
    else:
        grid, block = (x.shape[0] // rows, x.shape[1] // cols), (rows, cols)
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    kernel = functools.partial(at._kernel, op=op, h=16, lanes=lanes, has_signs=False,
                               has_u=False, bf16_cast=bf16_cast)
    return pl.pallas_call(
        kernel, grid=grid, in_specs=[spec], out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, jnp.bfloat16),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 2,
                                             allow_input_fusion=[fuse]))(x)


def _forms(call, f32, bf16) -> dict:
    """{form name: (function, its argument)} of the four `FORMS`."""
    return {
        "bf16 in": (lambda x: call(x, fuse=False), bf16),
        "convert + kernel": (lambda x: call(x.astype(jnp.bfloat16), fuse=False), f32),
        "convert fused": (lambda x: call(x.astype(jnp.bfloat16), fuse=True), f32),
        "f32 in": (lambda x: call(x, fuse=False, bf16_cast=True), f32),
    }


def fusion_rows(*, lanes: bool, tiles: list[tuple[int, int]] | None = None,
                clock_ghz: float = 1.548):
    """Yields a `FusionRow` per tile (default: mxjax's tiles for the shape) and form, as
    each compiles; deletes libtpu's profile directory when done."""
    from mxjax import policies
    from mxjax.emulation import in_place_tpu as at

    op = policies.get("mxfp4_all_h16").fprop.lhs
    a, k, b = (SHAPE[0], SHAPE[1], 1) if lanes else (1, SHAPE[0], SHAPE[1])
    tile_list = tiles or [at.tiles(a, k, b, 16)]
    f32, bf16 = (jax.ShapeDtypeStruct(SHAPE, d) for d in (jnp.float32, jnp.bfloat16))
    try:
        for rows, cols in tile_list:
            call = functools.partial(_kernel_call, op=op, lanes=lanes, rows=rows, cols=cols)
            for name, (fn, arg) in _forms(call, f32, bf16).items():
                ops = tkc.op_cycles(fn, (arg,), "v5e")
                yield FusionRow(lanes=lanes, rows=rows, cols=cols, form=name,
                                op_us={n: c / (clock_ghz * 1e3) for n, c in ops.items()})
    finally:
        tkc.remove_dump()


def row_line(row: FusionRow) -> str:
    """One row as the probe prints it: the total and every op's us."""
    parts = ", ".join(f"{n} {t:.1f}" for n, t in sorted(row.op_us.items()))
    return (f"{'lanes' if row.lanes else 'sublanes'} {row.rows}x{row.cols} {row.form:17s} "
            f"total {row.total_us:7.1f} us  ({parts})")
