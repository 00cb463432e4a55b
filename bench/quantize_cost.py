"""Cost of the GPU form's quantize passes on one operand, from a deviceless compile.

Prints, per kernel, the bytes it moves, its HLO elementwise ops and the PTX and SASS
instructions its threads execute, then the totals per input element and a roofline
estimate (`bench.costmodel.quantize_cost` says how each is counted).

    .venv-aot/bin/python bench/quantize_cost.py [--shape 8192,14336] [--axis 1]
        [--out f8|f4|bf16] [--kernel [--pair] [--no-e2m1-cvt]] [--no-barrier]
        [--target h200|b200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.costmodel import quantize_cost as qc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8192,14336")
    ap.add_argument("--axis", type=int, default=1, help="the contraction axis")
    ap.add_argument("--out", choices=qc.OUTS, default="f8",
                    help="f8: the 'xla_fp8' lhs carrier; f4: the 'xla_fp4' operand "
                         "(E2M1 + E4M3 scales, [F, K]); bf16: the emulation's values")
    ap.add_argument("--target", default="h200")
    ap.add_argument("--no-barrier", action="store_true", help="recompute=False")
    ap.add_argument("--kernel", action="store_true",
                    help="--out f4 by the one-pass kernel (mxjax.routes.xla_fp4_kernel)")
    ap.add_argument("--pair", action="store_true",
                    help="with --kernel: both directions in one kernel (the route's pairs)")
    ap.add_argument("--no-e2m1-cvt", action="store_true",
                    help="with --kernel: round by integer arithmetic even where the target "
                         "has PTX's cvt to E2M1 (the route uses the cvt there)")
    args = ap.parse_args(argv)
    case = qc.QuantizeCase(shape=tuple(int(s) for s in args.shape.split(",")), axis=args.axis,
                           out=args.out, target=args.target, barrier=not args.no_barrier,
                           kernel=args.kernel, pair=args.pair, e2m1_cvt=not args.no_e2m1_cvt)
    costs = qc.kernel_costs(case, qc.dump_dir())
    n = case.shape[0] * case.shape[1]
    for k in costs:
        print(qc.kernel_line(k, n))
    print(qc.total_line(case, costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
