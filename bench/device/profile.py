"""The device profile in one command: GEMM rates, the 8B layer per policy, its kernels.

Usage, from the repository root on a GPU machine (H100, H200, B200; < 8 minutes):

    PYTHONUNBUFFERED=1 python3 bench/device/profile.py [--budget-s 420] [--tests]
    make bench-gpu                      # the same, with --tests
    python3 bench/device/profile.py --dry-run   # on a CPU: tiny shapes, a temp dir

Sections, in issue 50's order, each within its share of --budget-s (time a section leaves
unused passes on; a row that cannot finish by its deadline is 'skipped (time budget)'):

1. gemms: TFLOP/s at 8192^3 and the Llama 3.1-8B projection shapes: bf16, FP8
   E4M3xE4M3 and E5M2xE4M3 at precision DEFAULT and HIGHEST, each under cuBLASLt and
   Triton GEMMs; on Blackwell also block-scaled MXFP8, NVFP4 and MXFP4 ('xla_fp4')
   (bench/device/sections/gemm_rates.py);
2. copy bandwidth and launch overhead (bench/device/sections/device_rates.py);
3. the 8B layer's train step at seq 8192 under each --policies row, timed in rounds
   interleaved with bf16 (median after warm-up, ratio to bf16), then profiled with
   jax.profiler: device time per kernel class beside the cost model's estimate
   (bench/device/sections/layer_profile.py, bench/device/trace.py, bench/device/estimate.py);
4. with --tests: the -m gpu tests (bench/device/sections/gpu_tests.py) within
   --tests-budget-s, in a subprocess that gets part of the GPU's memory.

--sections picks among 1-3 (e.g. 'layers' alone to measure the layer again after a fix).
It writes the measurement file for the calibrated cost model (schema 1,
bench/device/measurements_file.py) to --out-dir as <chip>-<date>[-<tag>].json after every
section, and prints a short table last. A watchdog writes the file, prints the table and
exits (code 3) at --hard-limit-s (default budget + 30 s) if a compile or kernel overruns.
Exit codes: 0 done; 1 the GPU tests failed; 2 bad arguments or no GPU; 3 the watchdog.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import tempfile
import threading
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    if "--tests" in sys.argv:  # before jax starts: leave the tests' subprocess room
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import jax

from bench.device import estimate, measurements_file
from bench.device.harness import ROOT, Table, elapsed, log, short_error, start_watchdog
from bench.device.sections.device_rates import device_rates_section
from bench.device.sections.gemm_rates import gemm_rates_section
from bench.device.sections.gpu_tests import run_gpu_tests
from bench.device.sections.layer8b import LayerRow, parse_layer_rows
from bench.device.sections.layer_profile import PROFILED_CALLS, layer_profile_section

POLICIES = "bf16,fp8,mxfp4_all_h16@auto,nvfp4@auto,mxfp8@auto"
OUT_DIR = ROOT / "bench" / "costmodel" / "calibration"
# Shares of the measuring budget (what is left when a section starts, over the shares left).
SECTIONS = ("gemms", "rates", "layers")
SHARES = {"gemms": 30, "rates": 3, "layers": 50, "profile": 17}
TESTS_MEM_FRACTION = "0.4"


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds for the measuring sections (default 420; the tests have "
                         "their own --tests-budget-s)")
    ap.add_argument("--hard-limit-s", type=float, default=None,
                    help="write, print and exit (3) at this many seconds even mid-compile "
                         "(default: budget + tests budget + 30)")
    ap.add_argument("--policies", default=POLICIES,
                    help=f"layer rows, POLICY[@BACKEND][/ATTENTION], comma-separated; the "
                         f"bf16 row, the baseline, is added if missing (default {POLICIES})")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated, run in this order: {','.join(SECTIONS)} (default "
                         "all; e.g. 'layers' to measure the layer again after a fix)")
    ap.add_argument("--tests", action="store_true", help="run the -m gpu tests last")
    ap.add_argument("--tests-budget-s", type=float, default=150.0,
                    help="the tests' time limit (default 150)")
    ap.add_argument("--quick-tests", action="store_true",
                    help="the tests' quick subset (bench/device/sections/gpu_tests.py)")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help=f"where the measurement file goes (default {OUT_DIR.relative_to(ROOT)}"
                         "; with --dry-run a new temporary directory)")
    ap.add_argument("--tag", default="", help="file name suffix: <chip>-<date>-<tag>.json")
    ap.add_argument("--dry-run", action="store_true",
                    help="on a CPU: every section at tiny shapes, numbers meaningless, "
                         "the file written to a temporary directory (no GPU tests)")
    args = ap.parse_args(argv)
    try:
        rows = parse_layer_rows(args.policies)
    except ValueError as e:
        ap.error(str(e).replace("--layer-policies", "--policies"))
    chosen = [t.strip() for t in args.sections.split(",") if t.strip()]
    if not chosen or set(chosen) - set(SECTIONS):
        ap.error(f"--sections: expected a comma-separated subset of {','.join(SECTIONS)}, got "
                 f"{args.sections!r}")
    args.sections = tuple(x for x in SECTIONS if x in chosen)
    if not any(r.is_baseline for r in rows):  # every ratio is to bf16, timed alongside
        rows.insert(0, LayerRow(policy="bf16", backend=None, attention="fused"))
    if args.budget_s <= 0 or args.tests_budget_s <= 0:
        ap.error("--budget-s and --tests-budget-s: expected a positive number of seconds")
    if args.tag and not args.tag.replace("_", "").replace(".", "").isalnum():
        ap.error(f"--tag: expected letters, digits, '_' or '.', got {args.tag!r}")
    return args, rows


class Run:
    """What the run measured so far: the measurement file's document."""

    def __init__(self, *, chip: str, device: str, command: str, out_dir: Path, tag: str):
        self.out_dir, self.tag = out_dir, tag
        self.doc = {"schema": measurements_file.SCHEMA, "chip": chip,
                    "provenance": measurements_file.provenance(
                        command=command, device=device, jax_version=jax.__version__,
                        root=ROOT),
                    "gemms": [], "copy_bandwidth_gbs": None, "launch_overhead_us": None,
                    "layers": [], "kernels": []}
        self.path: Path | None = None
        self.lock = threading.Lock()

    def save(self) -> Path:
        with self.lock:
            self.path = measurements_file.write(self.doc, self.out_dir, self.tag)
            return self.path


def _chip(device_kind: str, dry_run: bool) -> str:
    if dry_run:
        return jax.default_backend()  # 'cpu'
    return estimate.chip_name(device_kind) or "".join(
        c for c in device_kind.lower().replace(" ", "_") if c.isalnum() or c == "_") or "gpu"


def main(argv=None) -> int:
    args, rows = _args(argv)
    if not args.dry_run and jax.default_backend() != "gpu":
        print(f"bench/device/profile.py needs a CUDA GPU; jax.default_backend() is "
              f"{jax.default_backend()!r} (devices: {jax.devices()}). Run it on a GPU machine, "
              "or pass --dry-run to check it on this one.", file=sys.stderr)
        return 2
    device = jax.devices()[0]
    kind = device.device_kind
    cc = getattr(device, "compute_capability", None)
    cc = tuple(int(x) for x in str(cc).split(".")) if cc else None
    out_dir = args.out_dir or (Path(tempfile.mkdtemp(prefix="mxjax-dry-run-")) if args.dry_run
                               else OUT_DIR)
    chip = _chip(kind, args.dry_run)
    command = "python3 bench/device/profile.py " + shlex.join(argv if argv is not None
                                                               else sys.argv[1:])
    run = Run(chip=chip, device=f"{kind} (compute capability {cc})" if cc else kind,
              command=command.strip(), out_dir=out_dir, tag=args.tag)
    table = Table()
    info = table.section("Run", ("what", "value"))
    info += [("device", run.doc["provenance"]["device"]), ("jax", jax.__version__),
             ("chip (cost model)", chip), ("budget", f"{args.budget_s:.0f} s")]
    tests_s = args.tests_budget_s if args.tests and not args.dry_run else 0.0
    hard = args.hard_limit_s or args.budget_s + tests_s + 30.0
    watchdog = start_watchdog(
        hard, table, keeping="writing what was measured",
        keep=lambda: print(f"measurements: {run.save()}", flush=True))
    log(f"device profile: {run.doc['provenance']['device']}, jax {jax.__version__}, "
        f"chip {chip!r}, budget {args.budget_s:.0f} s, hard limit {hard:.0f} s")
    try:
        code = _measure(args, rows, run, table, info, cc)
    finally:
        watchdog.cancel()
    info.append(("measurements", str(run.path)))
    info.append(("wall time", f"{elapsed():.0f} s"))
    table.print()
    return code


def _measure(args, rows, run: Run, table: Table, info: list, cc) -> int:
    """The sections in order, the file saved after each; the exit code."""
    pending = {k: v for k, v in SHARES.items()
               if k in args.sections or (k == "profile" and "layers" in args.sections)}

    def deadline(name: str) -> float:
        share = pending[name] / sum(pending.values())
        del pending[name]
        return elapsed() + max(0.0, args.budget_s - elapsed()) * share

    def section(name: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one section's failure is a row, not the end
            info.append((f"section {name}", short_error(e)))
            log(f"section {name} failed: {short_error(e)}")
        run.save()

    tiny = args.dry_run

    def gemms():
        run.doc["gemms"] = [dataclasses.asdict(g) for g in gemm_rates_section(
            table, deadline=deadline("gemms"), shape_div=64 if tiny else 1,
            shapes=2 if tiny else 5, compute_capability=cc, dry_run=tiny)]

    def rates():
        deadline("rates")
        bw, launch = device_rates_section(table, copy_elements=1 << 16 if tiny else 1 << 28)
        run.doc["copy_bandwidth_gbs"], run.doc["launch_overhead_us"] = bw, launch

    def layers():
        size, seq, program = ("tiny", 64, "layer_tiny") if tiny else ("llama3_8b", 8192,
                                                                      "layer_8b")
        results = layer_profile_section(
            table, rows, size=size, seq=seq, program=program, chip=run.doc["chip"],
            deadline=deadline("layers"), profile_deadline=lambda: deadline("profile"))
        run.doc["layers"] = [{"program": r.program, "seq": r.seq, "policy": r.row.label,
                              "ms": r.ms} for r in results if r.ms]
        run.doc["kernels"] = [{"policy": r.row.label, "class": k.kernel_class, "name": k.name,
                               "count": k.count, "total_us": k.total_us}
                              for r in results for k in r.kernels if k.total_us > 0]
        info.append(("kernels", f"count and total_us over {PROFILED_CALLS} profiled calls"))

    for name, fn in (("gemms", gemms), ("rates", rates), ("layers", layers)):
        if name in args.sections:
            section(name, fn)
    if not args.tests:
        return 0
    if args.dry_run:
        info.append(("GPU tests", "not run (--dry-run)"))
        return 0
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = TESTS_MEM_FRACTION  # the child's share
    ok, summary = run_gpu_tests(args.quick_tests, timeout_s=args.tests_budget_s)
    info.append(("GPU tests", summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
