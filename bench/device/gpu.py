"""One script for a GPU: correctness tests, then the measured tables (< 5.5 min).

Usage, from the repository root on the GPU machine:

    # The H200 image has jax 0.11.2 and triton 3.6.0 but no jax-triton: carry a wheel.
    # Here (on the CPU machine), once:  echo /.whl/ >> .git/info/exclude
    #   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    #       --implementation cp -d .whl 'jax-triton>=0.3,<0.4'
    # There (carry .whl):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
    PYTHONUNBUFFERED=1 python3 bench/device/gpu.py [--quick] [--budget-s 300] \
        [--sections tests,ceilings,layer8b,gemm] [--quick-tests] [--keep-going] \
        [--layer-policies bf16/fused,bf16/explicit,fp8,mxfp4_all_h16,...] \
        [--table-out $OUT/table.txt] [--dump-autotune autotune_h200.pbtxt]

Sections (--sections picks them, they run in this order; the table is printed last, and
after every section when --table-out is given it is rewritten there):
  tests. pytest -m gpu tests/mxjax/kernels/test_kernels_gpu.py
     tests/mxjax/emulation/test_fp8_units_gpu.py
     tests/models/test_fused_attention.py (kernels; FP8 GEMMs on the FP8 tensor cores within
     docs/NUMERICS.md's device bound, printed with -s; cuDNN flash attention against the
     explicit form); a failure stops the run unless --keep-going (then the table says so).
     --quick-tests deselects QUICK_TESTS_DESELECT (the slower half of the tests).
     Run in a subprocess before this process touches the GPU (both would preallocate).
  ceilings. Device copy bandwidth (bytes read + written) and bf16 GEMM TFLOP/s at 8192^3.
  layer8b. One Llama 3.1-8B decoder layer's train step (bench/costmodel/programs.py's `layer_8b`:
     loss and gradients w.r.t. the layer's parameters and input, micro-batch 1, seq 8192)
     under each --layer-policies row (POLICY[@BACKEND][/ATTENTION][?]; default LAYER_ROWS:
     bf16 with fused and with explicit attention, fp8, mxfp4_all_h16 with the XLA
     emulation and with every GEMM on 'xla_fp8', nvfp4 if time remains). All rows are
     compiled first (a row that cannot be built or compiled says why), then timed in
     interleaved rounds (one call per row per round, the rows' order rotating), median of
     >= 5 rounds; ms and ratio to the bf16/fused row, compile seconds, XLA's temp memory.
     A row marked '?' is compiled after those rounds, if its compile fits the deadline,
     then all rows are timed in further rounds (the table is whole before it starts).
  quantize (not in the default set). The fused Pallas kernel's GB/s (row; row+column; with
     H16), its fraction of the copy bandwidth, and mxjax.quantize under XLA.
  gemm. MXFP4 GEMM TFLOP/s at 8192^3 and the Llama-3.1-8B projection shapes (8192 tokens)
     for bf16 jnp.dot and each --gemm-backends backend (default 'xla' (the XLA emulation),
     'triton' (tl.dot_scaled), 'xla_fp8'); a backend this mxjax
     does not know, or that cannot run here, is an n/a cell. Operands are quantized
     outside the timed region.
  train. Tokens/s of a ~1B Llama train step (AdamW) under 'bf16' and 'mxfp4_all_h16', the
     latter with the XLA emulation and with the kernels ('auto' backend).
  calibration. bench/accelerator_cost.py's matmul and 1B decoder-layer programs
     (bench/costmodel/programs.py) under 'bf16' and 'mxfp4_all_h16', timed (ms per step). With
     --dump-autotune FILE, XLA writes the GEMM autotune results of every compile in this
     run to FILE (xla_gpu_dump_autotune_results_to; .pbtxt text, .pb binary); a deviceless
     compile then picks the same GEMM configs (bench/accelerator_cost.py --autotune-results
     FILE, which sets xla_gpu_load_autotune_results_from).
Time: --budget-s (default 300) is shared among the chosen measuring sections by
SECTION_WEIGHT, time a section leaves unused passing on to the later ones; a section does
not start a row (a compile, a shape, a step) it cannot expect to finish by its deadline
(from its longest row so far) and writes 'skipped (time budget)' instead. The tests, a
subprocess, are killed (a failure) at half the budget. A watchdog prints the table so far
and exits (code 3) at --hard-limit-s (default budget + 25 s) if a compile or kernel
overruns anyway. Expected on the H200 (estimates from compile counts and deviceless compile
times, not yet measured): tests ~90 s (--quick-tests ~55 s; pytest's --durations prints
the slowest), ceilings ~5 s, layer8b ~120-180 s for its six compiles (nvfp4, the last, is
the one the budget drops first), gemm what is left (each shape ~15 s).
Targets: quantize >= 80% of copy bandwidth; MXFP4 GEMM >= 1.0x bf16 at 8192^3
(1.5x through the FP8 path as the stretch); the 1B step under mxfp4_all_h16 with kernels
no slower than under bf16; the 1B step under mxfp4_all_h16 with the XLA emulation
(backend='xla': bf16 operands at DEFAULT on the GPU, docs/NUMERICS.md) at most 1.3x the bf16
step time (stretch 1.15x): the 'step time vs bf16' column.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax

from bench.device.harness import (
    DEFAULT_SECTIONS,
    FULL,
    QUICK,
    SECTIONS,
    SMOKE,
    STATE,
    Budget,
    Table,
    elapsed,
    log,
    short_error,
    start_watchdog,
)
from bench.device.sections.calibration import calibration_section
from bench.device.sections.ceilings import ceilings
from bench.device.sections.gemm import GEMM_BACKENDS, gemm_section
from bench.device.sections.gpu_tests import run_gpu_tests
from bench.device.sections.layer8b import LAYER_ROWS, layer8b_section, parse_layer_rows
from bench.device.sections.quantize import quantize_section
from bench.device.sections.train import train_section


def _add_xla_flag(flag: str) -> None:
    """Appends to XLA_FLAGS (read when the first backend starts: call before any jax use)."""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def _parse_sections(text: str) -> tuple[str, ...]:
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in SECTIONS]
    if unknown or not chosen:
        raise ValueError(f"--sections: unknown {unknown or text!r}; expected a comma-separated "
                         f"subset of {','.join(SECTIONS)}")
    return tuple(s for s in SECTIONS if s in chosen)  # always in SECTIONS' order


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="seconds for all chosen sections, shared by SECTION_WEIGHT; what "
                         "does not fit is a 'skipped (time budget)' row (default 300)")
    ap.add_argument("--hard-limit-s", type=float, default=None,
                    help="print the table and exit (code 3) at this many seconds even in the "
                         "middle of a compile (default: --budget-s + 25)")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma-separated, run in this order: {','.join(SECTIONS)} "
                         f"(default {','.join(DEFAULT_SECTIONS)})")
    ap.add_argument("--skip-tests", action="store_true",
                    help="drop 'tests' from --sections (only to re-run the table after they "
                         "passed)")
    ap.add_argument("--quick-tests", action="store_true",
                    help="the tests section deselects QUICK_TESTS_DESELECT (the slower half)")
    ap.add_argument("--keep-going", action="store_true",
                    help="measure even when the GPU tests fail (the table says they failed)")
    ap.add_argument("--layer-policies", default=LAYER_ROWS, metavar="ROWS",
                    help="layer8b rows, comma-separated POLICY[@BACKEND][/ATTENTION] "
                         "(attention fused|explicit|jax, default fused; @BACKEND sets every "
                         f"GEMM's backend); default {LAYER_ROWS}")
    ap.add_argument("--gemm-backends", default=GEMM_BACKENDS,
                    help=f"gemm section columns (default {GEMM_BACKENDS})")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="developer check on CPU: every section at toy sizes, numbers "
                         "meaningless (tests are not run)")
    ap.add_argument("--table-out", type=Path, default=None, metavar="FILE",
                    help="also write the table to FILE, rewritten after every section")
    ap.add_argument("--dump-autotune", type=Path, default=None, metavar="FILE",
                    help="write XLA's GPU autotune results to FILE (xla_gpu_dump_autotune_"
                         "results_to) for bench/accelerator_cost.py --autotune-results")
    args = ap.parse_args(argv)
    try:
        sections = _parse_sections(args.sections)
        layer_rows = parse_layer_rows(args.layer_policies) if "layer8b" in sections else []
    except ValueError as e:
        ap.error(str(e))
    gemm_backends = [b.strip() for b in args.gemm_backends.split(",") if b.strip()]
    if args.skip_tests:
        sections = tuple(s for s in sections if s != "tests")
    sz = SMOKE if args.cpu_smoke else QUICK if args.quick else FULL
    hard_limit = args.hard_limit_s if args.hard_limit_s is not None else args.budget_s + 25
    if args.dump_autotune is not None:
        args.dump_autotune = args.dump_autotune.resolve()
        args.dump_autotune.parent.mkdir(parents=True, exist_ok=True)
        _add_xla_flag(f"--xla_gpu_dump_autotune_results_to={args.dump_autotune}")

    table = Table()
    info = table.section("Device", ("what", "value"))
    run_rows = table.section("Run", ("what", "value"))
    run_rows += [("sections", ",".join(sections)),
                 ("budget", f"{args.budget_s:.0f} s (hard limit {hard_limit:.0f} s)")]
    def keep_the_table():
        doing = STATE["doing"][:80]
        run_rows.append(("stopped", f"by the watchdog at {elapsed():.0f} s, while: {doing}"))
        table.write(args.table_out)

    watchdog = start_watchdog(hard_limit, table, keeping="printing the table so far",
                              keep=keep_the_table)
    budget = Budget(args.budget_s, [s for s in sections if s != "tests"])
    if "tests" in sections:  # before this process touches the GPU
        if args.cpu_smoke:
            run_rows.append(("GPU tests", "not run (--cpu-smoke)"))
        else:
            ok, summary = run_gpu_tests(args.quick_tests, timeout_s=max(60.0, args.budget_s / 2))
            run_rows.append(("GPU tests", summary))
            log(f"GPU correctness tests: {summary}")
            if not ok and not args.keep_going:
                log("not benchmarking (--keep-going measures anyway)")
                watchdog.cancel()
                table.write(args.table_out)
                table.print()
                return 1
    if jax.default_backend() != "gpu" and not args.cpu_smoke:
        print(f"bench/device/gpu.py needs a CUDA GPU; jax.default_backend() is "
              f"{jax.default_backend()!r} (devices: {jax.devices()}). Run it on a GPU machine.",
              file=sys.stderr)
        return 2
    from mxjax.backends import capabilities

    caps = capabilities()
    log(f"jax {jax.__version__}, {caps}")
    info += [("device", caps.device_kind), ("compute capability", str(caps.compute_capability)),
             ("native FP4", str(caps.native_fp4)), ("runnable backends", ", ".join(caps.runnable)),
             ("jax", jax.__version__)]
    copy_bw = None
    for name in sections:
        if name == "tests":
            continue
        deadline = budget.start(name)
        log(f"section {name} (deadline {deadline:.0f} s)")
        try:
            if name == "ceilings":
                copy_bw = ceilings(table, sz, deadline)
            elif name == "layer8b":
                layer8b_section(table, sz, deadline, layer_rows)
            elif name == "quantize":
                quantize_section(table, copy_bw, sz, deadline)
            elif name == "gemm":
                gemm_section(table, sz, deadline, gemm_backends)
            elif name == "train":
                train_section(table, sz, deadline)
            elif name == "calibration":
                calibration_section(table, sz, deadline)
        except Exception as e:  # noqa: BLE001 - one section's failure is a row, not the run's end
            run_rows.append((f"section {name}", short_error(e)))
            log(f"section {name} failed: {short_error(e)}")
        run_rows.append((f"section {name}", f"ended at {elapsed():.0f} s"))
        table.write(args.table_out)
    if args.dump_autotune is not None:
        written = args.dump_autotune.exists()
        info.append(("autotune results", f"{args.dump_autotune}" if written else
                     f"none written to {args.dump_autotune} (no GPU autotuning on "
                     f"{jax.default_backend()})"))
    info.append(("wall time", f"{elapsed():.0f} s"))
    watchdog.cancel()
    table.write(args.table_out)
    table.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
