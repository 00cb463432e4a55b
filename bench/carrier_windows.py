"""How often the MXFP4 routes' exact carriers hold a training run's GEMM operands.

Trains the tiny Llama (configs/tiny.yaml) under a policy on this CPU and, every
``--every`` steps, observes every GEMM of one train step: the span of each quantized
operand's block scales per GEMM kind and side, and the share of GEMMs each route would
carry (`bench.training.carrier_windows` says which spans each carrier holds).

    .venv/bin/python bench/carrier_windows.py [--policy mxfp4_all_h16] [--steps 200]
        [--every 50]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.training import carrier_windows as cw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="mxfp4_all_h16")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    spans = cw.observe_spans(args.policy, args.steps, args.every, args.seed)
    for line in cw.report_lines(spans, args.policy, args.steps, args.every):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
