"""What GPU and TPU compilers make of the emulated GEMMs, from deviceless compiles on this CPU.

For each target (``--targets``: h100, h200, v5e, v6e, cpu; b200 too) and program
(``--programs``: ``matmul``, value_and_grad of one 4096^3 bf16 matmul; ``layer``,
the Llama-3.2-1B decoder layer's train step, batch 1 x seq 2048; ``layer_8b``; on request
``wrapped_mlp``, a Flax MLP under ``mxjax.nn.wrap``: bench/costmodel/programs.py) under
``bf16`` and every MXFP4/NVFP4/FP8 preset, prints one row per compile
(`bench.costmodel.accelerator_cost.Cost`), each metric also as a ratio to ``bf16`` compiled
in the same run, then the rates roofline's table, the assumptions, and the verdicts against
the targets of bench/costmodel/targets.py.

    pip install -e '.[train,aot-tpu,aot-gpu]'   # libtpu and the CUDA PJRT plugin (~1.1 GB)
    python bench/accelerator_cost.py                          # everything (~1 h on 2 cores)
    python bench/accelerator_cost.py --targets h200,v5e --programs matmul \\
        --policies bf16,mxfp4_all_h16

Each GPU target is compiled twice: with XLA's default Triton GEMMs and with cuBLAS (row
``<gpu>/cublas``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not os.environ.get("PYTHONPATH") and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # with PYTHONPATH set, that checkout's mxjax (a before table)

from bench.costmodel import accelerator_cost as ac
from bench.costmodel import aot, calibrated
from bench.costmodel import rates as R
from bench.costmodel.programs import EXTRA_PROGRAMS, LAYER_8B_SEQ, PROGRAMS
from bench.costmodel.targets import calibrated_verdict, emulation_verdict, fp8_layer_verdict

aot.use_cpu_host()  # before jax picks its platform

import jax

DEFAULT_TARGETS = ("h100", "h200", "v5e", "v6e", "cpu")


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _blocks(costs: list[ac.Cost], charged=lambda c: True
            ) -> dict[tuple[str, str], list[ac.Cost]]:
    """The `charged` costs grouped by (target row, program), in first-seen order."""
    groups: dict[tuple[str, str], list[ac.Cost]] = {}
    for c in costs:
        if charged(c):
            groups.setdefault((c.row_target, c.row_program), []).append(c)
    return groups


def _aligned(title: str, rows: list[tuple[str, ...]]) -> list[str]:
    """`title`, then `rows` in left-aligned columns with a rule under the first (the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [title]
    for j, r in enumerate(rows):
        lines.append("  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)))
        if j == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return lines


def table(costs: list[ac.Cost]) -> list[str]:
    """One block per (target row, program): a row per policy with ratios to bf16."""
    header = ("policy", "kernels (fus/gemm/cc/copy)", "GB", "x", "temp GB", "x", "opt ms", "x",
              "roofline ms", "x", "+alu ms", "x")
    lines: list[str] = []
    for (row_target, prog), group in _blocks(costs).items():
        base = next((c for c in group if c.policy == "bf16"), None)
        rows = [header]
        for c in group:
            k = c.kernels
            rows.append((
                c.policy,
                f"{c.n_kernels} ({k['fusion']}/{k['gemm']}/{k['custom-call']}/{k['copy']})",
                _gb(c.bytes), _ratio(c.bytes, base and base.bytes),
                _gb(c.temp), _ratio(c.temp, base and base.temp),
                _ms(c.optimal_s), _ratio(c.optimal_s, base and base.optimal_s),
                _ms(c.roofline_s or None), _ratio(c.roofline_s, base and base.roofline_s),
                _ms(c.roofline_alu_s or None),
                _ratio(c.roofline_alu_s, base and base.roofline_alu_s)))
        lines += _aligned(f"## {row_target}, {prog}", rows)
    return lines


def _by_class(c: ac.Cost) -> str:
    total = sum(f for _, f in c.flops_by_class)
    if not total:
        return "-"
    return " ".join(f"{cls} {f / total:.0%}" for cls, f in c.flops_by_class)


def rates_table(costs: list[ac.Cost]) -> list[str]:
    """One block per (chip, program): the rates roofline per policy, its ratio to bf16 of
    the same block, the same with each kernel bounded by its arithmetic too ('+alu':
    fusions by their HLO elementwise ops, Triton calls by their SASS; a '*' marks Triton
    calls left uncharged), the GEMM flops by operand type, temp memory and kernel count."""
    header = ("policy", "rates ms", "x bf16", "+alu ms", "x bf16", "GEMM TFLOP",
              "GEMM flops by type", "temp GB", "kernels", "GB moved")
    lines: list[str] = []
    for (row_target, prog), group in _blocks(costs, lambda c: c.rates_s).items():
        base = next((c for c in group if c.policy == "bf16"), None)
        rows = [header]
        for c in group:
            alu = _ms(c.rates_alu_s or None) + ("*" if c.alu_unmatched else "")
            rows.append((c.policy, _ms(c.rates_s), _ratio(c.rates_s, base and base.rates_s),
                         alu, _ratio(c.rates_alu_s or None, base and base.rates_alu_s or None),
                         f"{c.gemm_flops / 1e12:.2f}", _by_class(c), _gb(c.temp),
                         str(c.n_kernels), _gb(c.bytes)))
        lines += _aligned(f"## rates roofline: {row_target}, {prog}", rows)
    return lines


def calibrated_table(costs: list[ac.Cost]) -> list[str]:
    """One block per (chip, program) the calibrated model charged: its ms and ratio to bf16
    beside the peak roofline's (an upper bound on speed), then where the time goes per
    kernel class."""
    lines: list[str] = []
    for (row_target, prog), group in _blocks(costs, lambda c: c.calibrated_s).items():
        base = next((c for c in group if c.policy == "bf16"), None)
        classes = [k for k in calibrated.KERNEL_CLASSES
                   if any(k == cls for c in group for cls, _, _ in c.calibrated_by_class)]
        header = ("policy", "calibrated ms", "x bf16", "peak roofline ms", "x bf16") + tuple(
            f"{k} ms (n)" for k in classes)
        rows = [header]
        for c in group:
            by = {cls: (n, t) for cls, n, t in c.calibrated_by_class}
            rows.append((c.policy, _ms(c.calibrated_s), _ratio(c.calibrated_s,
                                                                base and base.calibrated_s),
                         _ms(c.rates_s), _ratio(c.rates_s, base and base.rates_s)) + tuple(
                f"{by[k][1] * 1e3:.2f} ({by[k][0]})" if k in by else "-" for k in classes))
        lines += _aligned(f"## calibrated model: {row_target}, {prog}", rows)
    return lines


def main(argv=None) -> int:
    from mxjax import policies

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                    help=f"comma list of {sorted(aot.TARGETS)}")
    ap.add_argument("--programs", default=",".join(PROGRAMS),
                    help=f"comma list of {list(PROGRAMS + EXTRA_PROGRAMS)}")
    ap.add_argument("--policies", default=",".join(policies.names()))
    ap.add_argument("--gpu-gemm", default="triton,cublas",
                    help="GPU GEMM variants: 'triton' (XLA's default), 'cublas' (triton off)")
    ap.add_argument("--matmul-size", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048, help="the 1B layer's and the MLP's")
    ap.add_argument("--seq-8b", type=int, default=LAYER_8B_SEQ, help="the 8B layer's")
    ap.add_argument("--attention", default="fused",
                    help="comma list of LlamaConfig.attention_impl values for the layers "
                         "(each a separate program; '' = the config's default, explicit)")
    ap.add_argument("--attention-baseline", default="explicit",
                    help="also compile each layer's bf16 train step with this attention_impl "
                         "(the fused-attention target; '' = none)")
    ap.add_argument("--peers", default="",
                    help="comma list of bench/costmodel/peers.py peers compiled beside the presets "
                         "(flax_fp8, jax_mxfp8, jax_nvfp4, jax_mxfp4, qwix_fp8); a peer that "
                         "cannot be built here is reported and skipped")
    ap.add_argument("--dump", type=Path, default=None, help="write each optimized HLO here")
    ap.add_argument("--autotune-results", type=Path, default=None,
                    help="GPU compiles load XLA's autotune results from this file "
                         "(written on a device by bench/device/gpu.py --dump-autotune)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    ap.add_argument("--top", type=int, default=0,
                    help=f"print each program's N slowest kernels (rates roofline, and the "
                         f"calibrated model's where it charges the chip; N <= "
                         f"{ac.TOP_KERNELS})")
    args = ap.parse_args(argv)

    import mxjax

    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if "bf16" not in names:
        names.insert(0, "bf16")
    for n in names:
        policies.get(n)  # unknown names fail before any compile
    from bench.costmodel import peers as peer_mod

    for p in (x.strip() for x in args.peers.split(",") if x.strip()):
        why = peer_mod.unavailable_reason(p)
        if why:
            print(f"# peer {p}: skipped: {why}", flush=True)
        else:
            names.append(f"peer:{p}")
    attentions = [a.strip() for a in args.attention.split(",") if a.strip()] or [""]
    baseline = args.attention_baseline.strip()
    targets = [aot.TARGETS[t.strip()] for t in args.targets.split(",") if t.strip()]
    variants_gpu = [v.strip() for v in args.gpu_gemm.split(",") if v.strip()]
    for v in variants_gpu:
        if v not in ("triton", "cublas"):
            raise SystemExit(f"--gpu-gemm: unknown variant {v!r}; expected triton, cublas")
    progs = [p.strip() for p in args.programs.split(",") if p.strip()]
    for p in progs:
        if p not in PROGRAMS + EXTRA_PROGRAMS:
            raise SystemExit(f"--programs: unknown {p!r}; expected some of "
                             f"{PROGRAMS + EXTRA_PROGRAMS}")
    print(f"jax {jax.__version__}; mxjax from {Path(mxjax.__file__).parent}; deviceless compiles "
          f"on {jax.default_backend()}", flush=True)
    costs: list[ac.Cost] = []
    kernel_cycles = ac.KernelCycles()
    t_start = time.perf_counter()
    for target in targets:
        why = aot.unavailable_reason(target)
        if why:
            print(f"# {target.name}: skipped: {why}", flush=True)
            continue
        variants = [("" if v == "triton" else v) for v in variants_gpu] if (
            target.kind == "gpu") else [""]
        for variant in variants:
            for prog, attention in ((p, a) for p in progs for a in (
                    attentions + ([baseline] if baseline and baseline not in attentions else [])
                    if p.startswith("layer") else [""])):
                for name in (names if attention in attentions or not prog.startswith("layer")
                             else ["bf16"]):
                    try:
                        c = ac.compile_one(target, variant, prog, name, args, kernel_cycles,
                                        attention=attention)
                    except Exception as e:  # one failed compile is a row, not the run's end
                        if not name.startswith("peer:"):
                            raise
                        print(f"  FAILED   {target.name} {prog} {name}: {type(e).__name__}: "
                              f"{str(e)[:300]}", flush=True)
                        continue
                    costs.append(c)
                    if args.json:  # after every compile: a long run that stops keeps its rows
                        args.json.write_text(json.dumps([dataclasses.asdict(x) for x in costs],
                                                        indent=1))
                    print(f"  compiled {c.row_target:12s} {c.row_program:8s} {name:18s} "
                          f"{c.compile_s:6.1f}s: {c.n_kernels} kernels, {_gb(c.bytes)} GB, "
                          f"rates {_ms(c.rates_s)} ms", flush=True)
    print()
    for line in table(costs):
        print(line)
    if args.top:
        for c in costs:
            print(f"## slowest kernels: {c.row_target}, {c.program}, {c.policy}")
            for name, cat, s, b, shape in c.top[: args.top]:
                print(f"  {s * 1e6:9.1f} us  {b / 1e6:9.1f} MB  {cat:11s} {name}  {shape}")
            if c.calibrated_top:
                print(f"## slowest kernels, calibrated model: {c.row_target}, {c.program}, "
                      f"{c.policy}")
            for name, cls, s, b, shape, why in c.calibrated_top[: args.top]:
                print(f"  {s * 1e6:9.1f} us  {b / 1e6:9.1f} MB  {cls:22s} {name}  {shape}"
                      + (f"  [{why}]" if why else ""))
    print()
    for line in rates_table(costs):
        print(line)
    print()
    for line in calibrated_table(costs):
        print(line)
    for chip in sorted({c.target for c in costs if c.calibrated_s}):
        print(f"calibrated rates, {chip}: {calibrated.rates_for(chip).basis}")
    print()
    print(ac.ASSUMPTIONS)
    print(ac.RATES_ASSUMPTIONS)
    for t in targets:
        if t.kind != "cpu" and t.name in R.CHIP_RATES:
            print("rates: " + R.rates_for(t.name).summary())
    compile_times = [c.compile_s for c in costs]
    if compile_times:
        print(f"{len(costs)} compiles, median {statistics.median(compile_times):.1f}s, total "
              f"{time.perf_counter() - t_start:.0f}s")
    print(emulation_verdict(costs))
    print(fp8_layer_verdict(costs))
    print(calibrated_verdict(costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
