"""The calibrated cost model: each kernel of a deviceless compile charged at a rate measured
on a chip (`bench.costmodel.calibration` files), not at a published peak.

Per kernel of the optimized HLO (`bench.costmodel.hlo_kernels`), in schedule order, no
overlap, plus a launch each::

    GEMM (XLA dot, cuBLAS(Lt), cuDNN)   flops / (published peak of its class x measured fraction)
    cuDNN fused attention               flops / (bf16 peak x bf16's measured fraction)
    XLA fusion                          PTX instructions x threads / measured issue rate
    Triton (Pallas) kernel              SASS x threads / (lane peak x its occupancy), or its
                                        register spills at the copy bandwidth, in whole
                                        waves of resident blocks
    every kernel, at least              bytes read + written / measured copy bandwidth

and a timed call adds the host's per-call overhead. `derive` reads every rate from the
chip's measurement files and the deviceless compiles of the microbenchmarks that measured
them (`bench/costmodel/calibration/compiled/`, compiled at the commit and jax that ran):

- copy bandwidth and per-call host overhead: two copies of different sizes (two equations);
- bf16 GEMM: the 8192^3 ``jnp.dot``'s time less the host overhead;
- issue rate of XLA fusions: XLA's two quantize passes on one bf16[8192, 14336] operand,
  the one parameter solved for (their kernels at the copy bandwidth and this rate);
- FP8 GEMM: ``mx_dot(xla_fp8)`` at 8192^3 less the host overhead and its other kernels;
- Triton kernels: no parameter (the GPU spec's SMs, lanes, registers and threads per SM, the
  kernel's ptxas resources and grid); checked against the Pallas quantize kernels timed
  alone and the 8B layer that runs 39 of them.

Not measured, assumed: the launch (``assumption.kernel_launch_s`` of mxjax/measurements.json)
and the attention's rate (bf16's fraction). A chip without measurements (B200) takes the
H200's fractions of its own published peaks (`CalibratedRates.basis` says so).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import math
from pathlib import Path

from bench.costmodel import calibration as cal
from bench.costmodel import hlo_kernels as hk
from bench.costmodel import rates as R

__all__ = ["KERNEL_CLASSES", "CalibratedRates", "Counts", "TritonKernel", "blocks_per_core",
           "derive", "kernel_class", "kernel_seconds", "load_counts", "occupancy",
           "program_seconds", "rates_for", "seconds_by_class", "slowest_kernels",
           "wave_factor", "waves"]

COMPILED_DIR = cal.CALIBRATION_DIR / "compiled"
# The ceilings section's copy (bench/device/gpu.py, full sizes): x + 1 on f32[2^28], bytes
# read + written; the file records it as GB/s.
CEILINGS_COPY_BYTES = 2 * 4 * 2**28
SIZE = 8192  # the GEMM rows' M = N = K
# The chip whose measured fractions of peak a chip without its own measurement takes.
REFERENCE_CHIP = "h200"
# Kernel classes of the per-class table, in print order.
KERNEL_CLASSES = ("gemm bf16", "gemm fp8", "gemm fp4", "gemm other", "attention",
                  "triton kernels", "fusions, ALU-bound", "fusions, memory-bound", "copies",
                  "other")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonKernel:
    """A Triton custom call as launched: threads, block size, shared memory, and what
    ptxas made of it (registers and spill bytes per thread, SASS instructions)."""

    threads: int
    block_threads: int
    shared_bytes: int
    registers: int
    spill_bytes: int
    sass: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Counts:
    """What a deviceless compile's dump adds to its HLO: PTX instructions x threads per
    XLA fusion (by HLO name) and the Triton calls' launches (by HLO name)."""

    fusion_instructions: dict[str, int]
    triton: dict[str, TritonKernel]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuLimits:
    """Per-SM limits of a GPU target spec (occupancy) and its f32 lane rate."""

    cores: int
    threads_per_core: int
    registers_per_core: int
    shared_per_core: int
    lane_ops_per_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibratedRates:
    """One chip's rates (module doc) and where each comes from."""

    chip: str
    gemm_flops_per_s: tuple[tuple[str, float], ...]  # rate class -> FLOP/s
    attention_flops_per_s: float
    copy_bytes_per_s: float
    issue_per_s: float  # XLA fusions: PTX instructions x threads per second
    launch_s: float
    host_s: float  # per timed call (added to a program's time to compare with a timing)
    limits: GpuLimits
    basis: str

    def fraction(self, cls: str) -> float:
        """This chip's rate of GEMM class ``cls`` over its published peak."""
        return self.gemm_rate(cls) / R.rates_for(self.chip).rate(cls)[0]

    def gemm_rate(self, cls: str) -> float:
        """FLOP/s of a GEMM of rate class ``cls`` (a class without units on the chip at the
        next wider class's, as the peak roofline does)."""
        have = dict(self.gemm_flops_per_s)
        for c in R.FALLBACK[cls]:
            if c in have:
                return have[c]
        raise ValueError(f"{self.chip}: no calibrated GEMM rate at or above {cls!r}")


def gpu_limits(target_name: str) -> GpuLimits:
    """The per-SM limits and lane rate of a bench/costmodel/aot.py GPU target's spec."""
    from bench.costmodel import aot

    target = aot.TARGETS[target_name]
    text = target.spec_path.read_text().split("matrix_unit_description", 1)[0]

    def field(name: str) -> int:
        for line in text.splitlines():
            if line.strip().startswith(name + ":"):
                return int(float(line.split(":", 1)[1]))
        raise ValueError(f"{target.spec_path}: no {name!r}")

    return GpuLimits(cores=field("core_count"), threads_per_core=field("threads_per_core_limit"),
                     registers_per_core=field("registers_per_core_limit"),
                     shared_per_core=field("shared_memory_per_core"),
                     lane_ops_per_s=target.alu_ops_per_s)


def blocks_per_core(t: TritonKernel, limits: GpuLimits) -> int:
    """Resident blocks per SM: bounded by registers (allocated per warp in units of 256),
    threads and shared memory."""
    regs = math.ceil(t.registers * 32 / 256) * 256 * (t.block_threads // 32)
    blocks = min(limits.registers_per_core // max(regs, 1),
                 limits.threads_per_core // t.block_threads,
                 limits.shared_per_core // t.shared_bytes if t.shared_bytes else 32, 32)
    return max(blocks, 1)


def occupancy(t: TritonKernel, limits: GpuLimits) -> float:
    """Resident threads per SM over the SM's limit (`blocks_per_core` blocks)."""
    return blocks_per_core(t, limits) * t.block_threads / limits.threads_per_core


def waves(t: TritonKernel, limits: GpuLimits) -> int:
    """How many rounds of resident blocks the grid takes (the last one possibly partial)."""
    slots = blocks_per_core(t, limits) * limits.cores
    return math.ceil(t.threads / t.block_threads / slots)


def wave_factor(t: TritonKernel, limits: GpuLimits) -> float:
    """Whole waves' threads over the grid's: a partial wave (a grid smaller than the chip's
    resident blocks, or its tail) takes a full wave's time, since each resident block's
    time is its own instruction and memory latency chain, not a share of a saturated chip."""
    slots = blocks_per_core(t, limits) * limits.cores
    return waves(t, limits) * slots * t.block_threads / t.threads


def kernel_class(k: hk.Kernel, counts: Counts, rates: CalibratedRates) -> str:
    """The row of `seconds_by_class` a kernel goes to."""
    if k.target.startswith(hk.FMHA_TARGET):
        return "attention"
    if k.gemms:
        classes = {c for c, _ in k.gemms}
        only = classes.pop() if len(classes) == 1 else ""
        return f"gemm {only}" if only in ("bf16", "fp8", "fp4") else "gemm other"
    if k.name in counts.triton:
        return "triton kernels"
    if k.category == "fusion":
        issue = counts.fusion_instructions.get(k.name, 0) / rates.issue_per_s
        return ("fusions, ALU-bound" if issue > k.bytes / rates.copy_bytes_per_s
                else "fusions, memory-bound")
    return "copies" if k.category == "copy" else "other"


def kernel_seconds(k: hk.Kernel, counts: Counts, rates: CalibratedRates) -> float:
    """One kernel's time under the calibrated rates, its launch included."""
    t = k.bytes / rates.copy_bytes_per_s
    if k.target.startswith(hk.FMHA_TARGET):
        t = max(t, sum(f for _, f in k.gemms) / rates.attention_flops_per_s)
    elif k.gemms:
        t = max(t, sum(f / rates.gemm_rate(c) for c, f in k.gemms))
    elif k.name in counts.triton:
        tk = counts.triton[k.name]
        issue = tk.threads * tk.sass / (rates.limits.lane_ops_per_s
                                        * occupancy(tk, rates.limits))
        spills = (k.bytes + tk.threads * tk.spill_bytes) / rates.copy_bytes_per_s
        t = max(issue, spills) * wave_factor(tk, rates.limits)
    elif k.category == "fusion":
        t = max(t, counts.fusion_instructions.get(k.name, 0) / rates.issue_per_s)
    return t + rates.launch_s


def program_seconds(ks: list[hk.Kernel], counts: Counts, rates: CalibratedRates) -> float:
    """A program's device time (its kernels, summed; without the host's per-call overhead)."""
    return sum(kernel_seconds(k, counts, rates) for k in ks)


def seconds_by_class(ks: list[hk.Kernel], counts: Counts, rates: CalibratedRates
                     ) -> dict[str, tuple[int, float]]:
    """Kernel class -> (kernels, seconds with their launches); every class present."""
    out = {c: (0, 0.0) for c in KERNEL_CLASSES}
    for k in ks:
        c = kernel_class(k, counts, rates)
        n, s = out[c]
        out[c] = (n + 1, s + kernel_seconds(k, counts, rates))
    return out


def slowest_kernels(ks: list[hk.Kernel], counts: Counts, rates: CalibratedRates, n: int
                    ) -> list[tuple[float, str, hk.Kernel, str]]:
    """The ``n`` kernels the model charges most, slowest first: (seconds with the launch,
    `kernel_class`, the kernel, what set a Triton kernel's time: its occupancy, registers
    per thread, SASS instructions per thread and waves; '' for other kernels)."""
    rows = []
    for k in ks:
        why = ""
        if k.name in counts.triton:
            tk = counts.triton[k.name]
            why = (f"occupancy {occupancy(tk, rates.limits):.0%} ({tk.registers} registers), "
                   f"{tk.sass} SASS per thread, {waves(tk, rates.limits)} waves")
        rows.append((kernel_seconds(k, counts, rates), kernel_class(k, counts, rates), k, why))
    rows.sort(key=lambda r: -r[0])
    return rows[:n]


# --- counts of a compile: from XLA's dump, or committed as JSON ---------------------------

def counts_from_dump(hlo_text: str, dump: Path) -> Counts:
    """The fusions' PTX instructions x threads and the Triton calls' launches and ptxas
    resources of a deviceless compile's XLA dump (`ptx_cost.dump_options`)."""
    import re

    from bench.costmodel import ptx_cost

    kernels = ptx_cost.ptx_kernels(dump)
    fusions = fusion_instructions(hlo_text, {n: t * i for n, (t, i) in kernels.items()})
    calls = ptx_cost._triton_calls(hlo_text)
    triton = {}
    if calls:
        launches = _launch_lines(dump)
        resources = ptx_cost.ptxas_resources(dump, tuple(sorted({n for _, n, _ in calls if n})))
        for hlo, name, grid in calls:
            match = [e for e, (g, _, _) in launches.items()
                     if re.sub(r"__\d+$", "", e) == name and g == grid and e in resources]
            if not match:
                continue
            grid_, block, shared = launches[match[0]]
            res = resources[match[0]]
            triton[hlo] = TritonKernel(threads=math.prod(grid_) * block, block_threads=block,
                                       shared_bytes=shared, registers=res.registers,
                                       spill_bytes=res.spill_store_bytes + res.spill_load_bytes,
                                       sass=res.sass)
    return Counts(fusion_instructions=fusions, triton=triton)


def _fingerprint(module: hk.Module, inst: hk.Instruction) -> str:
    """A fusion's fused computation with names and metadata left out: XLA emits one kernel
    for fusions equal up to names (its kernel reuse), so the dump has PTX for one of them."""
    import re

    body = []
    for i in module.computations.get(inst.called[0] if inst.called else "", ()):
        attrs = re.sub(r'metadata=\{[^}]*\}|%[\w.\-]+', "", i.attributes)
        body.append(f"{i.shape} {i.opcode} {len(i.operands)} {attrs}")
    return inst.shape + "|" + "|".join(body)


def fusion_instructions(hlo_text: str, by_kernel: dict[str, int]) -> dict[str, int]:
    """HLO fusion name -> PTX instructions x threads, from the dump's kernels by name (XLA
    names a kernel after its fusion, '.' as '_'); a fusion whose kernel XLA reused from an
    equal one takes that one's count."""
    module = hk.parse_module(hlo_text)
    fusions = [inst for inst, _ in hk._scheduled(module) if inst.opcode == "fusion"]
    out, by_print = {}, {}
    for inst in fusions:
        n = by_kernel.get(inst.name.replace(".", "_"))
        if n is not None:
            out[inst.name] = n
            by_print.setdefault(_fingerprint(module, inst), n)
    for inst in fusions:
        if inst.name not in out:
            n = by_print.get(_fingerprint(module, inst))
            if n is not None:
                out[inst.name] = n
    return out


def _launch_lines(dump: Path) -> dict[str, tuple[tuple[int, int, int], int, int]]:
    """kernel -> (grid, threads per block, shared memory bytes) from the thunk sequences."""
    import re

    line_re = re.compile(r"\] (\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), "
                         r"(\d+)\]\s+shared_memory: (\d+) bytes")
    out = {}
    for f in dump.glob("*thunk_sequence.txt"):
        for m in line_re.finditer(f.read_text()):
            g = tuple(int(m[i]) for i in (2, 3, 4))
            out[m[1]] = (g, int(m[5]) * int(m[6]) * int(m[7]), int(m[8]))
    return out


def counts_to_json(counts: Counts) -> dict:
    return {"fusion_instructions": counts.fusion_instructions,
            "triton": {k: dataclasses.asdict(v) for k, v in counts.triton.items()}}


def load_counts(stem: Path | str) -> tuple[list[hk.Kernel], Counts]:
    """A committed compile: ``<stem>.hlo.txt.gz`` parsed, and ``<stem>.counts.json``."""
    stem = Path(stem)
    hlo = Path(f"{stem}.hlo.txt.gz")
    data = Path(f"{stem}.counts.json")
    for f in (hlo, data):
        if not f.exists():
            raise cal.CalibrationError(f"{f}: missing (bench/costmodel/calibration_compile.py "
                                       "writes it)")
    with gzip.open(hlo, "rt", encoding="utf-8") as fh:
        ks = hk.kernels(fh.read())
    doc = json.loads(data.read_text())
    return ks, Counts(fusion_instructions=doc["fusion_instructions"],
                      triton={k: TritonKernel(**v) for k, v in doc["triton"].items()})


# --- the rates of a chip, derived from its measurements -----------------------------------

# Measurement rows (bench/costmodel/calibration/h200-*.json) and the committed compile of the
# program each timed (bench/costmodel/calibration/compiled/<run>/<program>).
COPY_ROW = "copy x+1, bf16[8192,14336]"
XLA_QUANTIZE_ROW = "xla two-pass row, bf16[8192,14336] H16 -> fp8"


def _solve(f, lo: float, hi: float) -> float:
    """The root of a decreasing f on [lo, hi] (bisection in log space)."""
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def derive(chip: str = "h200", directory: Path = cal.CALIBRATION_DIR, *,
           runs: tuple[str, ...] | None = None) -> CalibratedRates:
    """The calibrated rates of ``chip`` from the measurement files in ``directory``.

    Which file gives each rate (bench/README.md, "Calibration files"): every schema-valid
    ``<chip>-<date>[-<tag>].json`` of the chip is read, and each rate comes from the newest
    file (provenance date, then name) that measured it, or only from the files whose stems
    ``runs`` names (an explicit choice). A row whose microbenchmark is compiled under
    ``compiled/<stem>/`` was timed per call (bench/gpu.py): its time is taken less the host's
    overhead and its other kernels; a row without one is a rate as bench/device writes it
    (batched calls, the host hidden). What no file of the chip measured takes the
    `REFERENCE_CHIP`'s measured fraction of the same peak (``basis`` names each source).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise cal.CalibrationError(f"{directory}: no calibration directory")
    newest = _chip_runs(chip, directory, runs)
    ref = None if chip == REFERENCE_CHIP else derive(REFERENCE_CHIP, directory)
    peaks = R.rates_for(chip)
    limits = gpu_limits(chip)
    sources: dict[str, str] = {}

    def missing(what: str):
        if ref is None:
            raise cal.CalibrationError(
                f"{directory}: no {chip} calibration file{' of ' + str(runs) if runs else ''} "
                f"measures {_WHAT[what]}; a GPU run's bench/device/profile.py writes one "
                "(bench/README.md, 'Calibration files', names the rows each rate needs)")
        sources[what] = f"the {REFERENCE_CHIP}'s, not measured on the {chip}"

    # Launch: the device profile's chain of tiny kernels, else the assumption.
    run = next((r for r in newest if r.launch_overhead_us), None)
    launch = run.launch_overhead_us * 1e-6 if run else R.LAUNCH_S
    sources["launch"] = run.path.name if run else "assumed (mxjax/measurements.json)"
    # Copy bandwidth and host overhead. Two copies timed per call (the small one compiled)
    # give both (t = bytes / bw + host); a batched copy gives the bandwidth alone.
    bw = host = None
    two = next((r for r in newest if r.copy_bandwidth_gbs and _row(r, COPY_ROW)
                and _compiled(directory, r, "copy_bf16")), None)
    if two is not None:
        small_ks, _ = load_counts(_compiled(directory, two, "copy_bf16"))
        small_bytes = sum(k.bytes for k in small_ks)
        small_s = _row(two, COPY_ROW).total_us * 1e-6
        big_s = CEILINGS_COPY_BYTES / (two.copy_bandwidth_gbs * 1e9)
        bw = (CEILINGS_COPY_BYTES - small_bytes) / (big_s - small_s)
        host = small_s - small_bytes / bw - launch
        sources["copy"] = sources["host"] = two.path.name
    run = next((r for r in newest if r.copy_bandwidth_gbs), None)
    if run is not None and run is not two:  # a newer batched copy
        bw = run.copy_bandwidth_gbs * 1e9
        sources["copy"] = run.path.name
    if bw is None:
        missing("copy")
        bw = peaks.hbm_bytes_per_s * ref.copy_bytes_per_s / R.rates_for(REFERENCE_CHIP
                                                                        ).hbm_bytes_per_s
    if host is None:
        missing("host")
        host = ref.host_s
    # bf16 GEMM at 8192^3.
    flops = 2 * SIZE**3
    measured: dict[str, float] = {}
    run = next((r for r in newest if _gemms(r, ("bf16",))), None)
    if run is not None:
        rows = _gemms(run, ("bf16",))
        if _compiled(directory, run, "gemm_bf16"):
            measured["bf16"] = flops / (flops / (rows[0].tflops * 1e12) - host - launch)
        else:
            measured["bf16"] = max(g.tflops for g in rows) * 1e12
        sources["bf16"] = run.path.name
    else:
        missing("bf16")
    bf16 = measured.get("bf16") or peaks.rate("bf16")[0] * ref.fraction("bf16")
    partial = CalibratedRates(chip=chip, gemm_flops_per_s=(("bf16", bf16),),
                              attention_flops_per_s=bf16, copy_bytes_per_s=bw, issue_per_s=1.0,
                              launch_s=launch, host_s=host, limits=limits, basis="")
    # The fusions' issue rate: XLA's two quantize passes, the one parameter solved for.
    run = next((r for r in newest if _row(r, XLA_QUANTIZE_ROW)
                and _compiled(directory, r, "quantize_xla_row")), None)
    if run is not None:
        ks, counts = load_counts(_compiled(directory, run, "quantize_xla_row"))
        timed = _row(run, XLA_QUANTIZE_ROW).total_us * 1e-6 - host

        def excess(rate):
            r = dataclasses.replace(partial, issue_per_s=rate)
            return program_seconds(ks, counts, r) - timed

        issue = _solve(excess, 1e11, 1e15)
        sources["issue"] = run.path.name
    else:
        missing("issue")
        issue = limits.lane_ops_per_s * ref.issue_per_s / ref.limits.lane_ops_per_s
    partial = dataclasses.replace(partial, issue_per_s=issue)
    # FP8 GEMM: mx_dot(xla_fp8) timed per call less its other kernels, or the device
    # profile's FP8 rows at HIGHEST (promoted accumulation: fp8's dgrad and wgrad).
    run = next((r for r in newest if _fp8_rows(directory, r)), None)
    if run is not None:
        rows = _fp8_rows(directory, run)
        stem = _compiled(directory, run, "gemm_xla_fp8")
        if stem:
            ks, counts = load_counts(stem)
            others = sum(kernel_seconds(k, counts, partial) for k in ks if not k.gemms)
            gemm_s = flops / (rows[0].tflops * 1e12) - host - others - launch
            measured["fp8"] = flops / gemm_s
        else:
            measured["fp8"] = max(g.tflops for g in rows) * 1e12
        sources["fp8"] = run.path.name
    else:
        missing("fp8")
    # FP4: cuDNN's block-scaled NVFP4 rows (Blackwell), else FP8's fraction of the FP4 peak.
    run = next((r for r in newest if _gemms(r, ("nvfp4",))), None)
    if run is not None:
        measured["fp4"] = max(g.tflops for g in _gemms(run, ("nvfp4",))) * 1e12
        sources["fp4"] = run.path.name
    fraction = {c: measured[c] / peaks.rate(c)[0] if c in measured else ref.fraction(c)
                for c in ("bf16", "fp8")}
    if "fp4" not in measured and dict(peaks.matrix_flops).get("fp4"):
        sources["fp4"] = "at FP8's fraction of its peak"
    gemm = tuple((c, measured[c] if c in measured else f * fraction[_FRACTION_OF[c]])
                 for c, f in peaks.matrix_flops if c in _FRACTION_OF)
    hbm = peaks.hbm_bytes_per_s
    basis = (f"{chip}: GEMMs bf16 {bf16 / 1e12:.0f} TFLOP/s ({fraction['bf16']:.0%} of peak; "
             f"{sources['bf16']}), FP8 {dict(gemm)['fp8'] / 1e12:.0f} ({fraction['fp8']:.0%}; "
             f"{sources['fp8']})"
             + (f", FP4 {dict(gemm)['fp4'] / 1e12:.0f} ({sources['fp4']})"
                if "fp4" in dict(gemm) else "")
             + f"; copy {bw / 1e12:.2f} TB/s ({bw / hbm:.0%}; {sources['copy']}); XLA fusions "
             f"{issue / 1e12:.1f}e12 PTX instructions/s ({issue / limits.lane_ops_per_s:.0%} of "
             f"the lanes; {sources['issue']}); host {host * 1e6:.0f} us per timed call "
             f"({sources['host']}); launch {launch * 1e6:.1f} us per kernel "
             f"({sources['launch']}). Assumed: attention at bf16's fraction")
    return dataclasses.replace(partial, gemm_flops_per_s=gemm, basis=basis)


_WHAT = {"copy": "the copy bandwidth", "host": "the host's per-call overhead (two copies)",
         "bf16": "a bf16 GEMM at 8192^3", "fp8": "an FP8 GEMM at 8192^3",
         "issue": f"the XLA quantize passes ({XLA_QUANTIZE_ROW!r}, compiled)"}
# The measured class whose fraction of peak a GEMM class without its own measurement takes.
_FRACTION_OF = {"fp4": "fp8", "fp8": "fp8", "int8": "fp8", "bf16": "bf16", "tf32": "bf16"}


def _chip_runs(chip: str, directory: Path, runs: tuple[str, ...] | None
               ) -> tuple[cal.Calibration, ...]:
    """The chip's files, newest first; only those whose stems ``runs`` names when given."""
    have = tuple(c for c in cal.load_all(directory) if c.chip == chip)
    if runs is not None:
        unknown = sorted(set(runs) - {c.path.stem for c in have})
        if unknown:
            raise cal.CalibrationError(
                f"{directory}: runs={unknown} name no {chip} calibration file there; it has "
                f"{sorted(c.path.stem for c in have)}")
        have = tuple(c for c in have if c.path.stem in runs)
    return tuple(sorted(have, key=lambda c: (c.provenance.date, c.path.name), reverse=True))


def _compiled(directory: Path, run: cal.Calibration, program: str) -> Path | None:
    """The committed compile of ``program`` as ``run`` timed it, or None."""
    stem = directory / "compiled" / run.path.stem / program
    found = all(Path(f"{stem}{s}").exists() for s in (".hlo.txt.gz", ".counts.json"))
    return stem if found else None


def _row(run: cal.Calibration, name: str) -> cal.KernelTime | None:
    return next((k for k in run.kernels if k.name == name), None)


def _gemms(run: cal.Calibration, operands: tuple[str, ...]) -> list[cal.GemmRate]:
    """``run``'s GEMM rows of those operand classes at 8192^3."""
    return [g for g in run.gemms if g.operands in operands and g.m == g.n == g.k == SIZE]


def _fp8_rows(directory: Path, run: cal.Calibration) -> list[cal.GemmRate]:
    """The FP8 rows `derive` reads: the per-call ``mx_dot(xla_fp8)`` row where its compile
    is committed, else the device profile's rows at HIGHEST."""
    if _compiled(directory, run, "gemm_xla_fp8"):
        return _gemms(run, ("e5m2xe4m3",))
    return [g for g in _gemms(run, ("e4m3xe4m3", "e5m2xe4m3"))
            if g.setting.startswith("HIGHEST")]


@functools.cache
def rates_for(chip: str) -> CalibratedRates:
    """`derive`'s rates of ``chip`` from the committed files (cached)."""
    return derive(chip)
