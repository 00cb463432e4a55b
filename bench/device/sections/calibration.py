"""The calibration section: the cost model's matmul and 1B layer programs, timed."""

from __future__ import annotations

import time

import jax

from bench.device.harness import SKIPPED, Pace, Sizes, Table, log, short_error, timeit

CALIBRATION_POLICIES = ("bf16", "mxfp4_all_h16")


def calibration_section(table: Table, sz: Sizes, deadline: float) -> None:
    """Times bench/costmodel/programs.py's matmul and layer steps (the deviceless
    estimates' programs)."""
    from bench.costmodel import programs

    rows = table.section("accelerator_cost programs, measured (calibrates the deviceless "
                         "roofline)", ("program", "policy", "ms/step", "vs bf16"))
    pace = Pace(deadline)
    size = {"matmul_size": sz.gemm_ceiling // 2, "seq": sz.train[1]} if sz.tiny_model else {}
    for prog in programs.PROGRAMS:
        base = None
        for name in CALIBRATION_POLICIES:
            if not pace.ok():
                rows.append((prog, name, SKIPPED, ""))
                continue
            t0 = time.perf_counter()
            try:
                fn, args = programs.program(prog, name, **size)
                args = programs.concrete_args(args)
                t = timeit(jax.jit(fn), *args, iters=5, warmup=2)
                del args
                base = t if name == "bf16" else base
                rows.append((prog, name, f"{t * 1e3:8.3f}", f"{t / base:5.2f}x" if base else ""))
                log(f"calibration {prog} {name}: {t * 1e3:.3f} ms")
            except Exception as e:  # noqa: BLE001 - reported in the table
                rows.append((prog, name, short_error(e), ""))
            pace.took(time.perf_counter() - t0)
