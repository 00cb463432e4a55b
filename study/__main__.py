"""Command line: ``python -m study --config configs/ladder_tiny.yaml [--set key=value]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from study import config as SC
from study.runner import check_backends, run_study
from train.config import ConfigError
from train.plan import check_out_dir


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m study",
        description="The MXFP4 ladder study: fixed-budget runs, branch-and-compare "
                    "efficiency with 95% intervals, ablations and scale trend (study/).",
        epilog=SC.describe(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="study YAML (e.g. configs/ladder_tiny.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key, e.g. seeds=[0,1] or branch.steps=12")
    p.add_argument("--out", help="output directory (default: out_dir, else runs/<name>)")
    p.add_argument("--report-only", action="store_true",
                   help="do not train; rewrite the report from the records on disk")
    p.add_argument("--quiet", action="store_true", help="less output")
    a = p.parse_args(argv)
    sets = list(a.set) + ([f"out_dir={a.out}"] if a.out else [])
    try:
        cfg = SC.load(a.config, sets)
        check_out_dir(cfg.out_path)
        if not a.report_only:
            check_backends(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if a.report_only:
        from study import report

        report.write_report(cfg)
    else:
        run_study(cfg, verbose=not a.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
