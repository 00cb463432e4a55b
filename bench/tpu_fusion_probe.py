"""Static cycles of one TPU MX kernel with and without XLA's input fusion of its producer.

Does folding a weight's f32 -> bf16 convert into the Pallas kernel save what the
separate convert costs? Prints libtpu's static estimate of every op (us at
``--clock-ghz``) of one [2048, 8192] operand's kernel for v5e in four forms
(`bench.costmodel.tpu_fusion` says which).

    python bench/tpu_fusion_probe.py [--lanes] [--tiles 256x512,256x1024]

Needs libtpu (``pip install 'mxjax[aot-tpu]'``); the flag that makes libtpu write
the profile is read when it starts, so this runs in its own process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.costmodel import tpu_fusion  # sets libtpu's profile flag


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", action="store_true", help="blocks along lanes (dgrad's W)")
    ap.add_argument("--tiles", default="", help="rows x cols list (default: mxjax's tiles)")
    ap.add_argument("--clock-ghz", type=float, default=1.548,
                    help="v5e clock for us (bench/costmodel/tpu_kernel_cycles.py calibrates 1.548)")
    args = ap.parse_args(argv)
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",") if t]
    for row in tpu_fusion.fusion_rows(lanes=args.lanes, tiles=tiles, clock_ghz=args.clock_ghz):
        print(tpu_fusion.row_line(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
