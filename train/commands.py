"""The subcommands of ``python -m train``: ``export-hf`` and ``mlperf-check``.

Each is its own program with its own ``--help`` and exit codes; ``train.__main__``
hands ``python -m train <subcommand> ...`` to `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable, Sequence

_EXPORT_EPILOG = """\
writes into OUT_DIR: config.json (the run's LlamaConfig, RoPE scaling included),
generation_config.json, model.safetensors (or model-0000k-of-0000n.safetensors
shards + model.safetensors.index.json above 5 GiB), and the run's tokenizer:
tokenizer.json (the byte-level BPE the run trained, or the HF tokenizer.json it
was given) with a tokenizer_config.json, when the run's prepared data is still
in its data.cache_dir. Load it with transformers:
  AutoModelForCausalLM.from_pretrained(OUT_DIR); AutoTokenizer.from_pretrained(OUT_DIR)
or start a run from it: --set model.init_from=OUT_DIR.

exit codes:
  0  written
  2  bad arguments: no such run, no checkpoint of --step, OUT_DIR not empty
     (without --force) or a file
  4  the checkpoint is unreadable or damaged
  6  a file could not be written or read
"""

_CHECK_EPILOG = """\
A run whose mllog.txt names an MLPerf benchmark of the ruleset (the llama31_8b
preset, configs/llama3_8b_mlperf.yaml) is checked against every rule, as
  python -m mlperf_logging.compliance_checker --usage training --ruleset 6.1.0 RUN_DIR/mllog.txt
does. Any other run (configs/tiny.yaml logs submission_benchmark 'tiny', for
which the checker has no rules file) is checked as llama31_8b: the log's
structure, record order and required records must pass; the benchmark's own
hyper-parameter rules (sequence length 8192, eval samples 1024, max steps,
target 3.3, ...) are listed as differences, which a CPU config has by design:
such a log is no MLPerf submission.

exit codes:
  0  the log passes (for a non-benchmark run: everything but the listed differences)
  2  bad arguments: no RUN_DIR/mllog.txt, unknown ruleset
  3  the log fails the rules (the failures are listed)
"""


def export_hf_main(argv: Sequence[str]) -> int:
    """``python -m train export-hf RUN_DIR OUT_DIR [--step N] [--dtype D] [--force]``."""
    ap = argparse.ArgumentParser(
        prog="python -m train export-hf",
        description="Write a run's checkpoint as a Hugging Face Llama directory.",
        epilog=_EXPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", metavar="RUN_DIR", help="the run's output directory (--out)")
    ap.add_argument("out_dir", metavar="OUT_DIR", help="where to write the HF checkpoint")
    ap.add_argument("--step", type=int, help="the checkpoint step (default: the latest)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="weights' dtype on disk (default float32, the master weights)")
    ap.add_argument("--force", action="store_true",
                    help="write into a non-empty OUT_DIR, replacing the HF checkpoint in it")
    args = ap.parse_args(argv)
    from train.checkpoint import CheckpointError
    from train.hf import ExportError, export_run

    try:
        res = export_run(args.run_dir, args.out_dir, step=args.step, force=args.force,
                         dtype=args.dtype)
    except ExportError as e:
        print(f"export-hf: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"export-hf: checkpoint error: {e}", file=sys.stderr)
        return 4
    except OSError as e:
        print(f"export-hf: I/O error: {e}", file=sys.stderr)
        return 6
    print(f"exported checkpoint step {res.step} of {args.run_dir} to {res.out_dir} "
          f"({len(res.files)} files)")
    print(res.tokenizer)
    return 0


def mlperf_check_main(argv: Sequence[str]) -> int:
    """``python -m train mlperf-check RUN_DIR [--ruleset R]``."""
    from train.output import mlperf

    ap = argparse.ArgumentParser(
        prog="python -m train mlperf-check",
        description="Check a run's mllog.txt with MLCommons' compliance checker.",
        epilog=_CHECK_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", metavar="RUN_DIR",
                    help="the run's output directory (or its mllog.txt)")
    ap.add_argument("--ruleset", default=mlperf.RULESET,
                    help=f"MLPerf Training ruleset (default {mlperf.RULESET})")
    args = ap.parse_args(argv)
    from pathlib import Path

    path = Path(args.run_dir)
    if path.is_dir():
        path = path / "mllog.txt"
    logging.disable(logging.WARNING)  # the checker logs every failure, context dumps included
    try:
        chk = mlperf.check_run_log(path, ruleset=args.ruleset)
    except (FileNotFoundError, ValueError) as e:
        print(f"mlperf-check: {e}", file=sys.stderr)
        return 2
    finally:
        logging.disable(logging.NOTSET)
    logged: dict[str, list] = {}
    for r in mlperf.read_records(chk.path):
        logged.setdefault(r.get("key"), []).append(r.get("value"))

    def brief(key: str, msg: str) -> str:
        """One line: the logged value(s) and the rule (the checker's message has dumps)."""
        m = re.search(r"failed test:\s*(.+)|Failed checks for \w+ :\s*(.+)", msg)
        rule = (m.group(1) or m.group(2)).strip() if m else msg.strip().splitlines()[0]
        vals = logged.get(key)
        shown = "" if not vals else f"logged {vals[0]!r}" if len(vals) == 1 else \
            f"logged {len(vals)} values, {min(vals)!r} to {max(vals)!r}"
        return f"{key}: {shown}; rule: {rule}" if shown else f"{key}: {rule}"
    what = (f"benchmark {chk.benchmark!r}" if chk.is_benchmark else
            f"benchmark {chk.benchmark!r} is no MLPerf benchmark: checked as "
            f"{chk.checked_as} ({chk.division or 'closed'} division)")
    print(f"{chk.path}: MLPerf Training {chk.ruleset}, {what}")
    rest = {k: v for k, v in chk.result.failures.items() if k not in chk.benchmark_differences}
    for k, v in rest.items():
        print(f"  FAILED {brief(k, v)}")
    for k, v in chk.result.warnings.items():
        print(f"  warning {k}: {v}")
    if chk.benchmark_differences:
        print(f"{chk.checked_as} rules this run does not meet (its config is not the benchmark's;"
              " expected, and why this log is no submission):")
        for k, v in chk.benchmark_differences.items():
            print(f"  {brief(k, v)}")
    scope = ("every rule" if chk.is_benchmark
             else "log structure, record order and required records")
    print(f"{'PASSED' if chk.passed else 'FAILED'} ({scope})")
    return 0 if chk.passed else 3


SUBCOMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "export-hf": export_hf_main,
    "mlperf-check": mlperf_check_main,
}
