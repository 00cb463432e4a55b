"""Static cycles of one TPU MX kernel with and without XLA's input fusion of its producer.

The question it answers: does folding a weight's f32 -> bf16 convert into the Pallas
kernel (``allow_input_fusion``) save what the separate convert costs? It compiles, for
v5e, one [2048, 8192] operand's kernel (``mxfp4_all_h16``'s fprop X recipe, H16, blocks
along sublanes; ``--lanes`` for blocks along lanes) in four forms and prints libtpu's
static LLO estimate of every op (us at ``--clock-ghz``):

- ``bf16 in``: the kernel on a bf16 parameter (what the layer runs for activations);
- ``convert + kernel``: an f32 parameter, XLA's convert, then the kernel;
- ``convert fused``: the same with ``allow_input_fusion`` on the kernel's input;
- ``f32 in``: the kernel reading the f32 parameter and rounding it to bf16 itself
  (``bf16_cast``; what the layer runs for a weight since ``operand_dtype``).

    python bench/tpu_fusion_probe.py [--lanes] [--tiles 256x512,256x1024]

Needs libtpu (``pip install 'mxjax[aot-tpu]'``); the flag that makes libtpu write
the profile is read when it starts, so this runs in its own process.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bench.costmodel import tpu_kernel_cycles as tkc  # sets libtpu's profile flag, the CPU host


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
    """{form name: (function, its argument)} of the four forms in the docstring."""
    return {
        "bf16 in": (lambda x: call(x, fuse=False), bf16),
        "convert + kernel": (lambda x: call(x.astype(jnp.bfloat16), fuse=False), f32),
        "convert fused": (lambda x: call(x.astype(jnp.bfloat16), fuse=True), f32),
        "f32 in": (lambda x: call(x, fuse=False, bf16_cast=True), f32),
    }


def main(argv=None) -> int:
    from mxjax import policies

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", action="store_true", help="blocks along lanes (dgrad's W)")
    ap.add_argument("--tiles", default="", help="rows x cols list (default: mxjax's tiles)")
    ap.add_argument("--clock-ghz", type=float, default=1.548,
                    help="v5e clock for us (bench/costmodel/tpu_kernel_cycles.py calibrates 1.548)")
    args = ap.parse_args(argv)
    from mxjax.emulation import in_place_tpu as at

    op = policies.get("mxfp4_all_h16").fprop.lhs
    shape = (2048, 8192)
    a, k, b = (shape[0], shape[1], 1) if args.lanes else (1, shape[0], shape[1])
    tile_list = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",") if t]
    tile_list = tile_list or [at.tiles(a, k, b, 16)]
    f32, bf16 = (jax.ShapeDtypeStruct(shape, d) for d in (jnp.float32, jnp.bfloat16))
    try:
        for rows, cols in tile_list:
            call = functools.partial(_kernel_call, op=op, lanes=args.lanes, rows=rows,
                                     cols=cols)
            for name, (fn, arg) in _forms(call, f32, bf16).items():
                ops = tkc.op_cycles(fn, (arg,), "v5e")
                us = {n: c / (args.clock_ghz * 1e3) for n, c in ops.items()}
                parts = ", ".join(f"{n} {t:.1f}" for n, t in sorted(us.items()))
                print(f"{'lanes' if args.lanes else 'sublanes'} {rows}x{cols} {name:17s} "
                      f"total {sum(us.values()):7.1f} us  ({parts})", flush=True)
    finally:
        tkc.remove_dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
