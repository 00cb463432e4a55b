"""Registers, occupancy and calibrated time of the one-pass operand kernels per launch.

Compiles `mxjax.routes.xla_fp4_kernel`'s MXFP4 kernel (the 'xla_fp4' route's: bf16 input,
H16 with fixed signs, round to nearest even, PTX's cvt to E2M1 where the target has it),
or with ``--codec`` the NVFP4 (H16, PTX's division) or MXFP8 (no rotation) kernel of the
same machinery, for a GPU without one, under each launch (`xla_fp4_kernel.Launch`: tile,
parts, warps, stages), and prints per kernel (the pair, and one direction along rows / columns) what
ptxas made of it (registers, spill bytes, SASS per thread), the resident blocks and
occupancy per SM, the waves of the grid and the calibrated model's time
(`bench.costmodel.calibrated.kernel_seconds`, which charges a partial last wave as a
whole one). PTX does not depend on the grid: each kernel is compiled once, at
the first shape, and the others' threads and bytes scaled from it.

    .venv-aot/bin/python bench/operand_kernel_launch.py [--targets b200,h200]
        [--shapes 8192x4096,4096x8192,8192x14336] [--launches default,128x128/r2/w8]
        [--kinds pair,row,col] [--codec mxfp4|nvfp4|nvfp4_sr|mxfp8|mxfp8_cvt]

A launch is ``ROWSxCOLS[/rN][/cN][/wN][/sN][/p0]`` (row parts, column parts, warps,
stages, bf16 read as pairs along columns; defaults 1, 1, 8, 1, 1), or
``default`` (`DEFAULT_LAUNCH`) or ``auto`` (`launch_for` the target).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = ("pair", "row", "col")


@dataclasses.dataclass(frozen=True)
class _MainLaunch:  # a tree from before `Launch`: 128-tiles
    rows: int = 128
    cols: int = 128


def parse_launch(text: str, target_cc, kind: str = "pair"):
    from mxjax.routes import xla_fp4_kernel as fp4k

    if text == "default":
        return getattr(fp4k, "DEFAULT_LAUNCH", None) or _MainLaunch()
    if text == "auto":
        try:
            return fp4k.launch_for(target_cc, directions=(1, 0) if kind == "pair" else (1,))
        except TypeError:  # a tree whose launch_for takes no directions
            return fp4k.launch_for(target_cc)
    tile, *opts = text.split("/")
    rows, cols = (int(n) for n in tile.split("x"))
    kw = {"rows": rows, "cols": cols}
    names = {"r": "row_parts", "c": "col_parts", "w": "num_warps", "s": "num_stages",
             "p": "col_pairs"}
    for o in opts:
        kw[names[o[0]]] = bool(int(o[1:])) if o[0] == "p" else int(o[1:])
    return fp4k.Launch(**kw)


def _fn(kind: str, launch, e2m1_cvt: bool, codec: str):
    import mxjax
    from mxjax import policies
    from mxjax.routes import xla_fp4_kernel as fp4k

    signs = mxjax.fixed_signs(0, 16)
    if codec == "mxfp4":
        op = policies.get("mxfp4_all_h16").fprop.lhs
        kw = {"hadamard_size": 16, "signs": signs, "e2m1_cvt": e2m1_cvt}
        one, pair = fp4k.mxfp4_operand, fp4k.mxfp4_operand_pair
    elif codec in ("nvfp4", "nvfp4_sr"):
        import jax

        from mxjax.routes import xla_nvfp4_kernel as k

        op = policies.get("nvfp4").fprop.rhs
        kw = {"hadamard_size": 16, "signs": signs, "compiled": True}
        one, pair = k.nvfp4_operand, k.nvfp4_operand_pair
        if codec == "nvfp4_sr":  # dY's: stochastic rounding drawn in the kernel (no pair)
            op = policies.get("nvfp4").wgrad.lhs
            one = functools.partial(one, key=jax.random.key(0))
    else:
        from mxjax.routes import xla_mxfp8_kernel as k

        op = policies.get("mxfp8").fprop.lhs
        kw = {"hadamard_size": None, "signs": None}
        if codec == "mxfp8_cvt":
            kw["f8_cvt"] = True
        one, pair = k.mxfp8_operand, k.mxfp8_operand_pair
    if hasattr(fp4k, "Launch"):  # (a tree from before `Launch` takes none: "default")
        kw["launch"] = launch

    def fn(x):
        if kind == "pair":
            return pair(x, op, **kw)
        return one(x, 1 if kind == "row" else 0, op, **kw)

    return fn


def measure(target_name: str, kind: str, launch, shape, codec: str = "mxfp4"):
    """(hk.Kernel, calibrated.TritonKernel) of the kernel's compile for the target."""
    import jax
    import jax.numpy as jnp

    from bench.costmodel import aot, calibrated, ptx_cost
    from bench.costmodel import hlo_kernels as hk
    from mxjax.chips import compute_capability_of
    from mxjax.routes.xla_fp4_kernel import has_e2m1_cvt

    target = aot.TARGETS[target_name]
    cvt = has_e2m1_cvt(compute_capability_of(target.description))
    dump = Path(tempfile.mkdtemp(prefix="operand_launch_"))
    compiled = aot.compile_for(_fn(kind, launch, cvt, codec),
                               (jax.ShapeDtypeStruct(shape, jnp.bfloat16),), target,
                               ptx_cost.dump_options(dump))
    text = compiled.as_text()
    counts = calibrated.counts_from_dump(text, dump)
    (name, tk), = counts.triton.items()
    (k,) = [k for k in hk.kernels(text) if k.name == name]
    return k, tk


def scaled(k, tk, launch, base, shape):
    """The kernel at another shape: threads from its grid, bytes by its elements."""
    grid = math.ceil(shape[0] / launch.rows) * math.ceil(shape[1] / launch.cols)
    f = shape[0] * shape[1] / (base[0] * base[1])
    k = dataclasses.replace(k, bytes_read=round(k.bytes_read * f),
                            bytes_written=round(k.bytes_written * f))
    return k, dataclasses.replace(tk, threads=grid * tk.block_threads)


def row(target_name, kind, launch_text, k, tk, shape) -> str:
    from bench.costmodel import calibrated

    rates = calibrated.rates_for(target_name)
    lim = rates.limits
    occ = calibrated.occupancy(tk, lim)
    blocks = calibrated.blocks_per_core(tk, lim)
    grid = tk.threads // tk.block_threads
    t = calibrated.kernel_seconds(k, counts_of(k, tk), rates)
    bytes_us = k.bytes / rates.copy_bytes_per_s * 1e6
    return (f"{target_name:5s} {launch_text:18s} {kind:4s} {shape[0]:5d}x{shape[1]:<5d} "
            f"regs {tk.registers:3d} spill {tk.spill_bytes:4d} SASS {tk.sass:5d} "
            f"blk/SM {blocks:2d} occ {occ:5.1%} waves {grid / (blocks * lim.cores):5.2f} "
            f"bytes {bytes_us:6.1f} us  calibrated {t * 1e6:7.1f} us")


def counts_of(k, tk):
    from bench.costmodel import calibrated

    return calibrated.Counts(fusion_instructions={}, triton={k.name: tk})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="b200,h200")
    ap.add_argument("--shapes", default="8192x4096,4096x8192,8192x14336")
    ap.add_argument("--launches", default="default,auto")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--codec", default="mxfp4",
                    choices=("mxfp4", "nvfp4", "nvfp4_sr", "mxfp8", "mxfp8_cvt"),
                    help="the kernel: 'xla_fp4's (default), 'xla_nvfp4's (nvfp4_sr: dY's, "
                         "stochastic rounding drawn inside; row and col only) or "
                         "'xla_mxfp8's (mxfp8_cvt: with PTX's FP8 cvt)")
    args = ap.parse_args(argv)
    from bench.costmodel import aot

    aot.use_cpu_host()
    from mxjax.chips import compute_capability_of

    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    for target_name in args.targets.split(","):
        cc = compute_capability_of(aot.TARGETS[target_name].description)
        for text in args.launches.split(","):
            for kind in args.kinds.split(","):
                launch = parse_launch(text, cc, kind)
                try:
                    k, tk = measure(target_name, kind, launch, shapes[0], args.codec)
                except Exception as e:  # noqa: BLE001 - a launch Triton refuses: say so
                    print(f"{target_name:5s} {text:18s} {kind:4s} failed: "
                          f"{type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                for shape in shapes:
                    print(row(target_name, kind, text,
                              *scaled(k, tk, launch, shapes[0], shape), shape), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
